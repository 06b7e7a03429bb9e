"""One worker per host: a Ray actor that owns its host's devices, its local shards of the pool
and its own copy of the weights, and runs the same SPMD step as every other host.

    worker = HostWorker.options(...).remote(rank, num_hosts, devices_per_host, platform)
    ip, port = ray.get(worker.coordinator_endpoint.remote())        # asked of rank 0 only
    ray.get([w.setup.remote(coordinator, source, runtime) for w in workers])   # all at once
    ray.get([w.compile.remote(plan) for w in workers])      # a new plan shape: all compile,
    outputs = ray.get([w.run.remote(plan) for w in workers])[0]     # then run in lockstep

`setup` calls `jax.distributed.initialize` before any other JAX call in the process (on a CPU
it first asks for `devices_per_host` virtual devices and gloo collectives), loads the weights
from the `WeightsSource` description (never arrays from another process), and builds a
`LocalExecutor` over the global mesh: `jax.devices()` lists every process's devices once
`jax.distributed` is up, so the same executor code that runs one process runs each of many,
each process holding the shards of its own devices. Step outputs are replicated, so every rank
could return them; only rank 0 sends them back.

Methods run in two concurrency groups: "step" (setup, compile, run, page copies: one at a
time, in the order sent) and "health" (`health`, answered while a step runs: the executor's
heartbeat).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import ray

from cp_runtime.cluster import channel

__all__ = ["HostWorker", "WORKER_GROUPS"]

WORKER_GROUPS = {"step": 1, "health": 1}


class _Worker:
    def __init__(self, rank: int, num_hosts: int, devices_per_host: int, platform: str):
        # No JAX here: jax.distributed.initialize must come first (in `setup`).
        self.rank, self.num_hosts = rank, num_hosts
        self.devices_per_host, self.platform = devices_per_host, platform
        self.executor = None
        self.pool_bytes = 0
        self.started = time.time()
        self.steps = 0
        self.step_s = 0.0                    # seconds inside run(), all steps
        self.last_step_s = 0.0
        self.busy_since: float | None = None
        self.state = "created"
        self._lock = threading.Lock()

    # -- placement --------------------------------------------------------------------------
    @ray.method(concurrency_group="health")
    def identity(self) -> dict:
        """Where this worker runs: node, pid, and (on a TPU host) its worker id in the slice."""
        tpu_worker_id = None
        if self.platform == "tpu":
            try:
                from ray._private.accelerators.tpu import TPUAcceleratorManager
                tpu_worker_id = TPUAcceleratorManager.get_current_node_tpu_worker_id()
            except Exception:                                   # noqa: BLE001 - best effort
                tpu_worker_id = None
        return {"rank": self.rank, "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "tpu_worker_id": tpu_worker_id}

    @ray.method(concurrency_group="health")
    def set_rank(self, rank: int) -> None:
        """Ranks are fixed before `setup` (on a TPU slice: the host's worker id)."""
        self.rank = rank

    @ray.method(concurrency_group="health")
    def coordinator_endpoint(self) -> str:
        """HOST:PORT for jax.distributed's coordinator on this host (a free port now)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    # -- setup ------------------------------------------------------------------------------
    @ray.method(concurrency_group="step")
    def setup(self, coordinator: str, source, runtime, initialization_timeout_s: int = 300,
              compilation_cache_dir: str | None = None) -> dict:
        """jax.distributed first, then weights, mesh and pool (this host's shards)."""
        t0 = time.perf_counter()
        import jax

        self.state = "initializing"
        if self.platform == "cpu":
            from cp_runtime.kernels.packing import interpret_pool_threads
            os.environ.setdefault("PJRT_NPROC", str(max(
                os.cpu_count() or 1, interpret_pool_threads(self.devices_per_host))))
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", self.devices_per_host)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=self.num_hosts, process_id=self.rank,
                                   initialization_timeout=initialization_timeout_s)
        if compilation_cache_dir:
            from cp_runtime.engine.precompile import enable_compile_cache
            enable_compile_cache(compilation_cache_dir)
        if jax.process_count() != self.num_hosts:
            raise RuntimeError(f"jax sees {jax.process_count()} processes, "
                               f"{self.num_hosts} expected")
        if jax.local_device_count() != self.devices_per_host:
            raise RuntimeError(f"host {self.rank} has {jax.local_device_count()} devices, "
                               f"{self.devices_per_host} expected")
        from cp_runtime.engine.executor import LocalExecutor

        t1 = time.perf_counter()
        self.state = "loading"
        loaded = source.load()
        t2 = time.perf_counter()
        self.executor = LocalExecutor(loaded.config, runtime, loaded.weights)
        t3 = time.perf_counter()
        self.pool_bytes = self._local_pool_bytes()
        self.state = "ready"
        mine = [d.id for d in self.executor.mesh.devices.flat
                if d.process_index == jax.process_index()]
        return {"rank": self.rank, "process_index": jax.process_index(),
                "devices": jax.device_count(), "local_devices": jax.local_device_count(),
                "device_kind": jax.devices()[0].device_kind,
                "shards": [i for i, d in enumerate(self.executor.mesh.devices.flat)
                           if d.id in mine],
                "pool_bytes": self.pool_bytes,
                "weight_bytes_per_device": self.executor.weight_bytes(),
                "setup_s": {"distributed": t1 - t0, "weights": t2 - t1, "executor": t3 - t2}}

    def _local_pool_bytes(self) -> int:
        pool = self.executor.pool
        return sum(s.data.nbytes for x in pool.latent + pool.indexer
                   for s in x.addressable_shards)

    # -- the persistent channel --------------------------------------------------------------
    @ray.method(concurrency_group="health")
    def open_channel(self, secret: bytes) -> str:
        """Listen for the executor's connection (it must present `secret`); steps sent over
        it run exactly as the actor methods below. Returns HOST:PORT."""
        host = ray.util.get_node_ip_address()
        srv = channel.listen(host)
        port = srv.getsockname()[1]
        threading.Thread(target=self._serve_channel, args=(srv, secret), daemon=True,
                         name="cp-runtime-channel").start()
        return f"{host}:{port}"

    def _serve_channel(self, srv, secret: bytes) -> None:
        try:
            conn = channel.accept(srv, secret)
        except OSError:
            return
        with conn:
            while True:
                try:
                    method, args = channel.recv(conn)
                except (OSError, channel.ChannelClosed):
                    return
                try:
                    reply = ("ok", None if method == "noop" else self._handle(method, *args))
                except Exception as e:                          # noqa: BLE001 - sent back
                    reply = ("error", f"{type(e).__name__}: {e}")
                try:
                    channel.send(conn, reply)
                except OSError:
                    return

    def _handle(self, method: str, *args):
        if method == "run":
            outs = self._timed(self.executor.run, *args)
            return (outs if self.rank == 0 else None), self.last_step_s
        if method == "compile":                 # not a step: no step counts or times
            self.state = "compiling"
            try:
                return self.executor.compile(*args)
            finally:
                self.state = "ready"
        if method == "read_rows":
            rows = self._timed(self.executor.read_rows, *args)
            return rows if self.rank == 0 else None
        if method in ("copy_pages", "write_rows"):
            return self._timed(getattr(self.executor, method), *args)
        if method == "rebuild":
            return self.executor.rebuild()
        raise ValueError(f"unknown method {method!r}")

    # -- steps ------------------------------------------------------------------------------
    def _timed(self, fn, *args):
        self.busy_since = time.time()
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.last_step_s = time.perf_counter() - t0
            self.step_s += self.last_step_s
            self.steps += 1
            self.busy_since = None

    @ray.method(concurrency_group="step")
    def run(self, plan: tuple) -> tuple[list | None, float]:
        """Run one step plan; (outputs on rank 0 else None, seconds this step took here)."""
        return self._handle("run", plan)

    @ray.method(concurrency_group="step")
    def compile(self, plan: tuple) -> None:
        """Compile a step plan's programs without running them."""
        self._handle("compile", plan)

    @ray.method(concurrency_group="step")
    def copy_pages(self, shard, src, dst) -> None:
        self._handle("copy_pages", shard, src, dst)

    @ray.method(concurrency_group="step")
    def read_rows(self, shard, slot, offset):
        return self._handle("read_rows", shard, slot, offset)

    @ray.method(concurrency_group="step")
    def write_rows(self, shard, slot, offset, rows) -> None:
        self._handle("write_rows", shard, slot, offset, rows)

    @ray.method(concurrency_group="step")
    def rebuild(self) -> None:
        """A fresh, empty pool (the old one may have been donated to a failed step)."""
        self._handle("rebuild")

    @ray.method(concurrency_group="step")
    def noop(self) -> None:
        """Nothing: the round trip of an actor call."""

    # -- health -----------------------------------------------------------------------------
    @ray.method(concurrency_group="health")
    def health(self) -> dict:
        """Answered while a step runs (its own concurrency group): the executor's heartbeat."""
        now = time.time()
        return {"rank": self.rank, "pid": os.getpid(), "state": self.state,
                "steps": self.steps, "step_s_total": self.step_s,
                "last_step_s": self.last_step_s,
                "busy_s": (now - self.busy_since) if self.busy_since else 0.0,
                "uptime_s": now - self.started,
                "pool_bytes": self.pool_bytes}


HostWorker = ray.remote(concurrency_groups=WORKER_GROUPS)(_Worker)
