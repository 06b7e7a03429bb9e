"""Flat, staged and in-process all-gather-then-reduce over real collectives on virtual CPU
devices."""

import functools
import itertools
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cp_runtime.kernels import native_gather
from cp_runtime.parallel.collectives import (NATIVE_MAX_BYTES, TREE_MIN_SHARDS, gather_reduce,
                                             stage_groups, tree_stages)

# The repository's root (tests/parallel/ is two levels below it).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("shards, stages", [(16, (4, 4)), (8, (2, 4)), (12, (3, 4)),
                                            (4, (2, 2)), (2, (2,)), (7, (7,)), (1, (1,))])
def test_tree_stages(shards, stages):
    assert tree_stages(shards) == stages


@pytest.mark.parametrize("sizes", [(4, 4), (2, 4), (3, 4), (2, 2, 2, 2), (16,)])
def test_each_stage_partitions_the_shards_and_the_stages_reach_everyone(sizes):
    shards = int(np.prod(sizes))
    reach = [{s} for s in range(shards)]            # whose values each shard has seen so far
    for size, groups in zip(sizes, stage_groups(sizes)):
        assert all(len(g) == size for g in groups)
        assert sorted(itertools.chain(*groups)) == list(range(shards))
        group_of = {s: g for g in groups for s in g}
        reach = [set().union(*(reach[m] for m in group_of[s])) for s in range(shards)]
    assert all(r == set(range(shards)) for r in reach)


def _top3(gathered):
    """An exact reduce whose result has its input's shape: the 3 largest of f32[G, 3]."""
    return jax.lax.top_k(gathered.reshape(-1), 3)[0]


@functools.cache
def _runner(shards: int, mode: str):
    mesh = jax.make_mesh((shards,), ("cp",), devices=jax.devices()[:shards])

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"),
                       check_vma=False)
    def run(x):
        return gather_reduce(x[0], "cp", _top3, mode)[None]

    return mesh, run


@pytest.mark.parametrize("shards", [16, 8, 12, 4])
@pytest.mark.parametrize("mode", ["flat", "staged", "native", "auto"])
def test_every_shard_gets_the_reduce_over_all_shards(shards, mode):
    rng = np.random.default_rng(shards)
    x = rng.permutation(shards * 3).astype(np.float32).reshape(shards, 3)
    mesh, run = _runner(shards, mode)
    got = np.asarray(run(jax.device_put(x, NamedSharding(mesh, P("cp")))))
    want = np.sort(x.reshape(-1))[::-1][:3]
    np.testing.assert_array_equal(got, np.broadcast_to(want, (shards, 3)))


def _replica_groups(shards: int, mode: str) -> list[str]:
    mesh, run = _runner(shards, mode)
    x = jax.device_put(jnp.zeros((shards, 3)), NamedSharding(mesh, P("cp")))
    text = run.lower(x).compile().as_text()
    return re.findall(r"all-gather\(.*?replica_groups=(\{\{[0-9,{}]*\}\})", text)


def test_staged_gathers_in_groups_of_four_then_across_them():
    assert _replica_groups(16, "staged") == [
        "{{0,1,2,3},{4,5,6,7},{8,9,10,11},{12,13,14,15}}",
        "{{0,4,8,12},{1,5,9,13},{2,6,10,14},{3,7,11,15}}"]
    assert len(_replica_groups(16, "flat")) == 1


@pytest.mark.parametrize("shards", [16, 4])
def test_auto_takes_the_in_process_gather_on_cpu_for_small_parts(shards):
    mesh, run = _runner(shards, "auto")
    text = run.lower(jax.device_put(jnp.zeros((shards, 3)), NamedSharding(mesh, P("cp")))
                     ).compile().as_text()
    assert native_gather.TARGET in text and "all-gather" not in text


def test_auto_stages_parts_above_the_in_process_limit():
    mesh = jax.make_mesh((16,), ("cp",))
    values = NATIVE_MAX_BYTES // 4 + 1

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"),
                       check_vma=False)
    def run(x):
        return gather_reduce(x[0], "cp", lambda every: every.max(0), "auto")[None]

    x = np.random.default_rng(0).normal(size=(16, values)).astype(np.float32)
    text = run.lower(jax.device_put(x, NamedSharding(mesh, P("cp")))).compile().as_text()
    assert native_gather.TARGET not in text and len(re.findall(r"all-gather\(", text)) == 2
    got = np.asarray(run(jax.device_put(x, NamedSharding(mesh, P("cp")))))
    np.testing.assert_array_equal(got, np.broadcast_to(x.max(0), x.shape))


def test_without_the_library_auto_stages_from_eight_shards_and_native_is_refused(tmp_path):
    """No compiler and nothing cached: auto falls back to XLA's gathers (staged at S = 16,
    flat at S = 4), and mode native says why it cannot run."""
    script = textwrap.dedent("""
        import warnings
        warnings.simplefilter("ignore")
        import jax
        jax.config.update("jax_num_cpu_devices", 16)
        from tests.parallel.test_collectives import _replica_groups
        print(len(_replica_groups(16, "auto")), len(_replica_groups(4, "auto")))
        try:
            _replica_groups(16, "native")
        except ValueError as err:
            print(err)
    """)
    env = dict(os.environ, CP_RUNTIME_CACHE=str(tmp_path), CXX="no-such-compiler")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout.splitlines()
    assert out[0] == "2 1"
    assert out[1].startswith("gathers 'native' needs every shard in this process")
    assert "no C++ compiler: 'no-such-compiler'" in out[1]
    assert TREE_MIN_SHARDS == 8


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="gather mode 'tree' is not one of"):
        gather_reduce(jnp.zeros(3), "cp", _top3, "tree")


def test_the_benchmark_times_each_mode_at_each_shard_count(tmp_path):
    import json

    from cp_runtime.benchmarks import all_gather_latency as collectives

    argv = ["--shards", "2,4,16", "--depth", "2", "--rounds", "2", "--out", str(tmp_path)]
    assert collectives.main(argv) == 0
    rows = json.loads((tmp_path / "collectives.json").read_text())["rows"]
    assert [(r["shards"], r["mode"], r["stages"]) for r in rows] == [
        (2, "flat", "2"), (2, "native", "2"), (4, "flat", "4"), (4, "staged", "2x2"),
        (4, "native", "4"), (16, "flat", "16"), (16, "staged", "4x4"), (16, "native", "16")]
    assert all(r["program_1_ms"] > 0 for r in rows)
