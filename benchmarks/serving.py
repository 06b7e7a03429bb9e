"""Serving under load: concurrent client sessions over the real socket against a real server,
a mix of long uploads and short chats, timed on the client.

    cp-runtime bench serving                             # starts a server; writes
                                                         # out/serving.json and out/serving.png
    cp-runtime bench serving --quick                     # a small mix, about 1.5 min here
    cp-runtime bench serving --address 127.0.0.1:7777    # measure a server already running

The benchmark starts `cp-runtime serve` as a subprocess (`--port 0`, its `listening on` line
read back) with `--model`, `--shards`, `--kv-cache-dtype`, `--page-size`, `--chunk-size`,
`--max-batch` and `--pages-per-shard` (sized from the workload unless given), or attaches to a
running one with `--address` (the server flags are then unused). Each simulated user is one
`AsyncClient` connection, all in one asyncio loop:

    upload   create a session, extend it with `--upload-tokens` random tokens (the client's
             chunked upload), close it
    chat     `--chat-turns` turns of: extend with `--chat-prompt` tokens, generate
             `--chat-tokens` tokens (greedy, streamed), wait `--think-ms`; chats start
             `--chat-stagger-ms` apart, so they run while the uploads prefill

Every timestamp is the client's (`time.perf_counter` when an event reaches the user's code):
time to first token (TTFT) from sending a generate request to its first token event,
inter-token latency (ITL) between consecutive token events of one generation, each upload's
time and prefill tokens/s, and the aggregate tokens/s: prefill + decode tokens the clients sent
and received, over the wall time of the measured run. Percentiles are numpy's (linear).

Host share of a step: `stats` is read before and after the measured run and the engine's
`host_s_total` (planning a step and applying its results), `device_s_total` (the executor's
run, transfers included) and `steps_total` are diffed, with the server's `server_cpu_s` (CPU
time of its event-loop thread: framing, routing, replies). host share = (engine host + server
CPU) / (engine host + server CPU + device).

A warm-up pass first runs the same mix (with at most one upload), unmeasured, on sessions it
then closes, so most step shapes the run will use are compiled (XLA compiles a program per
shape: seconds each, which would otherwise be most of p99); `--no-warmup` skips it.

The client, the server and its 16 virtual devices share this machine's cores, so on a CPU the
figures are the whole system's, not the device's. Extends queue in arrival order, so a chat
turn's prompt sent while an upload prefills waits for the whole upload (`chat prompt ms`).

Measured with the defaults on the development machine (2 shared x86 cores, 16 virtual devices,
load average about 12 from other work): 5.0 min in all (server start 8 s, warm-up 234 s, the
measured run 53 s); 377 tokens/s; TTFT p50 1.3 s, p99 2.5 s (12 samples); ITL p50 54 ms, p99
3.7 s (372 samples: a decode step that carries a 1024-token prefill chunk takes seconds); chat
prompt p99 31 s; uploads 539 and 272 tokens/s; host share 0.2% (0.6 ms engine host + 0.4 ms
server CPU against 559 ms device per step).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import time

import numpy as np

from cp_runtime.benchmarks.common import ServeProcess, machine, print_table, write_json
from cp_runtime.cli_args import (HelpFormatter, add_chunk_size, add_kv_cache_dtype, add_model,
                                 add_no_progress, add_out, add_page_size, add_pages_per_shard,
                                 add_shards, check_out_dir, check_page_size,
                                 check_page_size_for_model, finite_nonnegative_float, length,
                                 positive_int)

__all__ = ["Workload", "build_parser", "parse_args", "main", "pages_per_shard_for"]

TOKEN_ENV = "CP_RUNTIME_TOKEN"
STARTUP_S = 300.0
# Workload flags: (default, --quick) values; an explicit flag wins over both.
WORKLOAD = {
    "uploads": (2, 1),                 # (default, --quick)
    "upload_tokens": (8 << 10, 2 << 10),
    "chats": (6, 3),
    "chat_prompt": (256, 128),
    "chat_tokens": (32, 16),
    "chat_turns": (2, 1),
    "think_ms": (200.0, 0.0),
    "chat_stagger_ms": (250.0, 100.0),
    "upload_delay_ms": (1000.0, 500.0),
}


def _count(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return n


def _address(text: str) -> str:
    """argparse type: HOST:PORT."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return text


def _unset(name: str) -> str:
    default, quick = WORKLOAD[name]
    return f"unset: {default:g}; --quick: {quick:g}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cp-runtime bench serving", formatter_class=HelpFormatter,
        description="Concurrent clients (long uploads and short chats) against a real server "
                    "over its socket: TTFT and inter-token latency percentiles, upload prefill "
                    "rates, aggregate tokens/s, and the host's share of each step.")
    p.add_argument("--quick", action="store_true",
                   help="a small mix for about a minute on a CPU (explicit workload flags win)")
    p.add_argument("--uploads", type=_count, default=None,
                   help=f"concurrent long uploads ({_unset('uploads')})")
    p.add_argument("--upload-tokens", type=length, default=None,
                   help=f"tokens per upload, k/m suffixes allowed ({_unset('upload_tokens')})")
    p.add_argument("--chats", type=_count, default=None,
                   help=f"concurrent chat sessions ({_unset('chats')})")
    p.add_argument("--chat-prompt", type=length, default=None,
                   help=f"tokens each chat turn sends ({_unset('chat_prompt')})")
    p.add_argument("--chat-tokens", type=length, default=None,
                   help=f"tokens each chat turn generates ({_unset('chat_tokens')})")
    p.add_argument("--chat-turns", type=positive_int, default=None,
                   help=f"turns per chat ({_unset('chat_turns')})")
    p.add_argument("--think-ms", type=finite_nonnegative_float, default=None,
                   help=f"pause between a chat's turns ({_unset('think_ms')})")
    p.add_argument("--chat-stagger-ms", type=finite_nonnegative_float, default=None,
                   help=f"delay between chat starts ({_unset('chat_stagger_ms')})")
    p.add_argument("--upload-delay-ms", type=finite_nonnegative_float, default=None,
                   help=f"delay before the uploads start, so the chats' first generations "
                        f"run while they prefill ({_unset('upload_delay_ms')})")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the unmeasured warm-up pass (step compiles then land in the "
                        "figures)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens")
    p.add_argument("--address", type=_address, metavar="HOST:PORT", default=None,
                   help="measure a running server instead of starting one (the server flags "
                        "below are then unused)")
    p.add_argument("--auth-token", default=None,
                   help=f"token for --address (when unset: ${TOKEN_ENV}, if set)")
    add_model(p, "tiny")
    add_shards(p, 16)
    add_kv_cache_dtype(p, "fp8_e4m3")
    add_page_size(p, 16)
    add_pages_per_shard(p, None)
    add_chunk_size(p, 1024)
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="generations decoded together in one step")
    add_out(p, "out")
    add_no_progress(p)
    return p


@dataclasses.dataclass(frozen=True)
class Workload:
    uploads: int
    upload_tokens: int
    chats: int
    chat_prompt: int
    chat_tokens: int
    chat_turns: int
    think_ms: float
    chat_stagger_ms: float
    upload_delay_ms: float

    @property
    def chat_length(self) -> int:
        return self.chat_turns * (self.chat_prompt + self.chat_tokens)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), `--quick` applied (`args.workload`), then
    `--out` created."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values = {name: getattr(args, name) for name in WORKLOAD}
    args.workload = Workload(**{name: WORKLOAD[name][1 if args.quick else 0] if v is None else v
                                for name, v in values.items()})
    if args.workload.uploads + args.workload.chats == 0:
        parser.error("--uploads 0 --chats 0: nothing to run")
    if args.address is None:
        check_page_size(parser, args.page_size)
        check_page_size_for_model(parser, args.model, args.page_size)
        if args.chunk_size % args.page_size:
            parser.error(f"--chunk-size {args.chunk_size}: not a multiple of --page-size "
                         f"{args.page_size}")
        need = pages_per_shard_for(args.workload, args.shards, args.page_size)
        if args.pages_per_shard is not None and args.pages_per_shard < need:
            parser.error(f"--pages-per-shard {args.pages_per_shard}: the workload needs "
                         f"{need}")
    args.auth_token = args.auth_token or os.environ.get(TOKEN_ENV) or None
    args.out = check_out_dir(parser, args.out)
    return args


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pages_per_shard_for(w: Workload, shards: int, page_size: int) -> int:
    """Pages per shard that hold every session of the workload at once: a session of P pages
    takes at most ceil(P / shards) on any shard; one more each for a generation's reservation
    (its last token) and page rounding."""
    lengths = [w.upload_tokens] * w.uploads + [w.chat_length] * w.chats
    return sum(_cdiv(_cdiv(n + 1, page_size), shards) + 1 for n in lengths)


# -- the server ---------------------------------------------------------------------------
def _server_process(args: argparse.Namespace, pages_per_shard: int) -> ServeProcess:
    """`cp-runtime serve` for this workload, on a free port."""
    return ServeProcess(["--model", args.model, "--shards", str(args.shards),
                         "--kv-cache-dtype", args.kv_cache_dtype,
                         "--page-size", str(args.page_size),
                         "--pages-per-shard", str(pages_per_shard),
                         "--chunk-size", str(args.chunk_size),
                         "--max-batch", str(args.max_batch)], timeout_s=STARTUP_S)


# -- the clients --------------------------------------------------------------------------
@dataclasses.dataclass
class _Record:
    """One simulated user's client-side timestamps (seconds from the run's start)."""

    kind: str                                        # "upload" or "chat"
    index: int
    start: float = 0.0
    end: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    upload_s: float = 0.0                            # uploads: the extend's wall time
    prompt: list = dataclasses.field(default_factory=list)     # chats: each turn's extend
    ttft: list = dataclasses.field(default_factory=list)
    itl: list = dataclasses.field(default_factory=list)
    token_times: list = dataclasses.field(default_factory=list)
    progress: list = dataclasses.field(default_factory=list)   # (t, tokens done)


async def _upload(address, token, w: Workload, vocab: int, rng, t0: float, index: int,
                  bar) -> _Record:
    from cp_runtime.serving.client import AsyncClient

    rec = _Record("upload", index)
    tokens = rng.integers(0, vocab, w.upload_tokens, dtype=np.int32)
    await asyncio.sleep(w.upload_delay_ms / 1000)
    async with AsyncClient(address, token=token) as client:
        rec.start = time.perf_counter() - t0
        session = await client.create_session()
        last = [0]

        def progress(done: int, total: int) -> None:
            rec.progress.append((time.perf_counter() - t0, done))
            bar.update(done - last[0])
            last[0] = done

        begin = time.perf_counter()
        await session.extend(tokens, progress=progress)
        rec.upload_s = time.perf_counter() - begin
        rec.prefill_tokens = w.upload_tokens
        rec.end = time.perf_counter() - t0
        await session.close()
    return rec


async def _chat(address, token, w: Workload, vocab: int, rng, t0: float, index: int,
                bar) -> _Record:
    from cp_runtime.serving.client import AsyncClient

    rec = _Record("chat", index)
    prompts = [rng.integers(0, vocab, w.chat_prompt, dtype=np.int32)
               for _ in range(w.chat_turns)]
    await asyncio.sleep(index * w.chat_stagger_ms / 1000)
    async with AsyncClient(address, token=token) as client:
        rec.start = time.perf_counter() - t0
        session = await client.create_session()
        for turn, prompt in enumerate(prompts):
            if turn:
                await asyncio.sleep(w.think_ms / 1000)
            begin = time.perf_counter()
            await session.extend(prompt)
            rec.prompt.append(time.perf_counter() - begin)
            rec.prefill_tokens += len(prompt)
            bar.update(len(prompt))
            sent = time.perf_counter()
            stamps = []
            async for _ in session.stream(max_tokens=w.chat_tokens):
                stamps.append(time.perf_counter())
                bar.update(1)
            rec.ttft.append(stamps[0] - sent)
            rec.itl += np.diff(stamps).tolist()
            rec.token_times += [s - t0 for s in stamps]
            rec.decode_tokens += len(stamps)
        rec.end = time.perf_counter() - t0
        await session.close()
    return rec


async def _run_mix(address, token, w: Workload, vocab: int, seed: int,
                   bar) -> tuple[list[_Record], float]:
    """Every user at once; returns their records and the wall time."""
    rng = np.random.default_rng(seed)
    rngs = rng.spawn(w.uploads + w.chats)
    t0 = time.perf_counter()
    records = await asyncio.gather(
        *(_upload(address, token, w, vocab, rngs[i], t0, i, bar) for i in range(w.uploads)),
        *(_chat(address, token, w, vocab, rngs[w.uploads + i], t0, i, bar)
          for i in range(w.chats)))
    return list(records), time.perf_counter() - t0


async def _stats(address, token) -> dict:
    from cp_runtime.serving.client import AsyncClient

    async with AsyncClient(address, token=token) as client:
        return await client.stats()


async def _hello(address, token) -> dict:
    from cp_runtime.serving.client import AsyncClient

    async with AsyncClient(address, token=token) as client:
        return client.server


# -- figures ------------------------------------------------------------------------------
def _pct(xs, q) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else None


def _diff(before: dict, after: dict, key: str) -> float:
    return float(after.get(key, 0) or 0) - float(before.get(key, 0) or 0)


def summarize(records: list[_Record], wall_s: float, before: dict, after: dict) -> dict:
    ttft = [x for r in records for x in r.ttft]
    itl = [x for r in records for x in r.itl]
    prompt = [x for r in records for x in r.prompt]
    uploads = [r for r in records if r.kind == "upload"]
    prefill = sum(r.prefill_tokens for r in records)
    decode = sum(r.decode_tokens for r in records)
    steps = _diff(before, after, "steps_total")
    host, device = _diff(before, after, "host_s_total"), _diff(before, after, "device_s_total")
    cpu = _diff(before, after, "server_cpu_s")
    per_step = (lambda s: 1000 * s / steps) if steps else (lambda s: None)
    return {
        "wall_s": wall_s,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "tokens_per_s": (prefill + decode) / wall_s,
        "ttft_samples": len(ttft),
        "ttft_p50_ms": _ms(_pct(ttft, 50)), "ttft_p99_ms": _ms(_pct(ttft, 99)),
        "ttft_max_ms": _ms(max(ttft, default=None)),
        "prompt_samples": len(prompt),
        "prompt_p50_ms": _ms(_pct(prompt, 50)), "prompt_p99_ms": _ms(_pct(prompt, 99)),
        "prompt_max_ms": _ms(max(prompt, default=None)),
        "itl_samples": len(itl),
        "itl_p50_ms": _ms(_pct(itl, 50)), "itl_p99_ms": _ms(_pct(itl, 99)),
        "itl_max_ms": _ms(max(itl, default=None)),
        "uploads": [{"index": r.index, "tokens": r.prefill_tokens, "upload_s": r.upload_s,
                     "prefill_tok_per_s": r.prefill_tokens / r.upload_s} for r in uploads],
        "engine": {"steps": int(steps), "host_s": host, "device_s": device,
                   "server_cpu_s": cpu,
                   "prefill_tokens": int(_diff(before, after, "prefill_tokens_total")),
                   "decode_tokens": int(_diff(before, after, "decode_tokens_total")),
                   "host_ms_per_step": per_step(host), "device_ms_per_step": per_step(device),
                   "server_cpu_ms_per_step": per_step(cpu),
                   "host_share": ((host + cpu) / (host + cpu + device)
                                  if host + cpu + device > 0 else None)},
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else 1000 * s


def plot(path: pathlib.Path, records: list[_Record], summary: dict, title: str) -> pathlib.Path:
    """Left: a timeline, one row per user (uploads as bars shaded by progress, chat tokens as
    dots); right: TTFT and ITL distributions (empirical CDFs)."""
    from cp_runtime.benchmarks.plots import _pyplot, _save

    plt = _pyplot()
    fig, (ax, cdf) = plt.subplots(1, 2, figsize=(12, 4.5),
                                  gridspec_kw={"width_ratios": [3, 2]})
    labels = []
    for y, r in enumerate(records):
        labels.append(f"{r.kind} {r.index}")
        if r.kind == "upload":
            ax.barh(y, r.end - r.start, left=r.start, height=0.6, color="tab:orange",
                    alpha=0.35)
            if r.progress:
                ts, done = zip(*r.progress)
                ax.scatter(ts, [y] * len(ts), s=4, color="tab:orange", marker="|")
        else:
            ax.hlines(y, r.start, r.end, color="tab:blue", alpha=0.3, linewidth=1)
            ax.scatter(r.token_times, [y] * len(r.token_times), s=5, color="tab:blue")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start of the run")
    ax.set_title("timeline: uploads (bars, ticks = progress events), chat tokens (dots)",
                 fontsize="small")
    ax.grid(axis="x", alpha=0.3)
    ttft = np.sort([x * 1000 for r in records for x in r.ttft])
    itl = np.sort([x * 1000 for r in records for x in r.itl])
    for name, xs in (("TTFT", ttft), ("ITL", itl)):
        if len(xs):
            cdf.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post",
                     label=f"{name} (n={len(xs)})")
    if len(ttft) or len(itl):
        cdf.set_xscale("log")
        cdf.legend(fontsize="small")
    cdf.set_xlabel("ms (client-side)")
    cdf.set_ylabel("fraction of samples")
    cdf.set_title("latency distributions", fontsize="small")
    cdf.grid(alpha=0.3)
    fig.suptitle(title, fontsize="medium")
    return _save(fig, path)


# -- main ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    w = args.workload
    server = None
    pages = None
    if args.address is None:
        pages = args.pages_per_shard or pages_per_shard_for(w, args.shards, args.page_size)
        started = time.perf_counter()
        server = _server_process(args, pages)
        address = server.address
        startup_s = time.perf_counter() - started
    else:
        address, startup_s = args.address, None
    try:
        hello = asyncio.run(_hello(address, args.auth_token))
        vocab = hello["vocab_size"]
        total = w.uploads * w.upload_tokens + w.chats * w.chat_length
        warmup_s = None
        if not args.no_warmup:
            t = time.perf_counter()
            warm = dataclasses.replace(w, uploads=min(w.uploads, 1))
            with tqdm(total=warm.uploads * warm.upload_tokens + warm.chats * warm.chat_length,
                      unit="tok", unit_scale=True, desc="warm-up",
                      disable=args.no_progress) as bar:
                asyncio.run(_run_mix(address, args.auth_token, warm, vocab, args.seed + 1, bar))
            warmup_s = time.perf_counter() - t
        before = asyncio.run(_stats(address, args.auth_token))
        with tqdm(total=total, unit="tok", unit_scale=True, desc="run",
                  disable=args.no_progress) as bar:
            records, wall_s = asyncio.run(_run_mix(address, args.auth_token, w, vocab,
                                                   args.seed, bar))
        after = asyncio.run(_stats(address, args.auth_token))
    finally:
        if server is not None:
            server.stop()
    summary = summarize(records, wall_s, before, after)
    e = summary["engine"]
    server_desc = (f"{hello['model']}, S={hello['shards']}, {hello['kv_cache_dtype']}, "
                   f"page {hello['page_size']}, {hello['pages_per_shard']} pages/shard")
    rows = [{"measure": "TTFT ms", "n": summary["ttft_samples"], "p50": summary["ttft_p50_ms"],
             "p99": summary["ttft_p99_ms"], "max": summary["ttft_max_ms"]},
            {"measure": "ITL ms", "n": summary["itl_samples"], "p50": summary["itl_p50_ms"],
             "p99": summary["itl_p99_ms"], "max": summary["itl_max_ms"]},
            {"measure": "chat prompt ms", "n": summary["prompt_samples"],
             "p50": summary["prompt_p50_ms"], "p99": summary["prompt_p99_ms"],
             "max": summary["prompt_max_ms"]}]
    rows += [{"measure": f"upload {u['index']} tok/s", "n": u["tokens"],
              "p50": u["prefill_tok_per_s"], "max": u["upload_s"]} for u in summary["uploads"]]
    info = machine()
    print_table(rows, ["measure", "n", "p50", "p99", "max"],
                title=f"serving: {w.uploads} uploads x {w.upload_tokens} tokens, {w.chats} chats "
                      f"x {w.chat_turns} turns x ({w.chat_prompt} prompt + {w.chat_tokens} "
                      f"generated); {server_desc}; {info['cpu_count']} cores "
                      f"(upload rows: n = tokens, p50 = prefill tok/s, max = upload s)")
    print()
    tokens = summary["prefill_tokens"] + summary["decode_tokens"]
    print_table([{"wall_s": wall_s, "tokens": tokens,
                  "tok/s": summary["tokens_per_s"], "steps": e["steps"],
                  "host ms/step": e["host_ms_per_step"],
                  "device ms/step": e["device_ms_per_step"],
                  "server cpu ms/step": e["server_cpu_ms_per_step"],
                  "host share": e["host_share"]}],
                ["wall_s", "tokens", "tok/s", "steps", "host ms/step", "device ms/step",
                 "server cpu ms/step", "host share"])
    payload = {"args": {k: v for k, v in vars(args).items() if k != "auth_token"},
               "workload": dataclasses.asdict(w), "server": {
                   "address": address if server is None else None,
                   "command": server.command if server else None, "startup_s": startup_s,
                   "hello": hello},
               "warmup_s": warmup_s, **summary,
               "stats_before": before, "stats_after": after,
               "records": [dataclasses.asdict(r) for r in records]}
    path = write_json(args.out / "serving.json", payload)
    png = plot(args.out / "serving.png", records, summary,
               f"serving: {w.uploads} uploads, {w.chats} chats; {server_desc}")
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
