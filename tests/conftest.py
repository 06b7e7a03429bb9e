"""Test setup: 16 virtual CPU devices (configured before JAX is first used) and shared fixtures."""

import atexit
import os
import pathlib
import shutil
import sys
import tempfile

import jax

# Tests live in folders that mirror the packages (tests/kernels/, tests/serving/http/, ...),
# imported by pytest's default `prepend` mode under their file names, which are unique across
# tests/. A few import helpers from another concern's file (`from test_checkpoint import
# write_checkpoint`), as they did when every file sat in tests/: every folder goes on sys.path,
# and helpers at this level (serving_helpers, conftest) were on it already.
TESTS = pathlib.Path(__file__).resolve().parent
for _folder in sorted({p.parent for p in TESTS.rglob("test_*.py")} - {TESTS}):
    if "reference" not in _folder.parts and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# The server processes tests start (`cp-runtime serve`, benchmarks) share one XLA compilation
# cache for the run, so only the first server of each step shape compiles it. This process's
# own JAX was configured at its import above and keeps no cache; the xdist workers inherit the
# variable from the controller, which removes the folder at exit.
if "CP_RUNTIME_TEST_XLA_CACHE" not in os.environ:
    os.environ["CP_RUNTIME_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="cp-runtime-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["CP_RUNTIME_TEST_XLA_CACHE"], True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["CP_RUNTIME_TEST_XLA_CACHE"])

from cp_runtime.kernels.packing import interpret_pool_threads  # noqa: E402

CPU_DEVICES = 16
# Twice as many threads as devices, and one, in XLA's CPU client pool: TPU interpret-mode
# kernels running on all 16 devices at once otherwise can deadlock (kernels/packing.py).
os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1,
                                            interpret_pool_threads(CPU_DEVICES))))
jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
from cp_runtime.platform import keep_jax_off_absent_tpus  # noqa: E402

keep_jax_off_absent_tpus()   # libtpu (the tpu extra) stays unloaded but for the compile tests

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cp_runtime.config import RuntimeConfig, load_model_config  # noqa: E402
from cp_runtime.engine import Engine  # noqa: E402
from cp_runtime.engine.executor import LocalExecutor  # noqa: E402
from cp_runtime.weights.params import init_params  # noqa: E402


# The default run's heaviest files (seconds, measured on the 2-core development machine), by path
# under tests/: they go first, so the two xdist workers finish together instead of one running a
# heavy file alone at the end. Order only; no test depends on it.
HEAVIEST_FIRST = ("cluster/test_ray.py", "aot/test_tpu_compile.py",
                  "benchmarks/test_benchmark_smoke.py", "serving/state/test_state.py",
                  "model/test_paged_model.py", "engine/test_engine.py",
                  "model/test_expert_groups.py", "kernels/test_kernel_path.py",
                  "serving/http/test_http.py", "model/test_attention_layout.py",
                  "engine/test_in_place.py", "weights/test_checkpoint.py",
                  "serving/session/test_hostile_input.py", "weights/test_narrow_weights.py",
                  "weights/test_sharded_weights.py", "model/test_recall.py",
                  "engine/test_prefix_cache.py", "benchmarks/test_moe_layouts.py",
                  "cache/test_host_latent.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}

    def where(item) -> str:
        path = pathlib.Path(item.path).resolve()
        return path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else path.name

    items.sort(key=lambda item: rank.get(where(item), len(rank)))   # stable: files keep order


@pytest.fixture(scope="session")
def tiny():
    return load_model_config("tiny")


@pytest.fixture(scope="session")
def tiny_params(tiny):
    return init_params(tiny, seed=0)


def make_engine(model, params, **runtime) -> Engine:
    """An engine on a LocalExecutor; `runtime` overrides RuntimeConfig fields."""
    rt = RuntimeConfig(model=model.name, **runtime)
    return Engine(model, rt, LocalExecutor(model, rt, params))


def random_tokens(model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.vocab_size, n).tolist()


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def require_libtpu() -> None:
    """Skip the calling test module without libtpu (the tpu extra: compiling for a TPU needs
    it), with the reason; under CI, which installs it, fail instead."""
    from cp_runtime.aot.topology import has_libtpu
    if has_libtpu():
        return
    if os.environ.get("CI"):
        pytest.fail("libtpu is missing: CI must install the tpu extra to compile for TPU",
                    pytrace=False)
    pytest.skip("needs libtpu (pip install -e '.[tpu]') to compile for TPU",
                allow_module_level=True)
