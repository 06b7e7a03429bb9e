"""The page selection's ranks in one kernel (kernels/page_top_k.py): in interpret mode the same
pages and scores, in the same order, as the sorts they replace on a TPU (`selection.rank_pages`,
`rank_rows`), with ties, zeros of both signs, non-candidates and fewer candidates than
k; and on TPU7x the selection compiles to the kernel with no sort left, its estimate priced as
VPU work."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from cp_runtime.aot import hlo, topology
from cp_runtime.aot.roofline import TPU7X_DEVICE, kernel_seconds
from cp_runtime.kernels import page_top_k
from cp_runtime.kernels.vmem import VMEM_BUDGET_BYTES
from cp_runtime.parallel import selection

needs_libtpu = pytest.mark.skipif(not topology.has_libtpu() and not os.environ.get("CI"),
                                  reason="needs libtpu (tpu extra)")

SHAPES = [(1, 300, 33, 32),      # queries padded to a second 256-lane tile
          (2, 5, 20, 8),         # fewer queries than a lane tile: one whole block
          (1, 260, 129, 32),
          (3, 1, 7, 4),          # a decode step's rows
          (1, 40, 12, 16)]       # fewer candidates than k: NO_PAGE and -inf after them


def _scores(shape, seed=0) -> jax.Array:
    """Scores with ties (rounded values), zeros of both signs and non-candidates (-inf)."""
    rng = np.random.default_rng(seed)
    s = rng.standard_normal(shape).astype(np.float32)
    s[..., ::5] = np.round(s[..., ::5])
    s[..., ::9] = -0.0
    s[..., 3::11] = 0.0
    s[..., -2:] = -np.inf
    return jnp.asarray(s)


@pytest.mark.parametrize("b, q, c, k", SHAPES)
def test_positions_rank_as_the_partial_selection_and_the_sort(b, q, c, k):
    """By position (a shard's own pages, which ascend with it): the rows `rank_rows` picks
    with `lax.top_k`, and, as pages, those of the two-key sort."""
    s = _scores((b, q, c))
    top_scores, rows = selection._rank_by_kernel(s, k=k, interpret=True)
    want_scores, want_rows = selection.rank_rows(s, k)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(top_scores, want_scores)
    pages = jnp.asarray(np.broadcast_to(np.arange(c, dtype=np.int32) * 16 + 3, s.shape).copy())
    sorted_scores, sorted_pages = selection.rank_pages(s, pages, k)
    np.testing.assert_array_equal(jnp.where(rows >= 0, rows * 16 + 3, rows), sorted_pages)
    np.testing.assert_array_equal(top_scores, sorted_scores)


@pytest.mark.parametrize("b, q, c, k", SHAPES)
def test_gathered_pages_rank_as_the_two_key_sort(b, q, c, k):
    """Distinct pages in any order, unused entries page -1 and -inf, as the S * K candidates
    arrive from the gather."""
    s = _scores((b, q, c), seed=1)
    order = np.argsort(np.random.default_rng(2).random(s.shape), axis=-1).astype(np.int32)
    pages = jnp.where(s > -jnp.inf, jnp.asarray(order) * 7, selection.NO_PAGE)
    want = selection.rank_pages(s, pages, k)
    got = selection._rank_by_kernel(s, pages, k=k, interpret=True)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])
    if b * q > 1 and c >= k:
        assert (np.asarray(got[1]) != selection.NO_PAGE).any()      # not a vacuous match


def test_rows_rank_without_pages():
    """pages=None ranks by row: the rows `lax.top_k` picks, columns as queries, NO_PAGE for a
    non-candidate."""
    s = _scores((300, 40))
    top_scores, rows = page_top_k.top_pages(s.T, k=40, interpret=True)
    want_scores, want_rows = jax.lax.top_k(jnp.where(s == 0, 0.0, s), 40)
    np.testing.assert_array_equal(rows.T, jnp.where(want_scores > -jnp.inf, want_rows,
                                                    page_top_k.NO_PAGE))
    np.testing.assert_array_equal(top_scores.T, want_scores)


def test_bad_shapes_are_named():
    s = jnp.zeros((16, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"pages \(8, 16\).*do not fit"):
        page_top_k.top_pages(s, jnp.zeros((8, 16), jnp.int32), k=4, interpret=True)
    with pytest.raises(ValueError, match="k=0"):
        page_top_k.top_pages(s, k=0, interpret=True)


def test_glm_shapes_fit_vmem_and_a_long_column_does_not():
    """GLM-5.2 at 1M on 16 shards: 1,025 pages a shard, 512 gathered candidates, 16,384
    queries a half-chunk; a column of 64K pages (one shard holding 4M tokens) does not fit."""
    assert page_top_k.supports(1025, 16384, 32, has_pages=False)
    assert page_top_k.supports(512, 16384, 32, has_pages=True)
    assert page_top_k.cost(1025, 16384, 32, False)["vmem_bytes"] <= VMEM_BUDGET_BYTES
    assert not page_top_k.supports(65536, 16384, 32, has_pages=False)
    # Token selection's 2,048 rounds would be unrolled: a sort ranks them.
    assert not page_top_k.supports(4096, 8, 2048, has_pages=True)
    assert not page_top_k.supports_pairs(16, 8, 2048)
    figures = page_top_k.cost(1025, 16384, 32, has_pages=False)
    assert figures["flops"] == 32 * page_top_k.VPU_OPS_PER_ROUND * 1032 * 16384
    assert figures["bytes"] == 1032 * 16384 * 4 + 2 * 32 * 16384 * 4


@pytest.fixture(scope="module")
def device():
    return topology.compile_only_devices("tpu7x-16")[0]


def _compiled(device, fn, *structs):
    with jax.default_device(device):
        return jax.jit(fn).lower(*structs).compile()


def _struct(device, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))


@needs_libtpu
@pytest.mark.parametrize("c, by_position", [(1025, True), (512, False)])
def test_selection_compiles_to_the_kernel_on_tpu7x(device, c, by_position):
    """A half of a 32K chunk at 1M (16,384 queries): the shard's 1,025 pages, or the 512
    gathered candidates (candidates first, as `global_top_pages` ranks them), rank in the
    kernel; no sort is left in the module (XLA:TPU prices a sort at nothing), and the kernel's
    estimate reaches it, priced at the VPU rate."""
    k, q = 32, 16384
    if by_position:
        compiled = _compiled(device, lambda s: selection.rank_rows(s, k),
                             _struct(device, (1, q, c), jnp.float32))
    else:
        compiled = _compiled(device, lambda s, p: selection.rank_gathered_columns(s, p, k),
                             _struct(device, (c, 1, q), jnp.float32),
                             _struct(device, (c, 1, q), jnp.int32))
    module = hlo.parse_module(compiled.as_text())
    every = [i for instrs in module.computations.values() for i in instrs]
    calls = [i for i in every if i.is_kernel]
    assert [i.name.split(".")[0] for i in calls] == ["page_top_k_vpu"]
    assert not [i.name for i in every if i.op == "sort"]
    figures = page_top_k.cost(c, q, k, has_pages=not by_position)
    assert calls[0].kernel_cost == (figures["flops"], figures["bytes"]) and calls[0].vpu
    priced = kernel_seconds(*calls[0].kernel_cost, TPU7X_DEVICE, vpu=True)
    assert priced == pytest.approx(figures["flops"] / TPU7X_DEVICE.vpu_ops)


@pytest.mark.tpu
@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")
def test_selection_on_a_tpu_is_the_cpus():
    """On a real TPU the selection takes the kernel (the TPU branch of each rank) and gives
    the pages and scores the CPU's forms give: a shard's 1,025 pages at 16,384 queries (GLM-5.2
    at 1M - 32K, a half-chunk), 33 pages (the chunk at 0), and the 512 gathered candidates."""
    cpu = jax.devices("cpu")[0]
    q = 16384
    for c, gathered in [(1025, False), (33, False), (512, True)]:
        s = _scores((1, q, c), seed=c)
        if gathered:
            order = np.argsort(np.random.default_rng(c).random(s.shape), axis=-1)
            pages = jnp.where(s > -jnp.inf, jnp.asarray(order.astype(np.int32)) * 5,
                              selection.NO_PAGE)
            rank = jax.jit(lambda s, p: selection.rank_gathered_pages(s, p, 32))
            got = rank(s, pages)
            with jax.default_device(cpu):
                want = rank(jax.device_put(s, cpu), jax.device_put(pages, cpu))
        else:
            rank = jax.jit(lambda s: selection.rank_rows(s, 32))
            got = rank(s)
            with jax.default_device(cpu):
                want = rank(jax.device_put(s, cpu))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def _ranked_lists(g, n, k, seed):
    """G lists of k per query, each ranked by `selection.rank_pages` (ties, zeros of both
    signs, short lists padded with -inf and NO_PAGE), pages distinct over the lists:
    scores f32[G, k, N], pages i32[G, k, N]."""
    s = np.array(_scores((g, n, 3 * k), seed=seed))
    s[1, :, 2:] = -np.inf                                              # a list of 2 < k
    pages = np.stack([np.argsort(np.random.default_rng(seed + i).random((n, 3 * k)), axis=-1)
                      for i in range(g)]).astype(np.int32) + 1000 * np.arange(g)[:, None, None]
    ranked = [selection.rank_pages(jnp.asarray(s[i]), jnp.asarray(pages[i]), k)
              for i in range(g)]
    return (np.stack([np.asarray(r[0]).T for r in ranked]),
            np.stack([np.asarray(r[1]).T for r in ranked]))


@pytest.mark.parametrize("g, n, k", [(16, 300, 32), (2, 5, 8), (4, 1, 4), (6, 260, 16)])
def test_pairs_rank_as_the_two_key_sort_of_every_list(g, n, k):
    """`top_pages_of_pairs`: G ranked lists, the odd ones sent worst first, halved in VMEM and
    ranked: the pages and scores the sort of all G * k candidates gives."""
    scores, pages = _ranked_lists(g, n, k, seed=g)
    sent = lambda x: np.where((np.arange(g) % 2 == 1)[:, None, None], x[:, ::-1], x)  # noqa: E731
    lists = np.stack([sent(scores), sent(pages).view(np.float32)], axis=1)   # [G, 2, k, N]
    got = page_top_k.top_pages_of_pairs(jnp.asarray(lists), k=k, interpret=True)
    every = lambda x: jnp.asarray(x.transpose(2, 0, 1).reshape(n, g * k))   # noqa: E731
    want = selection.rank_pages(every(scores), every(pages), k)
    np.testing.assert_array_equal(np.asarray(got[1]).T, want[1])
    np.testing.assert_array_equal(np.asarray(got[0]).T, want[0])
    assert (np.asarray(got[1]) != selection.NO_PAGE).any()


def test_pairs_refuse_an_odd_count_of_lists():
    with pytest.raises(ValueError, match="not an even number"):
        page_top_k.top_pages_of_pairs(jnp.zeros((3, 2, 4, 8)), k=4, interpret=True)


@needs_libtpu
def test_gathered_selection_compiles_to_the_pairs_kernel_on_tpu7x():
    """`global_top_pages` over the 16 devices of tpu7x-16, half a 32K chunk (16,384 queries,
    k = 32): one all-gather and the pairs kernel, no sort, and of XLA's own work only the odd
    shards' flip and the moves around the gather (the halving's passes are in the kernel)."""
    devices = topology.compile_only_devices("tpu7x-16")
    mesh = jax.sharding.Mesh(np.asarray(devices), ("cp",))
    spec = jax.sharding.PartitionSpec("cp")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                       check_vma=False)
    def select(s, p):
        return selection.global_top_pages(s[0], p[0], k=32, axis_name="cp")[None]

    structs = [jax.ShapeDtypeStruct((16, 1, 16384, 32), dtype,
                                    sharding=jax.sharding.NamedSharding(mesh, spec))
               for dtype in (jnp.float32, jnp.int32)]
    with jax.default_device(devices[0]):
        module = hlo.parse_module(select.lower(*structs).compile().as_text())
    every = [i for instrs in module.computations.values() for i in instrs]
    assert [i.name.split(".")[0] for i in every if i.is_kernel] == ["page_top_k_pairs_vpu"]
    assert not [i.name for i in every if i.op == "sort"]
    assert sum(i.op.startswith("all-gather") for i in every) >= 1
    figures = page_top_k.pairs_cost(16, 16384, 32)
    kernel = next(i for i in every if i.is_kernel)
    assert kernel.kernel_cost == (figures["flops"], figures["bytes"]) and kernel.vpu
