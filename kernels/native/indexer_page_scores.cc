// DSA indexer page scores over bf16 keys for XLA:CPU, as one pass over the pages: an XLA FFI
// handler (jax.ffi), built and loaded by kernels/native_indexer.py.
//
// XLA:CPU computes the same thing (kernels/xla_indexer.py) as a page gather, a bf16 -> f32
// widening and a product, each its own pass over memory; with a query or a few per sequence
// (decode) the work per key is a handful of multiply-adds and those passes are the cost. Here
// each page is read once: its keys are widened in registers, scored and reduced to the page
// max while they are in L1, and the page a few ahead is prefetched (pages of a sequence sit
// anywhere in the pool).
//
//   I(t, s) = sum_h w_h(t) * ReLU(q_h(t) . k(s));   P(t, p) = max over visible s in p of I(t, s)
//
// Arguments (shapes as in kernels/reference.py, indexer_page_scores):
//   q f32[B, Q, H, D], w f32[B, Q, H], keys u16[P + 1, ps, D] (bf16 bit patterns),
//   local_pages s32[B, M], q_pos s32[B, Q], shard s32[], rotation s32[B];
//   attributes num_shards, vectorized (0: the portable loop; 1: AVX2 + FMA where the CPU has
//   them, D % 16 == 0 and ps % 8 == 0, else the portable loop).
// Result: f32[B, Q, M]; -inf for a page with no visible key. A key at position s is visible to
// a query at t when 0 <= s <= t; local page j holds logical page j * num_shards + shard -
// rotation. Slots index the cache as jnp indexing does: a negative one counts from the end (-1
// is the sentinel page), then out-of-range ones are clamped.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kPrefetchPages = 4;  // pages ahead: enough to hide a miss at DRAM latency

struct Shapes {
  int64_t batch, queries, heads, dim, slots, page_size, pages;
};

float Bf16ToF32(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

void Prefetch(const uint16_t* page, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(page);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// Portable: one key at a time, the dot product in index order.
float PageScorePortable(const uint16_t* page, const Shapes& s, const float* q, const float* w,
                        int64_t base, int64_t q_pos) {
  float best = kNegInf;
  for (int64_t t = 0; t < s.page_size; ++t) {
    const int64_t key_pos = base + t;
    if (key_pos < 0 || key_pos > q_pos) continue;
    const uint16_t* key = page + t * s.dim;
    float score = 0.f;
    for (int64_t h = 0; h < s.heads; ++h) {
      float dot = 0.f;
      for (int64_t d = 0; d < s.dim; ++d) dot += q[h * s.dim + d] * Bf16ToF32(key[d]);
      score += w[h] * std::max(dot, 0.f);
    }
    best = std::max(best, score);
  }
  return best;
}

#if defined(__x86_64__)
// Eight keys' dot products with one query head, as one vector. A u32 lane holds two bf16:
// shifting it left by 16 gives the even element as f32, masking the low half the odd one, so
// `q_split` holds each 16-dim chunk of q as [even elements | odd elements].
__attribute__((target("avx2,fma"))) inline __m256 Dots8(const uint16_t* keys, int64_t dim,
                                                         const float* q_split) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  __m256 acc[8];
  for (int g = 0; g < 8; ++g) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + g * dim + c));
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q_split + c),
                          _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), a);
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q_split + c + 8),
                          _mm256_castsi256_ps(_mm256_and_si256(x, high)), a);
    }
    acc[g] = a;
  }
  // Horizontal sums of the eight, each key's lanes added in the same order whatever its slot.
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

__attribute__((target("avx2,fma"))) float PageScoreAvx2(const uint16_t* page, const Shapes& s,
                                                        const float* q_split, const float* w,
                                                        int64_t base, int64_t q_pos) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i limit = _mm256_set1_epi32(int32_t(q_pos));
  const __m256i before_start = _mm256_set1_epi32(-1);
  __m256 best = _mm256_set1_ps(kNegInf);
  for (int64_t t = 0; t < s.page_size; t += 8) {
    __m256 score = zero;
    for (int64_t h = 0; h < s.heads; ++h) {
      const __m256 dots = Dots8(page + t * s.dim, s.dim, q_split + h * s.dim);
      score = _mm256_fmadd_ps(_mm256_set1_ps(w[h]), _mm256_max_ps(dots, zero), score);
    }
    const __m256i key_pos = _mm256_add_epi32(_mm256_set1_epi32(int32_t(base + t)), lanes);
    const __m256i visible = _mm256_andnot_si256(_mm256_cmpgt_epi32(key_pos, limit),
                                                _mm256_cmpgt_epi32(key_pos, before_start));
    best = _mm256_blendv_ps(best, _mm256_max_ps(best, score), _mm256_castsi256_ps(visible));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

bool CpuHasAvx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#endif

// q f32[rows, D] -> each 16-dim chunk as [even elements | odd elements] (see Dots8).
std::vector<float> SplitEvenOdd(const float* q, int64_t rows, int64_t dim) {
  std::vector<float> out(rows * dim);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < dim; c += 16)
      for (int64_t j = 0; j < 8; ++j) {
        out[r * dim + c + j] = q[r * dim + c + 2 * j];
        out[r * dim + c + 8 + j] = q[r * dim + c + 2 * j + 1];
      }
  return out;
}

ffi::Error IndexerPageScoresImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> w,
                                 ffi::Buffer<ffi::U16> keys, ffi::Buffer<ffi::S32> local_pages,
                                 ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> shard,
                                 ffi::Buffer<ffi::S32> rotation, int64_t num_shards,
                                 int64_t vectorized, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), pd = local_pages.dimensions();
  if (qd.size() != 4 || kd.size() != 3 || pd.size() != 2 || kd[2] != qd[3] || pd[0] != qd[0])
    return ffi::Error::InvalidArgument("indexer_page_scores: expected q[B, Q, H, D], "
                                       "keys[P + 1, ps, D], local_pages[B, M]");
  const Shapes s{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], pd[1]};
  if (s.queries == 0) return ffi::Error::Success();
  bool avx2 = false;
#if defined(__x86_64__)
  avx2 = vectorized && s.dim % 16 == 0 && s.page_size % 8 == 0 && CpuHasAvx2();
#endif
  const std::vector<float> q_split = avx2 ? SplitEvenOdd(q.typed_data(), s.batch * s.queries *
                                                         s.heads, s.dim) : std::vector<float>();
  const float* q_rows = avx2 ? q_split.data() : q.typed_data();
  const uint16_t* cache = keys.typed_data();
  const int32_t* pages = local_pages.typed_data();
  const int32_t* positions = q_pos.typed_data();
  const int64_t page_elems = s.page_size * s.dim;
  float* result = out->typed_data();

  for (int64_t b = 0; b < s.batch; ++b) {
    const int32_t* row_pos = positions + b * s.queries;
    const int64_t last_query = *std::max_element(row_pos, row_pos + s.queries);
    auto page_of = [&](int64_t j) {
      int64_t slot = pages[b * s.pages + j];
      slot = std::clamp<int64_t>(slot < 0 ? slot + s.slots : slot, 0, s.slots - 1);
      return cache + slot * page_elems;
    };
    for (int64_t j = 0; j < s.pages; ++j) {
      const int64_t base = (j * num_shards + shard.typed_data()[0] -
                            rotation.typed_data()[b]) * s.page_size;
      float* col = result + b * s.queries * s.pages + j;
      if (base > last_query) {  // every key is past every query: nothing to read
        for (int64_t i = 0; i < s.queries; ++i) col[i * s.pages] = kNegInf;
        continue;
      }
      if (j + kPrefetchPages < s.pages) Prefetch(page_of(j + kPrefetchPages), 2 * page_elems);
      const uint16_t* page = page_of(j);
      for (int64_t i = 0; i < s.queries; ++i) {
        const int64_t row = b * s.queries + i;
        const float* qr = q_rows + row * s.heads * s.dim;
        const float* wr = w.typed_data() + row * s.heads;
#if defined(__x86_64__)
        if (avx2) {
          col[i * s.pages] = PageScoreAvx2(page, s, qr, wr, base, row_pos[i]);
          continue;
        }
#endif
        col[i * s.pages] = PageScorePortable(page, s, qr, wr, base, row_pos[i]);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpIndexerPageScores, IndexerPageScoresImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w
                                  .Arg<ffi::Buffer<ffi::U16>>()   // keys (bf16 bits)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // local_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_pos
                                  .Arg<ffi::Buffer<ffi::S32>>()   // shard
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rotation
                                  .Attr<int64_t>("num_shards")
                                  .Attr<int64_t>("vectorized")
                                  .Ret<ffi::Buffer<ffi::F32>>());
