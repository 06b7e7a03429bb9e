"""Each step phase's device time, read from a JAX profiler trace (`cp-runtime bench chip
--trace`; benchmarks/chip.py).

`jax.profiler.trace(DIR)` writes `DIR/plugins/profile/<run>/<host>.xplane.pb`, which
`jax.profiler.ProfileData` (jaxlib's own reader; no TensorBoard, no protobuf package) reads
offline. What it holds of a step program's work:

    TPU   a plane per chip (`/device:TPU:0`) with a line "XLA Ops", one event per HLO
          instruction run (named as the instruction), and a line "XLA Modules", one event per
          program run
    CPU   the host plane's XLA:CPU threads, one event per thunk run, its instruction and module
          in the event's `hlo_op` and `hlo_module` stats

An instruction's name says nothing of its phase; the compiled module's text does: each
instruction carries the op_name of the `jax.named_scope` path it was traced under, which names
its phase (cp_runtime.model.scopes), and an instruction XLA made without one takes the phase of
its nearest named consumer or producer (cp_runtime.aot.phases's rule). The step programs that
ran inside the trace are compiled once more from the same arguments, which JAX answers from its
cache (no compile), for their text.

Per phase, the time of its instructions' events, each counted without the events nested
inside it on the same line (a loop's body ops under the loop), summed and divided by the steps
run in the trace; instructions the module does not name (a transfer, another program) are
left out, and events of the step modules whose names the text lacks count as `unattributed`.
On a TPU the events are the TensorCore's, one at a time, so the phases add up to the busy time
of the chip; `module_ms` is the programs' own events (call to done on the chip). On the CPU the
devices are host threads and events of several run at once: the sums are thread time.
"""

from __future__ import annotations

import pathlib
import re
import shutil

import jax

__all__ = ["Recorder", "compiled_texts", "estimated_phase_ms", "instruction_phases",
           "newest_xplane", "phase_times", "start_trace", "stop_trace"]

_MODULE = re.compile(r"^HloModule ([\w.\-]+)", re.M)
_OP = re.compile(r"%?([\w.\-]+)")


class Recorder:
    """Wraps an executor's `run` to keep the segments it ran (one of each program shape) while
    recording, and the last exception a run raised (the engine reports only its text)."""

    def __init__(self, executor):
        self.executor, self._run = executor, executor.run
        self.segments: dict[tuple, object] = {}
        self.shapes: set[tuple] = set()           # every program shape run, recording or not
        self.recording = False
        self.last_error: str | None = None
        executor.run = self.run

    def run(self, plan):
        for seg in plan:
            try:
                key = (seg.kind, seg.in_hbm,
                       *(getattr(x, "shape", None) for x in jax.tree.leaves(
                           (seg.inputs.tokens, seg.inputs.page_table, seg.sampling))))
            except Exception:             # noqa: BLE001 - never in the way of the step
                key = (seg.kind, id(seg))
            self.shapes.add(key)
            if self.recording:
                self.segments.setdefault(key, seg)
        try:
            return self._run(plan)
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
            raise

    def start(self) -> None:
        self.segments, self.recording = {}, True

    def stop(self) -> list:
        self.recording = False
        return list(self.segments.values())


def compiled_texts(executor, segments: list) -> list[str]:
    """The compiled module text of the executor's step program for each segment (from JAX's
    cache: each has run already)."""
    texts = []
    for seg in segments:
        args = seg.to_device(executor.mesh, executor.runtime.num_shards)
        step = executor._step_for(executor.experts_in)
        texts.append(step.lower(executor.params, executor.pool, args, kind=seg.kind,
                                in_hbm=seg.in_hbm).compile().as_text())
    return texts


def _phase_of(op_name: str) -> str | None:
    from cp_runtime.model.scopes import PHASES
    return next((p for p in reversed(op_name.split("/")) if p in PHASES), None)


def instruction_phases(text: str) -> tuple[str, dict[str, str]]:
    """(module name, {instruction name: phase}) of a compiled module's text: entry instructions
    by cp_runtime.aot.phases's rule (op_name, else the nearest named consumer or producer),
    others by their own op_name, else by the entry instruction that calls their computation."""
    from cp_runtime.aot import hlo, phases

    module = hlo.parse_module(text)
    found = _MODULE.search(text)
    name = found.group(1) if found else module.entry
    try:
        entry = {k: key[1] for k, key in phases._keys(module).items()}
    except Exception:                     # noqa: BLE001 - that rule is private; op_name alone
        entry = {i.name: _phase_of(i.op_name) or "other"
                 for i in module.computations[module.entry]}
    callers = module.callers()
    home = {i.name: comp for comp, body in module.computations.items() for i in body}
    out = dict(entry)
    for comp, body in module.computations.items():
        if comp == module.entry:
            continue
        caller = callers.get(comp)
        for _ in range(16):
            if caller is None or home.get(caller.name) == module.entry:
                break
            caller = callers.get(home.get(caller.name))
        inherited = entry.get(caller.name, "other") if caller is not None else "other"
        for ins in body:
            out.setdefault(ins.name, _phase_of(ins.op_name) or inherited)
    return name, out


def start_trace(log_dir: pathlib.Path) -> None:
    """jax.profiler's trace into `log_dir` (emptied first), without the Python tracer."""
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
    except Exception:                     # noqa: BLE001 - another API: the trace's defaults
        jax.profiler.start_trace(str(log_dir))
        return
    jax.profiler.start_trace(str(log_dir), profiler_options=options)


def stop_trace() -> None:
    jax.profiler.stop_trace()


def newest_xplane(log_dir: pathlib.Path) -> pathlib.Path | None:
    found = sorted(pathlib.Path(log_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _stats(event) -> dict:
    out = {}
    try:
        for key, value in event.stats:
            if key is not None:
                out[key] = value
    except Exception:                     # noqa: BLE001 - a stat the reader cannot decode
        pass
    return out


def _self_times(events: list[tuple]) -> list[float]:
    """Each event's time without the events nested inside it; events are (start, duration,
    ...) on one line, in any order. Returns the self times in the events' order."""
    order = sorted(range(len(events)), key=lambda i: (events[i][0], -events[i][1]))
    own = [float(e[1]) for e in events]
    stack: list[int] = []
    for i in order:
        start = events[i][0]
        while stack and events[stack[-1]][0] + events[stack[-1]][1] <= start:
            stack.pop()
        if stack:
            own[stack[-1]] -= min(events[i][1], events[stack[-1]][0] + events[stack[-1]][1]
                                  - start)
        stack.append(i)
    return [max(t, 0.0) for t in own]


def _matches(module: str | None, names: dict[str, dict]) -> str | None:
    """The step module an event's module name is (a TPU may add an id: `jit_step(12)`)."""
    if module is None:
        return None
    base = str(module).split("(")[0].strip()
    if base in names:
        return base
    near = [n for n in names if base.startswith(n) or n.startswith(base)]   # `jit_step.1`
    return near[0] if len(near) == 1 else None


def _collect(data) -> tuple[str, list, list]:
    """(source, op lines, module events) of a trace: op lines [(events, module per event)],
    events (start_ns, duration_ns, instruction); module events (name, start_ns, duration_ns)."""
    planes = list(data.planes)
    devices = [p for p in planes if p.name.startswith("/device:")
               and not p.name.startswith("/device:CUSTOM")]
    lines, modules = [], []
    for plane in devices:
        plane_modules = []
        for line in plane.lines:
            if line.name == "XLA Modules":
                plane_modules += [(ev.name, ev.start_ns, ev.duration_ns) for ev in line.events]
        modules += plane_modules
        spans = sorted(plane_modules, key=lambda m: m[1])
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            events, owners = [], []
            for ev in line.events:
                stats = _stats(ev)
                events.append((ev.start_ns, ev.duration_ns,
                               _op_name(stats.get("hlo_op") or ev.name)))
                owners.append(stats.get("hlo_module") or _enclosing(spans, ev.start_ns))
            lines.append((events, owners))
    if lines:
        return "device planes", lines, modules
    for plane in planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            events, owners = [], []
            for ev in line.events:
                stats = _stats(ev)
                if "hlo_op" in stats:
                    events.append((ev.start_ns, ev.duration_ns, str(stats["hlo_op"])))
                    owners.append(stats.get("hlo_module"))
            if events:
                lines.append((events, owners))
    return "host threads", lines, modules


def _op_name(text) -> str:
    """The instruction an event names: `fusion.12` of `%fusion.12 = f32[...] fusion(...)`."""
    found = _OP.match(str(text).strip())
    return found.group(1) if found else str(text)


def _enclosing(spans: list, start_ns: float) -> str | None:
    for name, s, d in spans:
        if s <= start_ns <= s + d:
            return name
        if s > start_ns:
            break
    return None


def phase_times(xplane: pathlib.Path | None, texts: list[str], steps: int) -> dict:
    """Per phase, the ms a step of the traced step programs (`texts`, their compiled modules)
    spent in it, over `steps` steps run in the trace (the module docstring says how); with
    `available` False and why, where the trace cannot be read or holds none of their events."""
    if xplane is None:
        return {"available": False, "why": "the profiler wrote no .xplane.pb"}
    try:
        from jax.profiler import ProfileData
        data = ProfileData.from_file(str(xplane))
    except Exception as e:                # noqa: BLE001 - the reader is jaxlib's; report why
        return {"available": False, "why": f"cannot read {xplane}: {type(e).__name__}: {e}"}
    names = dict(instruction_phases(t) for t in texts)
    source, lines, modules = _collect(data)
    phases: dict[str, float] = {}
    unnamed: dict[str, float] = {}
    matched = seen = 0
    for events, owners in lines:
        own = _self_times(events)
        for (_, _, op), owner, t in zip(events, owners, own):
            module = _matches(owner, names)
            if module is None and owner is None and len(names) == 1:
                module = next(iter(names))     # no module info: the one traced program
            if module is None:
                continue
            seen += 1
            phase = names[module].get(op)
            matched += phase is not None
            if phase is None:
                unnamed[op] = unnamed.get(op, 0.0) + t
            key = phase or "unattributed"
            phases[key] = phases.get(key, 0.0) + t
    step_modules = [d for n, _, d in modules if _matches(n, names)]
    summary = {"planes": sorted({p.name for p in data.planes})[:12]}
    if not seen:
        ops = [(op, owner) for events, owners in lines[:4]
               for (_, _, op), owner in zip(events[:3], owners[:3])]
        return {"available": False, "source": source, **summary,
                "lines": sorted({line.name for p in data.planes for line in p.lines})[:24],
                "sample_ops": [f"{op} ({owner})" for op, owner in ops],
                "why": f"none of the trace's {sum(len(e) for e, _ in lines)} op events belongs "
                       f"to the traced step programs {sorted(names)}"}
    return {"available": True, "source": source, "steps": steps, "events": seen,
            "events_named": matched, "xplane": str(xplane),
            "unattributed_ops": sorted(unnamed, key=lambda k: -unnamed[k])[:8],
            "busy_ms": sum(phases.values()) / steps / 1e6,
            "module_ms": sum(step_modules) / steps / 1e6 if step_modules else None,
            "phases_ms": {k: v / steps / 1e6 for k, v in sorted(phases.items(),
                                                                 key=lambda kv: -kv[1])},
            **summary}


def estimated_phase_ms(texts: list[str], device, peaks: dict) -> dict[str, float]:
    """The compiler's estimate of a step's ms per phase on `device` (a real chip): each traced
    program's figures (cp_runtime.aot.phases, read from its compiled text) priced at the
    compiler's clock for that chip and at the peaks measured in the same run (bf16 matmul
    TFLOP/s for the MXU, fp8 included, since a chip without fp8 products runs them in bf16;
    the HBM read GB/s), each program once a step. `compile --matrix --calibration` scales the
    TPU7x figures by measured / estimated per phase."""
    from cp_runtime.aot.phases import phase_figures
    from cp_runtime.aot.roofline import DeviceRates, compiler_clock_hz, phase_time

    clock = compiler_clock_hz(device)
    mxu = peaks["matmul_tflop_per_s"] * 1e12
    # VPU operations a cycle as the TPU7x assumption takes them (aot/roofline.py's note).
    rates = DeviceRates(bf16_flops=mxu, fp8_flops=mxu,
                        hbm_bytes_per_s=peaks["hbm_read_gb_per_s"] * 1e9,
                        ici_bytes_per_s=float("inf"), vpu_ops=2310 * clock)
    out: dict[str, float] = {}
    for text in texts:
        for name, figures in phase_figures(text, clock, rates).items():
            ms = 1e3 * phase_time(figures, rates, clock).seconds
            if ms:
                out[name] = out.get(name, 0.0) + ms
    return out
