"""`RayExecutor`: the engine's executor over H hosts of D devices each (S = H x D shards), one
`HostWorker` actor per host, every step plan sent to all of them in lockstep.

    executor = RayExecutor(WeightsSource(model="tiny"), runtime, hosts=2, devices_per_host=8)
    engine = Engine(executor.model, runtime, executor)

Placement. One worker per node, in one placement group: STRICT_SPREAD on a cluster with at
least H nodes, PACK on one machine (the embedded CPU setup: H processes of D virtual devices,
gloo collectives). On TPU (the cluster has `TPU` resources) each worker reserves every chip
of its host: with `tpu_topology` and `tpu_version` (e.g. "2x2x2", "v7x") the slice is
reserved whole through `ray.util.tpu.slice_placement_group` (gang-scheduled on one slice, one
bundle per host), else a STRICT_SPREAD group of {"TPU": chips per host} bundles; ranks follow
the hosts' worker ids in the slice.

Lockstep. Every worker gets the same plan and runs the same SPMD program (the engine decided
everything once); rank 0's outputs come back (they are replicated: every rank has them). Plans
travel over a persistent socket per worker (`cluster/channel.py`, `channel="socket"`, the
default: well under a millisecond a step) or as plain actor calls (`channel="actor"`: a few
milliseconds); setup and heartbeats are actor calls either way. `cp-runtime bench dispatch`
measures both.

Faults. A heartbeat thread asks every worker for `health` every `heartbeat_s` (answered in
the worker's own concurrency group while a step runs); a worker that does not answer within
`heartbeat_timeout_s`, a worker Ray reports dead (actor killed, process gone), or a step that
takes longer than `step_timeout_s` fails the step (before the first step of each plan shape
in a group, every worker compiles it, or loads it from `compilation_cache_dir`, and only then
do all run it: a worker never waits in a collective's rendezvous, which gloo gives 30 s, for
another that is still compiling; compiling has `setup_timeout_s`, so a short step timeout
never fails a compile): the executor kills what is left of the
group (the survivors are stuck in a collective), starts a fresh one, and raises `WorkerLost`
(retryable, code `unavailable`). Every cache was lost with the group: the engine rebuilds its
sessions from their token logs, exactly as after any failed step (`Engine._recover` calls
`rebuild()`, then queues each session's re-prefill).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cp_runtime.cache.pool import CacheRows
from cp_runtime.config import RuntimeConfig
from cp_runtime.engine.executor import Executor, experts_for_plan, pool_spec_for
from cp_runtime.engine.requests import Unavailable
from cp_runtime.engine.step import Segment
from cp_runtime.model.source import WeightsSource

from cp_runtime.cluster import channel as channel_io
from cp_runtime.cluster.worker import HostWorker

__all__ = ["RayExecutor", "WorkerLost", "CHANNELS", "PLATFORMS"]

log = logging.getLogger(__name__)
PLATFORMS = ("auto", "cpu", "tpu")
CHANNELS = ("socket", "actor")
_POLL_S = 0.05


class WorkerLost(Unavailable):
    """A worker died or hung; a fresh worker group replaces it. Retryable: every session's
    cache is rebuilt from its token log."""


@dataclasses.dataclass
class _Group:
    """One generation of workers: started together, torn down together."""

    generation: int
    workers: list
    identities: list[dict]
    infos: list[dict]
    placement: object                          # a PlacementGroup or a SlicePlacementGroup
    started: float
    failure: str | None = None                  # set by the heartbeat thread
    health: list[dict | None] = dataclasses.field(default_factory=list)
    last_seen: list[float] = dataclasses.field(default_factory=list)
    sockets: list | None = None                 # the persistent channels, when open
    shapes: set = dataclasses.field(default_factory=set)   # plan shapes run (compiled)
    experts_in: int = 1         # the groups its routed experts are in now (as LocalExecutor's)


class RayExecutor(Executor):
    """The Executor interface over Ray actors, one per host (see the module docstring)."""

    def __init__(self, source: WeightsSource, runtime: RuntimeConfig, hosts: int = 2,
                 devices_per_host: int = 8, address: str | None = None, *,
                 platform: str = "auto", heartbeat_s: float = 1.0,
                 heartbeat_timeout_s: float = 10.0, step_timeout_s: float = 60.0,
                 setup_timeout_s: float = 900.0, tpu_topology: str | None = None,
                 tpu_version: str | None = None, compilation_cache_dir: str | None = None,
                 channel: str = "socket", ray_init: dict | None = None):
        if hosts * devices_per_host != runtime.num_shards:
            raise ValueError(f"hosts x devices per host = {hosts} x {devices_per_host} must "
                             f"equal the shard count {runtime.num_shards}")
        if hosts > 1 and runtime.strategy.gathers == "native":
            raise ValueError("gathers 'native' (the in-process gather) needs every shard in one "
                             f"process; {hosts} hosts are {hosts} processes: use auto or staged")
        if channel not in CHANNELS:
            raise ValueError(f"channel {channel!r} is not one of {CHANNELS}")
        if platform not in PLATFORMS:
            raise ValueError(f"platform {platform!r} is not one of {PLATFORMS}")
        for name, v in (("heartbeat_s", heartbeat_s), ("heartbeat_timeout_s", heartbeat_timeout_s),
                        ("step_timeout_s", step_timeout_s), ("setup_timeout_s", setup_timeout_s)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        self.source, self.runtime = source, runtime
        self.model = source.config()
        self.pool_spec = pool_spec_for(self.model, runtime)
        self.hosts, self.devices_per_host = hosts, devices_per_host
        self.heartbeat_s, self.heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        self.step_timeout_s, self.setup_timeout_s = step_timeout_s, setup_timeout_s
        self.tpu_topology, self.tpu_version = tpu_topology, tpu_version
        self.compilation_cache_dir = compilation_cache_dir
        self.recoveries: list[dict] = []        # one entry per worker group replaced
        self.dispatch = {"steps": 0, "wall_s": 0.0, "worker_s": 0.0}
        self.channel = channel
        self.last_worker_s = 0.0                # the last step's time inside the workers
        self._owns_ray = False
        if not ray.is_initialized():
            kwargs = dict(ray_init or {})
            if address is None:                 # embedded: room for one actor per host
                kwargs.setdefault("num_cpus", max(hosts + 1, os.cpu_count() or 1))
                kwargs.setdefault("include_dashboard", False)
            ray.init(address=address, **kwargs)
            self._owns_ray = True
        self.platform = self._detect_platform() if platform == "auto" else platform
        self._lock = threading.RLock()
        self._generation = 0
        self._group: _Group | None = None
        self._stop = threading.Event()
        self._start_group()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name="ray-executor-heartbeat")
        self._heartbeat.start()

    # -- placement and start ----------------------------------------------------------------
    @staticmethod
    def _detect_platform() -> str:
        return "tpu" if ray.cluster_resources().get("TPU", 0) > 0 else "cpu"

    def _placement(self) -> tuple[object, object, dict]:
        """(handle to release, placement group, actor resource options)."""
        h = self.hosts
        if self.platform == "tpu":
            tpu = getattr(ray.util, "tpu", None)
            if (self.tpu_topology and self.tpu_version and tpu is not None
                    and hasattr(tpu, "slice_placement_group")):
                try:
                    spg = tpu.slice_placement_group(self.tpu_topology, self.tpu_version)
                except Exception:                               # noqa: BLE001
                    # Hosts without slice labels (an on-prem Ray over TPU VMs whose metadata
                    # Ray cannot read): place by TPU resources alone, below.
                    log.warning("TPU slice placement failed; spreading over TPU hosts",
                                exc_info=True)
                else:
                    if spg.num_hosts != h:
                        spg.shutdown()
                        raise ValueError(f"a {self.tpu_version} {self.tpu_topology} slice has "
                                         f"{spg.num_hosts} hosts, --hosts is {h}")
                    chips = spg.devices_per_host
                    return spg, spg.placement_group, {"num_cpus": 0,
                                                      "resources": {"TPU": chips}}
            chips = self._tpu_chips_per_host()
            pg = placement_group([{"TPU": chips, "CPU": 1}] * h, strategy="STRICT_SPREAD")
            return pg, pg, {"num_cpus": 1, "resources": {"TPU": chips}}
        alive = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) >= 1]
        strategy = "STRICT_SPREAD" if len(alive) >= h else "PACK"
        pg = placement_group([{"CPU": 1}] * h, strategy=strategy)
        return pg, pg, {"num_cpus": 1}

    def _tpu_chips_per_host(self) -> int:
        per_node = [n["Resources"].get("TPU", 0) for n in ray.nodes() if n.get("Alive")]
        per_node = [int(c) for c in per_node if c > 0]
        if not per_node:
            raise RuntimeError("no TPU hosts in the Ray cluster")
        return max(per_node)

    def _start_group(self) -> None:
        """Start H workers, initialize jax.distributed among them, load weights, allocate the
        pool. Raises on failure, leaving no worker behind."""
        t0 = time.monotonic()
        handle, pg, options = self._placement()
        workers = []
        try:
            ray.get(pg.ready(), timeout=self.setup_timeout_s)
            workers = [HostWorker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i),
                max_restarts=0, max_task_retries=0, **options,
            ).remote(i, self.hosts, self.devices_per_host, self.platform)
                for i in range(self.hosts)]
            identities = ray.get([w.identity.remote() for w in workers],
                                 timeout=self.setup_timeout_s)
            if self.platform == "tpu" and all(i["tpu_worker_id"] is not None for i in identities):
                order = sorted(range(self.hosts), key=lambda i: identities[i]["tpu_worker_id"])
                workers = [workers[i] for i in order]
                identities = [identities[i] for i in order]
                ray.get([w.set_rank.remote(r) for r, w in enumerate(workers)])
            for r, ident in enumerate(identities):
                ident["rank"] = r
            coordinator = ray.get(workers[0].coordinator_endpoint.remote(),
                                  timeout=self.setup_timeout_s)
            refs = [w.setup.remote(coordinator, self.source, self.runtime,
                                   int(self.setup_timeout_s), self.compilation_cache_dir)
                    for w in workers]
            infos = self._wait(refs, self.setup_timeout_s, None, "setup")
        except BaseException:
            for w in workers:
                ray.kill(w, no_restart=True)
            self._release(handle)
            raise
        self._generation += 1
        now = time.monotonic()
        self._group = _Group(generation=self._generation, workers=workers,
                             identities=identities, infos=infos, placement=handle,
                             started=now, health=[None] * self.hosts,
                             last_seen=[now] * self.hosts)
        if self.channel == "socket":
            try:
                self._open_channels(self._group)
            except BaseException:
                self._teardown(self._group)
                raise
        log.info("worker group %d up in %.1f s: %s", self._generation, now - t0,
                 [(i["node_ip"], i["pid"]) for i in identities])

    @staticmethod
    def _release(handle) -> None:
        try:
            if hasattr(handle, "shutdown"):
                handle.shutdown()
            else:
                remove_placement_group(handle)
        except Exception:                                       # noqa: BLE001 - best effort
            log.exception("releasing a placement group failed")

    def _open_channels(self, group: _Group) -> None:
        secret = secrets.token_bytes(32)
        addresses = ray.get([w.open_channel.remote(secret) for w in group.workers],
                            timeout=self.setup_timeout_s)
        group.sockets = [channel_io.connect(a, secret) for a in addresses]

    def use_channel(self, name: str) -> None:
        """Send steps as actor calls ("actor") or over a persistent socket per worker
        ("socket"); the heartbeat stays on actor calls either way."""
        if name not in CHANNELS:
            raise ValueError(f"channel {name!r} is not one of {CHANNELS}")
        with self._lock:
            self.channel = name
            group = self._group
            if name == "socket" and group is not None and group.sockets is None:
                self._open_channels(group)

    def noop_roundtrip(self) -> float:
        """Seconds of one empty round trip to every worker on the current channel."""
        t0 = time.perf_counter()
        self._call("noop")
        return time.perf_counter() - t0

    def _teardown(self, group: _Group) -> None:
        for sock in group.sockets or ():
            try:
                sock.close()
            except OSError:
                pass
        for w in group.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:                                   # noqa: BLE001
                pass
        self._release(group.placement)
        if self._group is group:
            self._group = None

    # -- calls ------------------------------------------------------------------------------
    def _wait(self, refs: list, timeout_s: float, group: _Group | None, what: str) -> list:
        """Results of one call on every worker, or raise as soon as one worker is known dead,
        the heartbeat has failed the group, or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending),
                                      timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            for ref in ready:
                ray.get(ref)                    # raises if that worker died or failed
            if not pending:
                break
            if group is not None and group.failure:
                raise _GroupFailed(group.failure)
            if time.monotonic() >= deadline:
                raise _GroupFailed(f"{what} took longer than {timeout_s:g} s")
        return ray.get(refs)

    def _exchange(self, group: _Group, method: str, args: tuple, timeout_s: float) -> list:
        """`_wait` over the persistent channels: one frame out to every worker, one back."""
        for sock in group.sockets:
            channel_io.send(sock, (method, args))
        deadline = time.monotonic() + timeout_s
        results: list = [None] * len(group.sockets)
        pending = {sock: rank for rank, sock in enumerate(group.sockets)}
        while pending:
            ready = channel_io.wait_readable(
                list(pending), min(_POLL_S, max(0.0, deadline - time.monotonic())))
            for sock in ready:
                rank = pending.pop(sock)
                status, value = channel_io.recv(sock)
                if status != "ok":
                    raise _GroupFailed(f"worker {rank}: {value}")
                results[rank] = value
            if not pending:
                break
            if group.failure:
                raise _GroupFailed(group.failure)
            if time.monotonic() >= deadline:
                raise _GroupFailed(f"{method} took longer than {timeout_s:g} s")
        return results

    def _call(self, method: str, *args, timeout_s: float | None = None) -> list:
        """`method(*args)` on every worker in lockstep; on any failure replace the group and
        raise WorkerLost."""
        with self._lock:
            group = self._group
            if group is None:
                raise WorkerLost("no worker group is running (a restart failed); rebuild() "
                                 "starts one")
            t0 = time.monotonic()
            try:
                if self.channel == "socket" and group.sockets is not None:
                    return self._exchange(group, method, args, timeout_s or self.step_timeout_s)
                refs = [getattr(w, method).remote(*args) for w in group.workers]
                return self._wait(refs, timeout_s or self.step_timeout_s, group, method)
            except Exception as e:                              # noqa: BLE001
                reason = group.failure or f"{type(e).__name__}: {e}"
                self._replace(group, reason, t0)
                raise WorkerLost(f"worker group {group.generation} failed during {method} "
                                 f"({reason}); a fresh group is up, the cache is being "
                                 "rebuilt, retry") from e

    def _replace(self, group: _Group, reason: str, t0: float) -> None:
        detected = time.monotonic()
        self._teardown(group)
        record = {"generation": group.generation, "reason": reason[:500],
                  "detect_s": detected - t0, "restart_s": None, "restart_error": None}
        try:
            self._start_group()
            record["restart_s"] = time.monotonic() - detected
        except Exception as e:                                  # noqa: BLE001
            record["restart_error"] = f"{type(e).__name__}: {e}"
            log.exception("starting a fresh worker group failed")
        self.recoveries.append(record)

    # -- the Executor interface --------------------------------------------------------------
    def run(self, plan: tuple[Segment, ...]) -> list:
        t0 = time.perf_counter()
        group = self._group
        # Each layout of the experts has its own step programs (LocalExecutor): a plan's
        # shape is compiled once in each it runs in.
        experts = experts_for_plan(plan, self.runtime.prefill_expert_groups,
                                   self.runtime.chunk_size, 1 if group is None
                                   else group.experts_in)
        new = group is None or _plan_shape(plan, experts) not in group.shapes
        if new:
            # Every worker compiles first, then all run: a worker still compiling while
            # another waits in the step's first collective would fail the gloo rendezvous.
            self.compile(plan)
        results = self._call("run", plan, timeout_s=self.setup_timeout_s if new else None)
        if group is not None:
            group.experts_in = experts
        outs, _ = results[0]
        self.last_worker_s = max(s for _, s in results)
        self.dispatch["steps"] += 1
        self.dispatch["wall_s"] += time.perf_counter() - t0
        self.dispatch["worker_s"] += self.last_worker_s
        return outs

    def compile(self, plan: tuple[Segment, ...]) -> None:
        """Every worker compiles the plan's programs (or loads them from its compilation
        cache); the group then runs that shape without a compile."""
        group = self._group
        experts = experts_for_plan(plan, self.runtime.prefill_expert_groups,
                                   self.runtime.chunk_size, 1 if group is None
                                   else group.experts_in)
        self._call("compile", plan, timeout_s=self.setup_timeout_s)
        if self._group is not None:
            self._group.shapes.add(_plan_shape(plan, experts))

    def copy_pages(self, shard, src, dst) -> None:
        self._call("copy_pages", *(np.asarray(a, np.int32) for a in (shard, src, dst)))

    def read_rows(self, shard, slot, offset) -> CacheRows:
        return self._call("read_rows", shard, slot, offset)[0]

    def write_rows(self, shard, slot, offset, rows: CacheRows) -> None:
        self._call("write_rows", shard, slot, offset, rows)

    def rebuild(self) -> None:
        """A fresh, empty pool: a new worker group if the last one failed (or could not be
        started), else each worker reallocates its shards."""
        with self._lock:
            if self._group is None:
                try:
                    self._start_group()
                except Exception:                               # noqa: BLE001
                    # Never raise into the engine's recovery: its restores stay queued, the
                    # next step finds no group (WorkerLost, retryable) and comes back here.
                    log.exception("starting a worker group failed; retrying at the next step")
                    time.sleep(self.heartbeat_s)
                return
            self._call("rebuild")

    def close(self) -> None:
        self._stop.set()
        self._heartbeat.join(timeout=self.heartbeat_timeout_s + 1.0)
        with self._lock:
            if self._group is not None:
                self._teardown(self._group)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    # -- health -----------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            group = self._group
            if group is None or group.failure:
                continue
            try:
                refs = [w.health.remote() for w in group.workers]
            except Exception:                                   # noqa: BLE001 - torn down
                continue
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.heartbeat_timeout_s)
            now = time.monotonic()
            for rank, ref in enumerate(refs):
                if ref in ready:
                    try:
                        group.health[rank] = ray.get(ref)
                        group.last_seen[rank] = now
                        continue
                    except Exception as e:                      # noqa: BLE001
                        problem = f"worker {rank} is gone ({type(e).__name__})"
                else:
                    problem = (f"worker {rank} missed its heartbeat "
                               f"({self.heartbeat_timeout_s:g} s)")
                if group is self._group and not self._stop.is_set():
                    group.failure = group.failure or problem

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers, by rank (for fault tests)."""
        return [i["pid"] for i in self._group.identities]

    def workers(self) -> list:
        """The current worker actor handles, by rank (for fault tests)."""
        return list(self._group.workers)

    def stats(self, pages_used_per_shard: list[int] | None = None) -> dict:
        """Every worker's health and place (its shards, and with the engine's pages in use
        per shard, its host's pool usage), the recoveries so far, and dispatch cost."""
        group = self._group
        now = time.monotonic()
        workers = []
        if group is not None:
            for rank, ident in enumerate(group.identities):
                h = group.health[rank] or {}
                info = group.infos[rank] if group.infos else {}
                shards = info.get("shards", [])
                usage = {}
                if pages_used_per_shard is not None:
                    used = [int(pages_used_per_shard[i]) for i in shards]
                    usage = {"pages_used_per_shard": used, "pages_used": sum(used),
                             "pages": len(shards) * self.runtime.pages_per_shard}
                workers.append({**usage,
                    "rank": rank, "node_ip": ident["node_ip"], "pid": ident["pid"],
                    "healthy": group.failure is None,
                    "state": h.get("state", "ready"),
                    "last_heartbeat_s": now - group.last_seen[rank],
                    "steps": h.get("steps", 0), "busy_s": h.get("busy_s", 0.0),
                    "shards": shards, "pool_bytes": info.get("pool_bytes", 0),
                    "weight_bytes_per_device": info.get("weight_bytes_per_device", {})})
        d = self.dispatch
        return {"executor": "ray", "platform": self.platform, "channel": self.channel,
                "hosts": self.hosts,
                "devices_per_host": self.devices_per_host,
                "generation": group.generation if group else None,
                "healthy": group is not None and group.failure is None,
                "workers": workers, "recoveries": list(self.recoveries),
                "dispatch_overhead_ms": (1e3 * (d["wall_s"] - d["worker_s"]) / d["steps"]
                                         if d["steps"] else None)}


class _GroupFailed(RuntimeError):
    pass


def _plan_shape(plan: tuple[Segment, ...], experts: int) -> tuple:
    """What a plan's programs are compiled for: the experts' layout, and per segment its kind,
    token and table shapes, tier and sampling variant."""
    return (experts, *((seg.kind, seg.inputs.tokens.shape, seg.inputs.page_table.shape,
                        seg.in_hbm, seg.sampling and seg.sampling.variant) for seg in plan))
