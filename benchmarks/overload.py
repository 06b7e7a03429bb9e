"""Graceful overload: more clients than a server can serve in time, each uploading one document
under a deadline, against a server with no admission bound and one with its default (auto) bound.

    cp-runtime bench overload                # 32 and 64 clients x 2000 tokens, 30 s deadlines:
                                             # out/overload.json and out/overload.md (~2.5 min)
    cp-runtime bench overload --quick        # 24 clients x 1K tokens, 2 s deadlines (~40 s)
    cp-runtime bench overload --bounds 0,default,16k,32k     # any bounds (0: none)

For each bound in `--bounds` (default `0,default`: none, "before", and the server's default,
"after") the benchmark starts a `cp-runtime serve` process (`--port 0`, its `listening on` line
read back; `--max-queued-tokens` the bound, none for `default`), warms it up (an upload of
`--tokens` tokens, and with 2+ shards a second on another start shard, so the fill step is
compiled for every page-table width the run will use), measures it, and stops it before the
next. The servers share a persistent XLA compilation cache (`--compilation-cache-dir`, else a
temporary one), so only the first compiles. For each count in `--clients`, that many clients
start together, each with its own `AsyncClient` connection and session, each uploading
`--tokens` random tokens in one extend, each with `--deadline-s` from the moment they all
start:

    completed   the extend's done came before the deadline (completion s: from the start)
    refused     the server answered `overloaded` (OverloadedError); refusal ms: from sending
                the extend to the answer. Refused clients do not retry.
    timed out   not done by the deadline: the client gives up and closes its connection
    failed      any other error (none is expected: the pool holds every client's session at
                once and the server takes --clients + 8 connections, so a refusal is the
                queue's, never the pool's or a connection limit's; a warning names any)

Then the run's sessions are closed (a timed-out client's accepted extend would otherwise run
on, into the next count's figures) and the next count starts on an idle server. `server tok/s`
is the prefill tokens the server ran during the run (its `stats`) over the run's wall time.

The default bound is auto: after every step the engine sets it to AUTO_QUEUE_S (10) seconds of
its prefill rate over the last minute's steps that ran a prefill chunk, at least 16 chunks
(cp_runtime/engine/core.py; a shape's first step, which compiled, does not count). Its label
is `auto (10 s of prefill)`, and `bound at start` (`bound_at_start` in the JSON) is the bound
the server's `stats` reported (`max_queued_tokens`) when the clients started.

Extends take turns a chunk at a time (cp_runtime/engine/scheduler.py), so without a bound every
upload advances at 1/N of the server's prefill rate, and when N uploads take longer than the
deadline they all finish late together: none completes. With a bound the server takes uploads
while the queued prefill is under it and refuses the rest at once; the ones it took finish in
bound / rate seconds, and a refusal waits only for the step running when it arrives (the
engine admits requests between steps).

Defaults: the tiny model on 16 shards (serve's), page 16, chunk 256 (the auto bound's floor:
4096 tokens), so that on the 2-core development machine, prefilling about 1,000-1,900 tokens/s,
32 uploads of 2,000 tokens take one to two times the 30 s deadline and 64 two to four times.
`--quick`: the small model on one shard, page 64, chunk 128 (floor 2048), 24 x 1K tokens (about
6,000 tokens/s: 4 s of prefill) on 2 s deadlines.

docs/notes/2026-12-02-overload.md has the measured figures, the refusals' latency and an
earlier sweep of fixed bounds and 1K chunks: a bound above what the server prefills within the
deadline times out the uploads it took, as no bound does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
import tempfile
import time

import numpy as np

from cp_runtime.benchmarks._shared.bench_parser import BY_QUICK, BenchmarkParser
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.cli.args import (comma_list, finite_positive_float, length, nonnegative_length,
                                 positive_int, positive_int_list)
from cp_runtime.engine.core import AUTO_QUEUE_S
from cp_runtime.serving.process import ServerProcess

__all__ = ["Client", "build_parser", "parse_args", "main", "pages_per_shard_for", "summarize"]

STARTUP_S = 300.0
DEFAULT = "default"                     # a --bounds entry: the server's default, the auto bound
# Flags --quick changes: dest -> (default, --quick value[, why]), as typed; an explicit flag
# wins.
QUICK = {
    "clients": ("32,64", "24"),
    "tokens": ("2000", "1k"),
    "deadline_s": ("30", "2"),
    "model": ("tiny", "small", "two layers, quick to compile"),
    "shards": ("16", "1"),
    "page_size": ("16", "64", "fewer page-table widths to compile"),
    "chunk_size": ("256", "128", "with 1k chunks the 2-core development machine prefills "
                                 "32 x 2000 tokens in about 30 s, barely overloaded"),
}


def _bound(text: str) -> int | str:
    """A --bounds entry: `default`, or a token count (0: no bound)."""
    return DEFAULT if text.strip() == DEFAULT else nonnegative_length(text)


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser(
        "overload", "More clients than a server can serve in time, each uploading a document "
                    "under a deadline, against servers with and without an admission bound "
                    "(serve --max-queued-tokens): completed, refused and timed-out clients, the "
                    "refusals' latency and the completions' time.",
        quick="fewer clients and tokens, shorter deadlines, the small model on one shard: well "
              "under a minute on a CPU (explicit flags win)",
        quick_values=QUICK, check=_check)
    p.add_argument("--clients", type=positive_int_list, metavar="N[,N...]",
                   help="concurrent clients per run, one run per count")
    p.add_argument("--tokens", type=length, metavar="N",
                   help="tokens each client uploads in one extend, k/m suffixes allowed")
    p.add_argument("--deadline-s", type=finite_positive_float, metavar="S",
                   help="each client's deadline, from the moment they all start")
    p.add_argument("--bounds", type=comma_list(_bound), default=[0, DEFAULT],
                   metavar="B[,B...]",
                   help="the servers' --max-queued-tokens, one server each: a token count (0: "
                        "no bound) or 'default' (no flag: the server's auto bound, "
                        f"{AUTO_QUEUE_S:g} s of its measured prefill rate and at least 16 "
                        "chunks)")
    p.add_argument("--pages-per-shard", type=positive_int, metavar="N", default=None,
                   help="KV pages per shard (default: enough for every client's session at "
                        "once, so no refusal is for want of pages)")
    p.add_argument("--compilation-cache-dir", metavar="DIR", default=None,
                   help="the servers' persistent XLA compilation cache (JAX's), so the second "
                        "server, and a later run given the same DIR, starts without compiling "
                        "again (default: a temporary directory for the run)")
    p.add_shared(model=BY_QUICK, shards=BY_QUICK, kv_cache_dtype="fp8_e4m3", page_size=BY_QUICK,
                 chunk_size=BY_QUICK, seed="the random document tokens", out="out",
                 progress=True, devices=False, whole_chunks=True)
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    need = pages_per_shard_for(max(args.clients), args.tokens, args.shards, args.page_size)
    if args.pages_per_shard is not None and args.pages_per_shard < need:
        parser.error(f"--pages-per-shard {args.pages_per_shard}: {max(args.clients)} sessions "
                     f"of {args.tokens} tokens need {need}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), `--quick` applied, then `--out` created
    (`args.out` a Path)."""
    return build_parser().parse_args(argv)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pages_per_shard_for(clients: int, tokens: int, shards: int, page_size: int) -> int:
    """Pages per shard that hold every client's session at once (a session of P pages takes at
    most ceil(P / shards) on a shard), plus one a session for rounding and two spare."""
    return clients * (_cdiv(_cdiv(tokens, page_size), shards) + 1) + 2


def resolved_bound(bound: int | str) -> int | None:
    """The --max-queued-tokens a server runs with; None for `default`: the auto bound, which
    the engine moves after every step and the server's stats do not report."""
    return None if bound == DEFAULT else int(bound)


def bound_label(bound: int | str) -> str:
    if bound == DEFAULT:
        return f"auto ({AUTO_QUEUE_S:g} s of prefill)"
    return "none" if int(bound) == 0 else str(int(bound))


# -- the servers ---------------------------------------------------------------------------
def _server(args: argparse.Namespace, bound: int | str, pages: int,
            cache_dir: str) -> ServerProcess:
    """`cp-runtime serve` with this bound, on a free port, compiling into `cache_dir`."""
    return ServerProcess(_serve_flags(args, bound, pages), startup_s=STARTUP_S, env={
        "JAX_COMPILATION_CACHE_DIR": cache_dir,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})


def _serve_flags(args: argparse.Namespace, bound: int | str, pages: int) -> list[str]:
    flags = ["--model", args.model, "--shards", str(args.shards),
             "--kv-cache-dtype", args.kv_cache_dtype, "--page-size", str(args.page_size),
             "--pages-per-shard", str(pages), "--chunk-size", str(args.chunk_size),
             "--max-connections", str(max(args.clients) + 8), "--log-summary-s", "0"]
    return flags if bound == DEFAULT else [*flags, "--max-queued-tokens", str(bound)]


# -- the clients ---------------------------------------------------------------------------
@dataclasses.dataclass
class Client:
    """One client of a run; times in seconds from the moment every client started."""

    index: int
    outcome: str = ""                 # completed, refused, timed_out or failed
    session: str | None = None
    sent_s: float | None = None       # the extend was sent
    end_s: float | None = None        # its done or error came back
    error: str | None = None

    @property
    def refusal_ms(self) -> float | None:
        if self.outcome != "refused" or self.sent_s is None:
            return None
        return 1000 * (self.end_s - self.sent_s)


async def _client(address: str, doc: np.ndarray, t0: float, deadline_s: float, rec: Client,
                  bar) -> None:
    from cp_runtime import AsyncClient, OverloadedError, ServerError

    client = AsyncClient(address)
    try:
        async with asyncio.timeout(deadline_s - (time.perf_counter() - t0)):
            await client.connect()
            session = await client.create_session()
            rec.session = session.id
            rec.sent_s = time.perf_counter() - t0
            await session.extend(doc)
        rec.outcome = "completed"
    except OverloadedError:
        rec.outcome = "refused"
    except TimeoutError:
        rec.outcome = "timed_out"
    except (ServerError, ConnectionError, OSError) as e:
        rec.outcome, rec.error = "failed", f"{type(e).__name__}: {e}"
    if rec.outcome != "timed_out":
        rec.end_s = time.perf_counter() - t0
    await client.close()                  # a timed-out client goes away: its connection ends
    bar.update(1)


async def _stats(address: str) -> dict:
    from cp_runtime import AsyncClient

    async with AsyncClient(address) as client:
        return await client.stats()


async def _clear(address: str, sessions: list[str]) -> None:
    """Close the run's sessions (ending any upload still running) and wait for an idle
    engine."""
    from cp_runtime import AsyncClient, NotFoundError

    async def close(client, sid):
        try:
            await client.session(sid).close()
        except NotFoundError:
            pass

    async with AsyncClient(address) as client:
        await asyncio.gather(*(close(client, sid) for sid in sessions))
        while (await client.stats())["requests"]:
            await asyncio.sleep(0.05)


async def _warm(address: str, tokens: int, vocab: int, shards: int) -> None:
    """An upload of `tokens` tokens, and with 2+ shards a second one beside it (its session
    starts on another shard): together they compile the fill step for every page-table width a
    run's sessions use."""
    from cp_runtime import AsyncClient

    rng = np.random.default_rng(12345)
    async with AsyncClient(address) as client:
        sessions = []
        for _ in range(2 if shards > 1 else 1):
            sessions.append(await client.create_session())
            await sessions[-1].extend(rng.integers(0, vocab, tokens, dtype=np.int32))
        for s in sessions:
            await s.close()


async def _hello(address: str) -> dict:
    from cp_runtime import AsyncClient

    async with AsyncClient(address) as client:
        return client.server


async def _run(address: str, clients: int, tokens: int, deadline_s: float, vocab: int,
               seed: int, bar) -> dict:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, tokens, dtype=np.int32) for _ in range(clients)]
    records = [Client(i) for i in range(clients)]
    before = await _stats(address)
    t0 = time.perf_counter()
    await asyncio.gather(*(_client(address, docs[i], t0, deadline_s, records[i], bar)
                           for i in range(clients)))
    wall_s = time.perf_counter() - t0
    after = await _stats(address)
    await _clear(address, [r.session for r in records if r.session])
    return {"records": records, "wall_s": wall_s, "stats_before": before,
            "stats_after": after}


# -- figures -------------------------------------------------------------------------------
def _median(xs) -> float | None:
    return float(np.median(xs)) if len(xs) else None


def summarize(records: list[Client], wall_s: float, before: dict, after: dict) -> dict:
    """Counts of each outcome, refusal latency and completion time (median and max), and the
    prefill tokens/s the server ran over the run's `wall_s` (its `stats` before and after)."""
    count = {k: sum(r.outcome == k for r in records)
             for k in ("completed", "refused", "timed_out", "failed")}
    refusals = [r.refusal_ms for r in records if r.refusal_ms is not None]
    done = [r.end_s for r in records if r.outcome == "completed"]
    prefilled = (after.get("prefill_tokens_total", 0) or 0) - (
        before.get("prefill_tokens_total", 0) or 0)
    return {**count,
            "refusal_ms_p50": _median(refusals), "refusal_ms_max": max(refusals, default=None),
            "completion_s_p50": _median(done), "completion_s_max": max(done, default=None),
            "prefill_tokens": int(prefilled), "server_tok_per_s": prefilled / wall_s}


COLUMNS = ["bound", "clients", "completed", "refused", "timed out", "refusal ms p50",
           "completion s p50", "server tok/s", "bound at start"]


def _row(label: str, clients: int, s: dict, at_start: str) -> dict:
    return {"bound": label, "clients": clients, "completed": s["completed"],
            "refused": s["refused"], "timed out": s["timed_out"],
            "refusal ms p50": s["refusal_ms_p50"], "completion s p50": s["completion_s_p50"],
            "server tok/s": s["server_tok_per_s"], "bound at start": at_start}


AT_START_NOTE = ("bound at start: the bound the server reported (stats' max_queued_tokens) "
                 "when the clients started; the auto bound moves after every step")


def _at_start(reported: int) -> str:
    """The table's `bound at start`: the server's bound then (blank: none)."""
    return str(reported) if reported else ""


def _markdown(title: str, rows: list[dict], info: dict, command: str) -> str:
    from cp_runtime.benchmarks._shared.markdown import markdown_table

    return "\n".join([f"# {title}", "", f"`{command}`", "", markdown_table(rows, COLUMNS), "",
                      AT_START_NOTE, "", markdown_table([info]), ""])


# -- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    pages = args.pages_per_shard or pages_per_shard_for(max(args.clients), args.tokens,
                                                        args.shards, args.page_size)
    rows, runs, servers = [], [], []
    with contextlib.ExitStack() as stack:
        cache_dir = args.compilation_cache_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="overload-xla-"))
        for bound in args.bounds:
            label = bound_label(bound)
            t = time.perf_counter()
            server = _server(args, bound, pages, cache_dir)
            started = {"bound": bound, "max_queued_tokens": resolved_bound(bound),
                       "command": server.command, "startup_s": time.perf_counter() - t}
            servers.append(started)
            try:
                hello = asyncio.run(_hello(server.address))
                vocab = hello["vocab_size"]
                t = time.perf_counter()
                asyncio.run(_warm(server.address, args.tokens, vocab, args.shards))
                started["warmup_s"] = time.perf_counter() - t
                for n in args.clients:
                    with tqdm(total=n, unit="client", desc=f"bound {label}, {n} clients",
                              disable=args.no_progress) as bar:
                        run = asyncio.run(_run(server.address, n, args.tokens, args.deadline_s,
                                               vocab, args.seed, bar))
                    s = summarize(run["records"], run["wall_s"], run["stats_before"],
                                  run["stats_after"])
                    at_start = run["stats_before"]["max_queued_tokens"]
                    rows.append(_row(label, n, s, _at_start(at_start)))
                    runs.append({"bound": bound, "max_queued_tokens": started["max_queued_tokens"],
                                 "bound_at_start": at_start,
                                 "clients": n, **s, "wall_s": run["wall_s"],
                                 "stats_before": run["stats_before"],
                                 "stats_after": run["stats_after"],
                                 "records": [{**dataclasses.asdict(r), "refusal_ms": r.refusal_ms}
                                             for r in run["records"]]})
                    failed = [r for r in run["records"] if r.outcome == "failed"]
                    if failed:
                        print(f"warning: bound {label}, {n} clients: {len(failed)} failed, "
                              f"e.g. {failed[0].error}")
            finally:
                server.stop()
    info = machine()
    title = (f"overload: {args.tokens} tokens a client, {args.deadline_s:g} s deadlines; "
             f"{hello['model']}, S={args.shards}, page {args.page_size}, chunk "
             f"{args.chunk_size}, {pages} pages/shard; {info['cpu_count']} cores")
    print_table(rows, COLUMNS, title=title)
    if DEFAULT in args.bounds:
        print(AT_START_NOTE)
    command = " ".join(["cp-runtime bench overload", *(sys.argv[1:] if argv is None else argv)])
    payload = {"args": vars(args), "command": command, "servers": servers, "hello": hello,
               "rows": rows, "runs": runs}
    path = write_json(args.out / "overload.json", payload)
    md = args.out / "overload.md"
    md.write_text(_markdown(title, rows, info, command))
    took = ", ".join(f"{bound_label(s['bound'])}: start-up "
                     f"{s['startup_s']:.0f} s, warm-up {s['warmup_s']:.0f} s" for s in servers)
    print(f"\nwrote {path} and {md} (servers {took})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
