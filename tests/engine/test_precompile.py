"""`serve`'s start-up compile (cp_runtime.engine.precompile): its grid holds every step shape the
engine builds, a served session after ready compiles nothing, and a restart on the same
compilation cache compiles nothing either."""

import os
import re

import numpy as np
import pytest

from cp_runtime.cache.pages import PageTable
from cp_runtime.config import RuntimeConfig
from cp_runtime.engine.plans import Row, build_segment
from cp_runtime.engine.precompile import startup_programs, table_widths
from cp_runtime.model.sampler import SamplingArrays
from cp_runtime.serving.process import ServerProcess
from cp_runtime.serving.session.client import Client

RUNTIME = RuntimeConfig(num_shards=4, pages_per_shard=8, page_size=16, chunk_size=32,
                        max_batch=3)


def _shape(seg) -> tuple:
    return (seg.kind, seg.inputs.tokens.shape, seg.inputs.page_table.shape, seg.in_hbm,
            seg.sampling and seg.sampling.variant)


def _grid(runtime: RuntimeConfig, **kw) -> set[tuple]:
    return {_shape(seg) for p in startup_programs(runtime, **kw) for seg in p.plan}


def test_the_grid_is_chunks_and_decode_buckets_at_every_table_width():
    # 4 shards x 8 pages, rotated by up to 3: 35 slots, so tables of 4 .. 64 entries.
    assert table_widths(RUNTIME) == [4, 8, 16, 32, 64]
    plain = startup_programs(RUNTIME)
    assert len(plain) == 5 * (1 + 3)                      # a chunk; decode rows 1, 2, 4
    assert [p.name for p in plain[:4]] == ["fill 1x32 table 4", "decode 1x1 table 4",
                                           "decode 2x1 table 4", "decode 4x1 table 4"]
    assert len(startup_programs(RUNTIME, sampling="all")) == 5 * (1 + 3 * 8)
    # 64 tokens are 4 pages, plus a rotation of 3: tables of at most 8.
    assert len(startup_programs(RUNTIME, max_context=64)) == 2 * 4
    tiered = RuntimeConfig(**{**RUNTIME.__dict__, "latent_memory": "host",
                              "latent_device_pages": 4})
    assert len(startup_programs(tiered)) == 2 * len(plain)
    with pytest.raises(ValueError, match="sampling='some'"):
        startup_programs(RUNTIME, sampling="some")


def test_every_step_shape_the_engine_builds_is_in_the_grid():
    rng = np.random.default_rng(0)
    grid, grid_64 = _grid(RUNTIME), _grid(RUNTIME, max_context=64)
    s, ps = RUNTIME.num_shards, RUNTIME.page_size
    for _ in range(300):
        rows = []
        for _ in range(rng.integers(1, RUNTIME.max_batch + 1)):
            length = int(rng.integers(1, s * RUNTIME.pages_per_shard * ps + 1))
            pages = -(-length // ps)
            slots = rng.integers(0, RUNTIME.pages_per_shard, pages)
            table = PageTable(rotation=int(rng.integers(0, s)), slots=tuple(map(int, slots)))
            rows.append((table, length))
        decode = build_segment("sample", [Row(t, [0], n - 1) for t, n in rows],
                               page_size=ps, num_shards=s, sentinel=RUNTIME.pages_per_shard,
                               sampling=SamplingArrays.greedy(len(rows)))
        table, n = rows[0]
        start = max(0, n - RUNTIME.chunk_size)
        fill = build_segment("fill", [Row(table, [0] * (n - start), start)], page_size=ps,
                             num_shards=s, sentinel=RUNTIME.pages_per_shard,
                             width=RUNTIME.chunk_size)
        for seg, longest in ((decode, max(n for _, n in rows)), (fill, n)):
            assert _shape(seg) in grid, _shape(seg)
            if longest <= 64:
                assert _shape(seg) in grid_64, (_shape(seg), longest)


READY = r"compile: 6 step programs and a fork's page copy ready in [\d.]+ s; {compiled} compiled"


def _entries(path) -> set[str]:
    """The programs in a compilation cache (their module names and keys)."""
    return {name for name in os.listdir(path) if name.endswith("-cache")}


def test_a_session_after_ready_compiles_nothing_and_a_restart_loads_every_program(tmp_path):
    cache = tmp_path / "compile-cache"
    flags = ["--model", "tiny", "--shards", "4", "--pages-per-shard", "8", "--chunk-size", "32",
             "--max-batch", "2", "--max-model-len", "64", "--precompile", "plain",
             "--compile-cache", str(cache)]
    with ServerProcess(flags) as server:
        log = server.log()
        assert "compile: fill 1x32 table 4 in " in log and "(6 of 6)" in log, log[-3000:]
        assert re.search(READY.format(compiled=7), log), log
        ready = _entries(cache)
        with Client(server.address) as client:
            session = client.create_session()
            session.extend(list(range(3, 43)))                   # two chunks of 32
            assert len(session.generate(max_tokens=8).tokens) == 8
            other = session.fork()
            assert len(other.generate(max_tokens=4, temperature=0.7, seed=1).tokens) == 4
        assert _entries(cache) == ready, sorted(_entries(cache) - ready)
        assert "step of" not in server.log()[len(log):]         # the executor's first-run line
    with ServerProcess(flags) as server:
        assert re.search(READY.format(compiled=0),
                         server.log()), server.log()[-3000:]
    assert _entries(cache) == ready
