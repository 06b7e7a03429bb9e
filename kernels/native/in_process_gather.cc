// An all-gather among the devices of one process, for XLA:CPU's virtual devices: an XLA FFI
// handler (jax.ffi), built and loaded by kernels/native_gather.py.
//
// XLA:CPU's own in-process all-gather meets at two barriers, and on a machine with fewer cores
// than devices each is a round of sleeps and wake-ups of every device thread: about 0.36 ms at
// 16 devices on 2 cores, whatever the bytes. Here one gather is one barrier: each device copies
// its part into a shared buffer, the last to arrive wakes the others with one futex call, and
// each copies every part out. The buffer lives until the last device has copied out, so no
// second barrier is needed.
//
// A gather is named by (execution, call site): XLA gives every device of one program launch the
// same RunId, and the call site's id is fixed when the program is traced. The first device to
// arrive creates the gather's slot, the last to leave frees it. A call site that runs again
// within one execution (inside a loop) joins a fresh slot once the previous one is freed.
//
// Arguments: x (any dtype and shape), rank s32[] (this device's place, 0 <= rank < size);
// attributes size (devices taking part: every device of the program), call_site, timeout_ms.
// Result: [size, *x.shape] in x's dtype, the parts in rank order.
// A device that waits longer than timeout_ms returns an error saying how many had arrived
// (another device's program failed before the gather, say), instead of hanging.

#if !defined(__linux__)
#error "the in-process gather waits on Linux futexes"
#endif

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Clock = std::chrono::steady_clock;

struct Gather {
  Gather(size_t part_bytes, int64_t size) : part_bytes(part_bytes), parts(part_bytes * size) {}
  const size_t part_bytes;
  std::vector<char> parts;
  int64_t joined = 0;                // devices that took a place (under Table::mutex)
  std::atomic<int32_t> arrived{0};   // parts written
  std::atomic<int32_t> complete{0};  // 1 once every part is written
  std::atomic<int32_t> left{0};      // devices that copied every part out
  std::atomic<int32_t> freed{0};     // 1 once out of the table
};

using Key = std::pair<int64_t, int64_t>;  // (RunId, call site)

struct Table {
  std::mutex mutex;
  std::map<Key, std::shared_ptr<Gather>> gathers;
};

Table& TheTable() {
  static Table* table = new Table();  // never destroyed: device threads may outlive statics
  return *table;
}

int32_t* Word(std::atomic<int32_t>& a) { return reinterpret_cast<int32_t*>(&a); }

// Sleeps while `word` holds `expected`, until `deadline`; false if the deadline passed first.
bool WaitWhile(std::atomic<int32_t>& word, int32_t expected, Clock::time_point deadline) {
  while (word.load(std::memory_order_acquire) == expected) {
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) return false;
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    syscall(SYS_futex, Word(word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
  }
  return true;
}

void WakeAll(std::atomic<int32_t>& word) {
  syscall(SYS_futex, Word(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// This device's place in the gather `key`; null if the deadline passed while the call site's
// previous gather (same execution, a loop) was still being read.
std::shared_ptr<Gather> Join(const Key& key, size_t part_bytes, int64_t size,
                             Clock::time_point deadline) {
  Table& table = TheTable();
  for (;;) {
    std::shared_ptr<Gather> full;
    {
      std::lock_guard<std::mutex> lock(table.mutex);
      std::shared_ptr<Gather>& slot = table.gathers[key];
      if (!slot) slot = std::make_shared<Gather>(part_bytes, size);
      if (slot->joined < size) {
        ++slot->joined;
        return slot;
      }
      full = slot;
    }
    if (!WaitWhile(full->freed, 0, deadline)) return nullptr;
  }
}

void Leave(const Key& key, const std::shared_ptr<Gather>& gather, int64_t size) {
  if (gather->left.fetch_add(1, std::memory_order_acq_rel) + 1 != size) return;
  Table& table = TheTable();
  {
    std::lock_guard<std::mutex> lock(table.mutex);
    auto it = table.gathers.find(key);
    if (it != table.gathers.end() && it->second == gather) table.gathers.erase(it);
  }
  gather->freed.store(1, std::memory_order_release);
  WakeAll(gather->freed);
}

ffi::Error TimedOut(int64_t call_site, int64_t timeout_ms, int32_t arrived, int64_t size) {
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                    "in-process gather (call site " + std::to_string(call_site) + "): " +
                        std::to_string(arrived) + " of " + std::to_string(size) +
                        " devices arrived within " + std::to_string(timeout_ms) +
                        " ms; another device's program failed or never ran");
}

ffi::Error InProcessGatherImpl(ffi::RunId run, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                               ffi::Result<ffi::AnyBuffer> out, int64_t size,
                               int64_t call_site, int64_t timeout_ms) {
  const int32_t rank = rank_buf.typed_data()[0];
  if (rank < 0 || rank >= size) {
    return ffi::Error::InvalidArgument("in-process gather: rank " + std::to_string(rank) +
                                       " is not in [0, " + std::to_string(size) + ")");
  }
  const size_t part_bytes = x.size_bytes();
  if (out->size_bytes() != part_bytes * size) {
    return ffi::Error::InvalidArgument("in-process gather: the result does not hold size "
                                       "parts of x");
  }
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  const Key key{run.run_id, call_site};
  std::shared_ptr<Gather> gather = Join(key, part_bytes, size, deadline);
  if (!gather) return TimedOut(call_site, timeout_ms, 0, size);
  if (gather->part_bytes != part_bytes) {
    return ffi::Error::InvalidArgument("in-process gather: devices disagree on the part size");
  }
  std::memcpy(gather->parts.data() + rank * part_bytes, x.untyped_data(), part_bytes);
  if (gather->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == size) {
    gather->complete.store(1, std::memory_order_release);
    WakeAll(gather->complete);
  } else if (!WaitWhile(gather->complete, 0, deadline)) {
    return TimedOut(call_site, timeout_ms, gather->arrived.load(), size);
  }
  std::memcpy(out->untyped_data(), gather->parts.data(), part_bytes * size);
  Leave(key, gather, size);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpInProcessGather, InProcessGatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rank
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("size")
                                  .Attr<int64_t>("call_site")
                                  .Attr<int64_t>("timeout_ms"));
