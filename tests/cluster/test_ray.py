"""The Ray executor: 2 worker processes x 8 CPU devices (gloo collectives) give the local
executor's results at S = 16, `cp-runtime serve --executor ray` serves them, and a worker killed
mid-prefill or mid-decode (actor kill, process kill) costs a retryable error and a re-prefill,
never a token. One Ray start and one worker group for the module (faults replace the group)."""

import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import cp_runtime  # noqa: E402
from conftest import random_tokens  # noqa: E402
from cp_runtime.config import RuntimeConfig  # noqa: E402
from cp_runtime.engine import Engine  # noqa: E402
from cp_runtime.engine.executor import LocalExecutor  # noqa: E402
from cp_runtime.engine.requests import Done, Extend, Failed, Generate, SamplingParams  # noqa: E402
from cp_runtime.model.source import WeightsSource  # noqa: E402
from cp_runtime.weights.format import bytes_per_device, device_tensors  # noqa: E402
from cp_runtime.weights.params import model_shapes  # noqa: E402
from cp_runtime.serving.process import ServerProcess  # noqa: E402

SOURCE = WeightsSource(model="tiny", seed=0)
RUNTIME = RuntimeConfig(model="tiny", kv_cache_dtype="f32", pages_per_shard=24, chunk_size=64)
PROMPT = 150
GENERATE = 10


@pytest.fixture(scope="module")
def ray_cluster():
    # Two workers for the executor and two for the served process that attaches to it.
    ray.init(num_cpus=6, include_dashboard=False, logging_level="warning",
             log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    """The workers' persistent compilation cache: fresh groups start without compiling."""
    return str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(scope="module")
def executor(ray_cluster, xla_cache):
    from cp_runtime.cluster.ray_executor import RayExecutor
    # 15 s of silence: on two cores the other test worker's compiles can starve a worker's
    # heartbeat thread for over 5 s (a false "worker lost" mid-test), and a hung worker is
    # still found well inside the recovery test's 30 s.
    ex = RayExecutor(SOURCE, RUNTIME, hosts=2, devices_per_host=8, heartbeat_s=0.5,
                     heartbeat_timeout_s=15.0, step_timeout_s=120.0,
                     compilation_cache_dir=xla_cache)
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def local(tiny, tiny_params):
    return LocalExecutor(tiny, RUNTIME, tiny_params)


@pytest.fixture(scope="module")
def reference(tiny, local):
    """The local executor's greedy continuation of the prompt (and its logits)."""
    engine = Engine(tiny, RUNTIME, local)
    prompt = random_tokens(tiny, PROMPT, 0)
    s = engine.create_session()
    prefill = engine.extend(s.id, prompt, all_logits=True)
    tokens, decode = [int(prefill[-1].argmax())], []
    for _ in range(GENERATE - 1):
        decode.append(engine.decode([s.id], [tokens[-1]])[0])
        tokens.append(int(decode[-1].argmax()))
    engine.close_session(s.id)
    return {"prompt": prompt, "prefill": prefill, "decode": np.stack(decode), "tokens": tokens}


def test_prefill_and_decode_equal_the_local_executor(tiny, executor, reference):
    engine = Engine(executor.model, RUNTIME, executor)
    s = engine.create_session()
    prefill = engine.extend(s.id, reference["prompt"], all_logits=True)
    tokens, decode = [int(prefill[-1].argmax())], []
    for _ in range(GENERATE - 1):
        decode.append(engine.decode([s.id], [tokens[-1]])[0])
        tokens.append(int(decode[-1].argmax()))
    decode = np.stack(decode)
    assert prefill.shape == reference["prefill"].shape == (PROMPT, tiny.vocab_size)
    assert np.abs(prefill - reference["prefill"]).max() <= 1e-5
    assert np.abs(decode - reference["decode"]).max() <= 1e-5
    assert tokens == reference["tokens"]
    print(f"\nRay vs local at S=16: prefill max |dlogit| "
          f"{np.abs(prefill - reference['prefill']).max():.2e}, decode "
          f"{np.abs(decode - reference['decode']).max():.2e}, greedy tokens equal")
    stats = executor.stats()
    assert [w["shards"] for w in stats["workers"]] == [list(range(8)), list(range(8, 16))]
    assert stats["healthy"] and all(w["healthy"] for w in stats["workers"])
    engine.close_session(s.id)


def test_bad_shapes_are_refused_before_ray_starts():
    from cp_runtime.cluster.ray_executor import RayExecutor
    with pytest.raises(ValueError, match="must equal the shard count 16"):
        RayExecutor(SOURCE, RUNTIME, hosts=3, devices_per_host=8)
    with pytest.raises(ValueError, match="channel"):
        RayExecutor(SOURCE, RUNTIME, hosts=2, devices_per_host=8, channel="pigeon")
    with pytest.raises(ValueError, match="gathers 'native' .* needs every shard in one process"):
        RayExecutor(SOURCE, dataclasses.replace(RUNTIME, gathers="native"), hosts=2,
                    devices_per_host=8)


# -- faults -----------------------------------------------------------------------------------
def _kill(executor, how: str, rank: int = 1) -> None:
    if how == "actor":
        ray.kill(executor.workers()[rank], no_restart=True)
    elif how == "process":
        os.kill(executor.worker_pids()[rank], signal.SIGKILL)
    else:                                   # "hang", "stall": alive but stopped
        os.kill(executor.worker_pids()[rank], signal.SIGSTOP)


def _run_until_quiet(engine, events: list, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.has_work:
        assert time.monotonic() < deadline, "the engine did not finish its work"
        events += [(time.monotonic(), e) for e in engine.step()]


SLOW = pytest.mark.slow          # each kill point restarts the group (~15 s here)


@pytest.mark.parametrize("how, during", [("process", "prefill"),
                                         pytest.param("actor", "decode", marks=SLOW),
                                         pytest.param("actor", "prefill", marks=SLOW),
                                         pytest.param("process", "decode", marks=SLOW),
                                         pytest.param("hang", "decode", marks=SLOW),
                                         pytest.param("stall", "decode", marks=SLOW)])
def test_killed_worker_costs_a_retry_never_a_token(tiny, executor, reference, how, during):
    """Kill worker 1 while a step is in flight: the request fails `unavailable` within the
    bounded time, a fresh group is up, the session is rebuilt from its token log, and
    retrying gives the unfaulted greedy tokens."""
    engine = Engine(executor.model, RUNTIME, executor)
    s = engine.create_session()
    prompt = reference["prompt"]
    generations_before = len(executor.recoveries)
    if during == "decode":
        engine.submit(Extend(id="prompt", session=s.id, tokens=np.asarray(prompt, np.int32)))
        _run_until_quiet(engine, [])
        engine.submit(Generate(id="gen", session=s.id,
                               sampling=SamplingParams(max_tokens=GENERATE)))
        kill_at = 3                                     # the third decode step
    else:
        engine.submit(Extend(id="prompt", session=s.id, tokens=np.asarray(prompt, np.int32)))
        kill_at = 2                                     # the second prefill chunk
    run, calls, killed = executor.run, [0], []

    def run_and_kill(plan):
        calls[0] += 1
        if calls[0] == kill_at:                         # lands while this step is in flight
            threading.Timer(0.01, lambda: (killed.append(time.monotonic()),
                                           _kill(executor, how))).start()
        try:
            return run(plan)
        except Exception:
            executor.step_timeout_s, executor.heartbeat_timeout_s = timeouts
            raise

    timeouts = executor.step_timeout_s, executor.heartbeat_timeout_s
    executor.run = run_and_kill
    if how == "stall":                      # the step timeout finds it before the heartbeat
        executor.step_timeout_s, executor.heartbeat_timeout_s = 2.0, 60.0
    events: list = []
    try:
        _run_until_quiet(engine, events)
    finally:
        del executor.run
        executor.step_timeout_s, executor.heartbeat_timeout_s = timeouts
    restored = time.monotonic() - killed[0]
    failed = [(t, e) for t, e in events if isinstance(e, Failed)]
    assert len(failed) == 1 and failed[0][1].code == "unavailable", events
    assert len(executor.recoveries) == generations_before + 1
    recovery = executor.recoveries[-1]
    assert recovery["restart_error"] is None and recovery["detect_s"] < 30.0
    if how == "hang":                       # the heartbeat found it, not the step timeout
        assert "heartbeat" in recovery["reason"]
    if how == "stall":
        assert "took longer than 2 s" in recovery["reason"]
    detected = failed[0][0] - killed[0]
    # The re-prefill of the token log ran (the engine queued it) and the session is whole.
    assert not engine.info(s.id)["restoring"] and engine.info(s.id)["cached"] >= PROMPT - 1
    if during == "prefill":
        assert s.tokens == prompt                        # every token stayed in the log
        engine.submit(Generate(id="gen", session=s.id,
                               sampling=SamplingParams(max_tokens=GENERATE)))
    else:
        made = s.tokens[PROMPT:]
        assert 0 < len(made) < GENERATE and made == reference["tokens"][: len(made)]
        engine.submit(Generate(id="gen2", session=s.id,
                               sampling=SamplingParams(max_tokens=GENERATE - len(made))))
    after: list = []
    _run_until_quiet(engine, after)
    assert any(isinstance(e, Done) for _, e in after)
    assert s.tokens == prompt + reference["tokens"], "greedy tokens after recovery differ"
    assert all(not isinstance(e, Failed) for _, e in after)
    print(f"\nkill {how} mid-{during}: failed after {detected:.2f} s (detect "
          f"{recovery['detect_s']:.2f} s, fresh group {recovery['restart_s']:.2f} s), "
          f"session restored after {restored:.2f} s")
    stats = executor.stats()
    assert stats["healthy"] and stats["generation"] == recovery["generation"] + 1
    engine.close_session(s.id)


# -- serving a checkpoint, split over the workers -------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An fp8 checkpoint (test_checkpoint's format: heads and experts that 16 devices split
    with padding) and the local executor's greedy continuation with its whole weights."""
    from test_checkpoint import HF_CONFIG, write_checkpoint, write_tokenizer

    d = tmp_path_factory.mktemp("ray-ckpt") / "ckpt"
    cfg, expected = write_checkpoint(d, HF_CONFIG, seed=4)
    write_tokenizer(d)
    whole = RuntimeConfig(model=cfg.name, kv_cache_dtype="f32", pages_per_shard=24,
                          chunk_size=64, weights="replicated", weight_dtype="f32")
    engine = Engine(cfg, whole, LocalExecutor(cfg, whole, expected))
    prompt = np.random.default_rng(0).integers(0, 400, PROMPT).tolist()
    s = engine.create_session()
    tokens = [int(engine.extend(s.id, prompt, all_logits=True)[-1].argmax())]
    for _ in range(GENERATE - 1):
        tokens.append(int(engine.decode([s.id], [tokens[-1]])[0].argmax()))
    shapes = model_shapes(cfg)                     # the model layout: experts stacked
    return {"dir": str(d), "prompt": prompt, "tokens": tokens,
            "whole_bytes": sum(4 * x.size for x in expected.values()),
            "device_bytes": {groups: bytes_per_device(device_tensors(
                shapes, cfg, "sharded", "f32", 16, expert_groups=groups)) for groups in (1, 4)}}


# Default: one group exchanged into 4 for the prompt (the TPU7x configuration's form, its
# all-to-all across the workers' processes); one group alone and 4 held groups run with the
# slow tests, for the default suite's time budget.
@pytest.mark.parametrize("groups,prefill_groups", [pytest.param(1, 1, marks=SLOW),
                                                   pytest.param(4, 1, marks=SLOW), (1, 4)])
def test_serve_a_checkpoint_split_over_ray_workers(ray_cluster, xla_cache, checkpoint, groups,
                                                   prefill_groups):
    """`cp-runtime serve --checkpoint DIR --weights sharded --executor ray`: each worker reads
    only its devices' blocks of the checkpoint, and the server's greedy tokens equal the local
    executor's with whole weights; `stats` shows both workers, each device with its part. With
    the routed experts in 4 groups (each worker holds two groups' experts) as well, and in one
    group exchanged into 4 for the prompt's two whole chunks and back for the generation
    (an all-to-all across the two workers' processes)."""
    server = ServerProcess(["--checkpoint", checkpoint["dir"], "--shards", "16",
                            "--expert-groups", str(groups),
                            "--prefill-expert-groups", str(prefill_groups),
                            "--weights", "sharded", "--weight-dtype", "f32",
                            "--kv-cache-dtype", "f32", "--pages-per-shard", "24",
                            "--chunk-size", "64", "--executor", "ray", "--hosts", "2",
                            "--devices-per-host", "8", "--ray-address", ray_cluster,
                            "--compile-cache", xla_cache], startup_s=180)
    try:
        with cp_runtime.Client(server.address) as client:
            session = client.create_session()
            session.extend(checkpoint["prompt"])
            gen = session.generate(max_tokens=GENERATE)
            assert gen.tokens == checkpoint["tokens"]
            workers = client.stats()["executor"]["workers"]
            assert [w["rank"] for w in workers] == [0, 1]
            assert all(w["healthy"] for w in workers)
            assert sum(w["pages_used"] for w in workers) == 10     # 160 tokens, 16 a page
            per_device = [b for w in workers for b in w["weight_bytes_per_device"].values()]
            assert len(per_device) == 16 and len(set(per_device)) == 1
            # the layout rule's share (cp_runtime.weights.sharding), a fraction of the whole
            assert per_device[0] == checkpoint["device_bytes"][groups]
            assert per_device[0] < checkpoint["whole_bytes"] / 4
    finally:
        assert server.stop() == 0, server.log()[-4000:]
