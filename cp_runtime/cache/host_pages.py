"""The latent cache held in host memory (`RuntimeConfig.latent_memory = "host"`).

A shard's latent buffer then lives in its host's pinned memory as 32-bit words, a page a row,
u32[P + 1, ps / pk, D] (kernels/page_words.py: how a TPU packs pk narrow values into a word,
so that a kernel reads a page's words as its values for free). A step moves only the pages it
needs into HBM (`read_pages`), works on them there with the same kernels as a device pool, and
moves back the pages it wrote (`write_pages`). Each
page is one asynchronous copy of whole (8, 128) tiles of words (ps / pk rows: 16 for fp8 pages
of 64): XLA:TPU lowers a dynamic slice of a host buffer, or a dynamic update of one, to a DMA.
The pool is not held in its own dtype there because XLA:TPU copies only 32-bit-tiled host
buffers page by page: given an fp8 one, it relays out the whole buffer first (compiled here for
TPU7x).

The copies run in loops bounded by how many of the pages this shard owns (`owned_first`), not
by the step's whole selection: a decode row's K + 1 selected pages sit on 1/S of the shards on
average; `GROUP` of them a loop step, so that several are in flight at once.

A shard may also hold its first page slots in HBM (`RuntimeConfig.latent_device_pages`):
`TieredPages` is then its buffer, the device's pages for slots [0, Pd) and the host's words
for [Pd, P), and every function here takes it where it takes words. The allocator hands out
the lowest free slot first, so sessions take HBM pages while there are any, and a step whose
pages all lie there runs the device pool's program over that tier (cp_runtime.engine.step,
`in_hbm`); a step with any host page stages its pages from both tiers here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from cp_runtime.kernels.page_words import from_words, to_words

__all__ = ["GROUP", "TieredPages", "is_tiered", "owned_first", "read_pages", "write_pages",
           "host_sharding", "read_rows", "write_rows"]

# Pages a loop step copies. One at a time, a copy waits for the last; eight in flight reached
# about the rate of one contiguous slice on a TPU v5e (`cp-runtime bench host_pages`;
# docs/notes/2026-12-07-host-latent-cache.md, "The latent cache in host memory").
GROUP = 8


def host_sharding(sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
    """`sharding` in its devices' pinned host memory; on CPU, as it is: there the host's memory
    is the devices' own, and JAX 0.10 cannot lower a program with host-memory outputs beside
    the ordered callbacks of interpret-mode kernels. The buffer then keeps its words and the
    steps stage its pages as on a TPU, each copy a copy within the same memory."""
    if sharding.mesh.devices.flat[0].platform == "cpu":
        return sharding
    return sharding.with_memory_kind("pinned_host")


@dataclasses.dataclass(frozen=True)
class TieredPages:
    """A shard's latent cache in two memories, read and written as one words buffer of P + 1
    pages:

        device: T[..., Pd + 1, ps, D]       slots [0, Pd), in HBM, in the pool's dtype (a
                                            device pool's layout: a step whose pages all lie
                                            here runs over it as over a device pool); its
                                            last page discards writes
        host:   u32[..., P - Pd + 1, ps / pk, D]   slots [Pd, P] as words (P, the sentinel:
                                            its last page)

    Indexing maps over both (`buf[0]`, `buf[None]`), and `shape` / `dtype` / `nbytes` are
    those of the words buffer it stands for, so code written for a words buffer takes it."""

    device: jax.Array
    host: jax.Array

    @property
    def device_pages(self) -> int:
        """Pd: the slots held in HBM."""
        return self.device.shape[-3] - 1

    @property
    def shape(self) -> tuple[int, ...]:
        host = self.host.shape
        return host[:-3] + (self.device_pages + host[-3],) + host[-2:]

    @property
    def dtype(self):
        return self.host.dtype

    @property
    def nbytes(self) -> int:
        return self.device.nbytes + self.host.nbytes

    def __getitem__(self, index) -> "TieredPages":
        return TieredPages(self.device[index], self.host[index])


jax.tree_util.register_dataclass(TieredPages, data_fields=["device", "host"], meta_fields=[])


def is_tiered(buf) -> bool:
    """Whether `buf` is a `TieredPages` (a pytree of two arrays, not one)."""
    return isinstance(buf, TieredPages)


def _on_host(words: jax.Array) -> bool:
    return jax.typeof(words).memory_space == jax.memory.Space.Host


def owned_first(slots: jax.Array, sentinel: int) -> tuple[jax.Array, jax.Array]:
    """slots i32[N] (`sentinel`, the pool's last page, where this shard owns nothing) ->
    (order i32[N], count): the entries this shard owns first, by slot, then the rest; count,
    how many it owns. By slot, so that pages staged in this order keep the pool's order: the
    XLA attention path sums a block's pages in slot order, and gives over the staged pages
    what it gives over the pool, bit for bit."""
    order = jnp.argsort(slots, stable=True).astype(jnp.int32)
    return order, jnp.sum(slots != sentinel, dtype=jnp.int32)


def read_pages(words: jax.Array, slots: jax.Array, count: jax.Array,
               group: int = GROUP) -> jax.Array:
    """Copy pages into device memory: words u32[P + 1, ps / pk, D] (host), slots i32[N] ->
    u32[N', ps / pk, D] (device; N' = N rounded up to whole groups of `group`, plus one):
    entry i the page at slots[i] for i < count; after that, up to a whole group, the last
    (sentinel) page; then zeros. The last entry is never written (a place to discard
    writes)."""
    if is_tiered(words):
        return _read_tiered(words, slots, count, group)
    n = slots.shape[0]
    staged = jnp.zeros((-(-n // group) * group + 1,) + words.shape[1:], words.dtype)
    slots = _grouped(slots, count, words.shape[0] - 1, group)

    def one_group(g, staged):
        pages = []
        for j in range(group):
            page = lax.dynamic_slice_in_dim(words, slots[g * group + j], 1, axis=0)
            pages.append(jax.device_put(page, jax.memory.Space.Device) if _on_host(words)
                         else page)
        return lax.dynamic_update_slice_in_dim(staged, jnp.concatenate(pages), g * group, 0)

    return lax.fori_loop(0, -(-count // group), one_group, staged)


def write_pages(words: jax.Array, pages: jax.Array, slots: jax.Array, count: jax.Array,
                group: int = GROUP) -> jax.Array:
    """Copy pages back to host memory: pages u32[N, ps / pk, D] (device) into words
    u32[P + 1, ps / pk, D] (host) at slots i32[N], for i < count (the rest of a group writes
    the last, sentinel, page); returns the updated words (in place where donated)."""
    if is_tiered(words):
        return _write_tiered(words, pages, slots, count, group)
    n = slots.shape[0]
    slots = _grouped(slots, count, words.shape[0] - 1, group)
    pages = jnp.pad(pages, ((0, slots.shape[0] - n), (0, 0), (0, 0)))

    def one_group(g, words):
        for j in range(group):
            page = lax.dynamic_slice_in_dim(pages, g * group + j, 1, axis=0)
            if _on_host(words):
                page = jax.device_put(page, jax.memory.Space.Host)
            words = lax.dynamic_update_slice_in_dim(words, page, slots[g * group + j], axis=0)
        return words

    return lax.fori_loop(0, -(-count // group), one_group, words)


def _grouped(slots: jax.Array, count: jax.Array, sentinel: int, group: int) -> jax.Array:
    """slots i32[N] padded to whole groups, the sentinel at every entry from `count` on."""
    n = slots.shape[0]
    padded = jnp.pad(slots, (0, -(-n // group) * group - n))
    return jnp.where(jnp.arange(padded.shape[0]) < count, padded, sentinel)


def _split(words: TieredPages, slots: jax.Array, count: jax.Array, in_device: bool):
    """The entries i < count of slots i32[N] in one tier (the device's, or the host's):
    (order i32[N]: the tier's entries first, in entry order; their slots in the tier's
    buffer, then its last page; how many)."""
    n, pd = slots.shape[0], words.device_pages
    live = jnp.arange(n) < count
    mine = live & ((slots < pd) if in_device else (slots >= pd))
    order = jnp.argsort(~mine, stable=True).astype(jnp.int32)
    mine_count = jnp.sum(mine, dtype=jnp.int32)
    buffer = words.device if in_device else words.host
    tier_slots = jnp.where(jnp.arange(n) < mine_count,
                           slots[order] - (0 if in_device else pd), buffer.shape[0] - 1)
    return order, tier_slots, mine_count


def _move_pages(src, dst, src_at, dst_at, count, group: int, convert):
    """dst[dst_at[i]] = convert(src[src_at[i]]) for i < count, `group` pages a loop step (the
    rest of the last group: src_at and dst_at's entries past count, which must be harmless),
    each page read and written where it lies (a page of host memory moved to HBM first, or
    back)."""
    n = -(-src_at.shape[0] // group) * group
    src_at, dst_at = (jnp.pad(a, (0, n - a.shape[0]), mode="edge") for a in (src_at, dst_at))

    def one_group(g, dst):
        for j in range(group):
            page = lax.dynamic_slice_in_dim(src, src_at[g * group + j], 1, axis=0)
            if _on_host(src):
                page = jax.device_put(page, jax.memory.Space.Device)
            page = convert(page)
            if _on_host(dst):
                page = jax.device_put(page, jax.memory.Space.Host)
            dst = lax.dynamic_update_slice_in_dim(dst, page, dst_at[g * group + j], axis=0)
        return dst

    return lax.fori_loop(0, -(-count // group), one_group, dst)


def _read_tiered(words: TieredPages, slots: jax.Array, count: jax.Array,
                 group: int) -> jax.Array:
    """`read_pages` of both tiers, each page moved straight to its entry's place (the HBM
    tier's turned into words a page at a time: turning a whole staging's pages costs XLA:TPU
    several passes over it). Entries past count hold unspecified pages, the last included."""
    n = slots.shape[0]
    staged = jnp.zeros((-(-n // group) * group + 1,) + words.shape[1:], jnp.uint32)
    discard = staged.shape[0] - 1
    for in_device, buffer in ((True, words.device), (False, words.host)):
        order, tier_slots, tier_count = _split(words, slots, count, in_device)
        at = jnp.where(jnp.arange(n) < tier_count, order, discard)
        staged = _move_pages(buffer, staged, tier_slots, at, tier_count, group,
                             to_words if in_device else (lambda page: page))
    return staged


def _write_tiered(words: TieredPages, pages: jax.Array, slots: jax.Array, count: jax.Array,
                  group: int) -> TieredPages:
    """`write_pages` into both tiers, each page moved straight from its entry's place (a
    masked scatter into the HBM tier would read the buffer it writes, and XLA:TPU then
    copies the buffer twice)."""
    tiers = []
    for in_device, buffer in ((True, words.device), (False, words.host)):
        order, tier_slots, tier_count = _split(words, slots, count, in_device)
        convert = ((lambda page, dtype=buffer.dtype: from_words(page, dtype)) if in_device
                   else (lambda page: page))
        tiers.append(_move_pages(pages, buffer, order, tier_slots, tier_count, group, convert))
    return TieredPages(*tiers)


def read_rows(words: jax.Array, slot: jax.Array, offset: jax.Array, dtype) -> jax.Array:
    """Rows T[N, D] of `dtype` (the pool's storage dtype) at (slot, offset) i32[N] each."""
    n = slot.shape[0]
    pages = from_words(read_pages(words, slot, jnp.int32(n))[:n], dtype)     # [N, ps, D]
    return pages[jnp.arange(n), offset]


def write_rows(words: jax.Array, rows: jax.Array, slot: jax.Array, offset: jax.Array, dtype,
               write: Callable) -> jax.Array:
    """Rows T[N, D] written at (slot, offset) i32[N] each (the last page, the sentinel, takes
    those to discard): each page staged once however many rows land in it, written by
    `write(pages, rows, slots, offsets)` (a cache-write kernel over pages of `dtype`), and
    copied back."""
    n, sentinel = slot.shape[0], words.shape[0] - 1
    unique = jnp.unique(slot, size=n, fill_value=sentinel)           # ascending, then fill
    at = jnp.searchsorted(unique, slot).astype(jnp.int32)
    count = jnp.sum(unique != sentinel, dtype=jnp.int32)
    pages = from_words(read_pages(words, unique, count)[:n + 1], dtype)   # page n: discard
    pages = write(pages, rows, jnp.where(slot != sentinel, at, n), offset)
    return write_pages(words, to_words(pages[:n]), unique, count)
