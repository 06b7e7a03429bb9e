"""The latent cache held in host memory (`latent_memory = "host"`), compiled for a compile-only
tpu7x:2x2x2 slice (16 TPU7x devices): its pages move between the hosts' memory and HBM as
asynchronous copies of one page each, and a decode step over it compiles beside a device pool's.

  - default: staging GLM-5.2's fp8 pages (64 x 640 as words u32[16, 640]) into HBM and back,
    `host_pages.read_pages` / `write_pages`, compiles to a dynamic-slice-start from the host
    buffer (memory space 5) and a dynamic-update-slice-start into it, a group of pages a loop
    step, with no copy of the buffer: the device's temporaries are the staged pages, and the
    buffer stays a host argument. With the first slots in HBM (`TieredPages`), those pages are
    copied a page at a time there, the rest as above, neither buffer copied whole. The
    decode kernel compiles reading staged words, with the cost estimate it has over fp8
    pages.
  - slow (two compiles of ~1 min each): a decode step over the HBM tier of a tiered pool
    prices as over a device pool. GLM-5.2's decode step at 1M tokens, B = 32, cut to its
    first 5 layers, over a host-held latent cache of 32 sessions of 1M: the latent buffers
    are host arguments, and the step's priced time is within 10% of the same step over a
    device-held cache (capacity-sized: 32 sessions of 1M do not fit beside the weights).

Without libtpu (the tpu extra) these skip with the reason, except under CI, where they fail.
"""

from __future__ import annotations

import pytest

from conftest import require_libtpu

require_libtpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from cp_runtime.aot import hlo  # noqa: E402
from cp_runtime.aot.cases import PhaseCase, run_case  # noqa: E402
from cp_runtime.aot.roofline import compiler_clock_hz  # noqa: E402
from cp_runtime.aot.topology import compile_only_devices  # noqa: E402
from cp_runtime.cache import host_pages  # noqa: E402

PAGES, STAGED = 4096, 66              # pages a shard holds; a decode row's 33 x B=32 / 16


def test_pages_move_between_host_and_hbm_as_async_copies_of_one_page():
    devices = compile_only_devices("tpu7x-16")
    mesh = Mesh(np.array(devices), ("cp",))
    sharded = NamedSharding(mesh, PartitionSpec("cp"))
    host = host_pages.host_sharding(sharded)
    assert host.memory_kind == "pinned_host"

    def body(words, slots, count):
        staged = host_pages.read_pages(words[0], slots, count[0])
        return host_pages.write_pages(words[0], staged[:STAGED] + 1, slots, count[0])[None]

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec("cp"),) * 3,
                                 out_specs=PartitionSpec("cp"), check_vma=False),
                   donate_argnums=(0,), out_shardings=host)
    words = jax.ShapeDtypeStruct((16, PAGES + 1, 16, 640), jnp.uint32, sharding=host)
    slots = jax.ShapeDtypeStruct((16 * STAGED,), jnp.int32, sharding=sharded)
    count = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=sharded)
    with jax.default_device(devices[0]):
        compiled = step.lower(words, slots, count).compile()
    text = compiled.as_text()
    module = hlo.parse_module(text)
    ops = [i for body in module.computations.values() for i in body]
    page = "u32[1,16,640]"
    reads = [i for i in ops if i.op == "dynamic-slice-start"]
    writes = [i for i in ops if i.op == "dynamic-update-slice-start"]
    assert reads and all("S(5)" in i.shape and page in i.shape for i in reads), reads
    assert writes and all("S(5)" in i.shape and page in i.shape for i in writes), writes
    assert len(reads) == len(writes) == host_pages.GROUP                # a group a loop step
    mem = compiled.memory_analysis()
    buffer = (PAGES + 1) * 16 * 640 * 4
    assert mem.host_argument_size_in_bytes == buffer
    assert mem.host_alias_size_in_bytes == buffer                       # updated in place
    staged = (STAGED + host_pages.GROUP) * 16 * 640 * 4
    assert mem.temp_size_in_bytes <= 3 * staged, mem                   # no copy of the buffer


@pytest.mark.slow
def test_a_decode_step_over_a_host_held_cache_compiles_and_prices_as_over_a_device_pool():
    clock = compiler_clock_hz(compile_only_devices("tpu7x-16")[0])
    case = PhaseCase("decode", 1 << 20, 32)
    common = dict(model="glm-5.2", layers=None, chunk=32768, page_size=64,
                  kv_cache_dtype="fp8_e4m3", topology="tpu7x-16", clock_hz=clock)
    sessions = 32 * (1 << 20) // (16 * 64) + 32
    host = run_case(case, pages_per_shard=sessions, latent_memory="host", **common)
    device = run_case(case, **common)
    assert host["compiled"] and device["compiled"], (host["error"], device["error"])
    layers = host["layers_compiled"]
    assert host["host_argument_bytes"] == layers * (sessions + 1) * 64 * 640
    assert host["seconds"] == pytest.approx(device["seconds"], rel=0.10)


@pytest.mark.slow
def test_a_step_over_the_hbm_tier_prices_as_over_a_device_pool():
    """GLM-5.2's decode step at 1M, B = 1, cut to 5 layers: over a pool holding 8,192 of each
    shard's 32,800 pages in HBM, the step whose pages all lie there (`decode_in_hbm`) prices
    within 1% of the same step over a device pool, and the rest of the pool stays a host
    argument (passed through, not copied)."""
    clock = compiler_clock_hz(compile_only_devices("tpu7x-16")[0])
    common = dict(model="glm-5.2", layers=None, chunk=32768, page_size=64,
                  kv_cache_dtype="fp8_e4m3", topology="tpu7x-16", clock_hz=clock)
    tiered = run_case(PhaseCase("decode_in_hbm", 1 << 20, 1), pages_per_shard=32800,
                      latent_memory="host", latent_device_pages=8192, **common)
    device = run_case(PhaseCase("decode", 1 << 20, 1), **common)
    assert tiered["compiled"] and device["compiled"], (tiered["error"], device["error"])
    layers = tiered["layers_compiled"]
    assert tiered["host_argument_bytes"] == layers * (32800 - 8192 + 1) * 64 * 640
    assert tiered["seconds"] == pytest.approx(device["seconds"], rel=0.01)
    assert tiered["temp_bytes"] <= 1.1 * device["temp_bytes"]


def test_the_decode_kernel_compiles_reading_staged_words():
    """sparse_decode over GLM-5.2's staged pages as words (u32[N, 16, 640], read as fp8
    [64, 640] by a bitcast in VMEM) compiles for one TPU7x device at B = 32, every head, with
    the cost estimate it compiles over fp8 pages: the same bytes move."""
    from jax.sharding import SingleDeviceSharding
    from cp_runtime.kernels import sparse_decode
    device = compile_only_devices("tpu7x-16")[0]
    on = SingleDeviceSharding(device)
    b, n, staged = 32, 33, 32 * 33 + host_pages.GROUP + 1
    q = jax.ShapeDtypeStruct((b, 1, 64, 640), jnp.bfloat16, sharding=on)
    sel = jax.ShapeDtypeStruct((b, 1, n), jnp.int32, sharding=on)
    pos = jax.ShapeDtypeStruct((b, 1), jnp.int32, sharding=on)
    fp8 = np.dtype(jnp.float8_e4m3fn)

    def kernel_cost(cache_shape, cache_dtype, **page_dtype):
        cache = jax.ShapeDtypeStruct(cache_shape, cache_dtype, sharding=on)
        with jax.default_device(device):
            compiled = jax.jit(lambda *a: sparse_decode.sparse_decode(
                *a, value_dim=512, scale=0.1, **page_dtype)).lower(
                q, cache, sel, sel, pos).compile()
        module = hlo.parse_module(compiled.as_text())
        kernels = [i for body in module.computations.values() for i in body if i.is_kernel]
        assert len(kernels) == 1, kernels
        return kernels[0].kernel_cost

    words = kernel_cost((staged, 16, 640), jnp.uint32, page_dtype=fp8)
    assert words == kernel_cost((staged, 64, 640), fp8) and words[1] > 0


def test_pages_in_both_tiers_stage_a_page_at_a_time_in_place():
    """A shard holding its first 1,024 slots in HBM (`host_pages.TieredPages`): staging and
    writing back copies each tier's pages a page at a time, the host's asynchronously;
    neither buffer is copied whole, and both are updated in place."""
    devices = compile_only_devices("tpu7x-16")
    mesh = Mesh(np.array(devices), ("cp",))
    sharded = NamedSharding(mesh, PartitionSpec("cp"))
    host = host_pages.host_sharding(sharded)
    in_hbm = 1024

    def body(words, slots, count):
        staged = host_pages.read_pages(words[0], slots, count[0])
        return host_pages.write_pages(words[0], staged[:STAGED] + 1, slots, count[0])[None]

    tiered = host_pages.TieredPages(
        device=jax.ShapeDtypeStruct((16, in_hbm + 1, 64, 640), jnp.float8_e4m3fn,
                                    sharding=sharded),
        host=jax.ShapeDtypeStruct((16, PAGES - in_hbm + 1, 16, 640), jnp.uint32,
                                  sharding=host))
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec("cp"),) * 3,
                                 out_specs=PartitionSpec("cp"), check_vma=False),
                   donate_argnums=(0,), out_shardings=host_pages.TieredPages(sharded, host))
    slots = jax.ShapeDtypeStruct((16 * STAGED,), jnp.int32, sharding=sharded)
    count = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=sharded)
    with jax.default_device(devices[0]):
        compiled = step.lower(tiered, slots, count).compile()
    module = hlo.parse_module(compiled.as_text())
    ops = [i for body in module.computations.values() for i in body]
    reads = [i for i in ops if i.op == "dynamic-slice-start"]
    writes = [i for i in ops if i.op == "dynamic-update-slice-start"]
    assert len(reads) == len(writes) == host_pages.GROUP
    assert all("S(5)" in i.shape for i in reads + writes)
    mem = compiled.memory_analysis()
    buffer = (PAGES - in_hbm + 1) * 16 * 640 * 4
    assert mem.host_argument_size_in_bytes == mem.host_alias_size_in_bytes == buffer
    assert mem.alias_size_in_bytes == (in_hbm + 1) * 64 * 640            # HBM's, in place
    staged = (STAGED + host_pages.GROUP) * 16 * 640 * 4
    assert mem.temp_size_in_bytes <= 3 * staged, mem      # no copy of either buffer
