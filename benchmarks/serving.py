"""Serving under load: concurrent client sessions over the real socket against a real server,
a mix of long uploads and short chats, timed on the client; over the session protocol, the
OpenAI-compatible HTTP API, or both in turn.

    cp-runtime bench serving                             # starts a server; writes
                                                         # out/serving.json and out/serving.png
    cp-runtime bench serving --quick                     # a small mix, about 1.5 min here
    cp-runtime bench serving --api http                  # the chats over HTTP instead
    cp-runtime bench serving --api both                  # session protocol, then HTTP, on the
                                                         # same server; one table side by side
    cp-runtime bench serving --address 127.0.0.1:7777    # measure a server already running
                                                         # (with --api http or both, also
                                                         # --http-address HOST:PORT)

The benchmark starts `cp-runtime serve` as a subprocess (`--port 0`, its `listening on` line
read back; with `--api http` or `both` also `--http-port 0`, its `http listening on` line read
back) with `--model`, `--shards`, `--kv-cache-dtype`, `--page-size`, `--chunk-size`,
`--max-batch` and `--pages-per-shard` (sized from the workload unless given), or attaches to a
running one with `--address` (the server flags are then unused). Each simulated user is one
client connection, all in one asyncio loop:

    upload   create a session, extend it with `--upload-tokens` random tokens (the client's
             chunked upload), close it; always over the session protocol (an `AsyncClient`)
    chat     `--chat-turns` turns of: send `--chat-prompt` tokens, generate `--chat-tokens`
             tokens (greedy, streamed), wait `--think-ms`; chats start `--chat-stagger-ms`
             apart, so they run while the uploads prefill

`--api` says how a chat talks to the server:

    session  (the default) an `AsyncClient` connection: each turn an `extend` of the prompt,
             then a streamed `generate`
    http     one HTTP/1.1 keep-alive connection (httpx): each turn one streamed
             `POST /v1/completions` of the prompt as token ids (`max_tokens`, `temperature: 0`,
             `stream`, `return_token_ids`, `ignore_eos`); the first turn asks `session: true`
             and later turns send the session id it returned, so a turn appends its prompt to
             the chat's session rather than resending the conversation. HTTP has no request
             that closes a kept session, so the chat closes it over the session protocol after
             its last turn
    both     the session protocol's warm-up and run, then HTTP's, against one server process

Uploads stay on the session protocol under every `--api`: the comparison is of the chats'
latencies, and keeping the uploads' requests the same (the client's chunked extends) keeps the
load they put on the engine the same. Both APIs send the same random prompts (one seed).

Every timestamp is the client's (`time.perf_counter` when an event reaches the user's code: a
decoded frame, or a parsed server-sent event). Time to first token (TTFT): over the session
protocol from sending `generate` (after the turn's `extend` returned) to its first token
event; over HTTP from sending the request to the first event whose `token_ids` are not empty,
so HTTP's TTFT includes prefilling the turn's prompt. `turn to first token` is the figure
alike on both: from the start of the turn (the `extend` sent, or the request sent) to the first
token. Inter-token latency (ITL) is between consecutive tokens of one generation; also each
upload's time and prefill tokens/s, and the aggregate tokens/s: prefill + decode tokens the
clients sent and received, over the wall time of the measured run. Percentiles are numpy's
(linear).

Server figures: `stats` (session protocol) is read before and after each measured run and the
engine's `host_s_total` (wall time of planning each step and applying its results, on the
device thread), `device_s_total` (the executor's run, transfers included), `steps_total` and
`decode_tokens_total` are diffed, with the server's `server_cpu_s` (CPU time of its event-loop
thread, which runs both front doors: framing, routing and replies, and uvicorn, Starlette and
the JSON of every HTTP request and event). host share = (engine host + server CPU) / (engine
host + server CPU + device). Host CPU per generated token = (engine host + server CPU) / decode
tokens: every step's host work (prefill chunks included) and every request's serving (the
uploads' included) over the tokens generated, so it compares the APIs under the same load but
is not a decode-only cost. The client's CPU (this process) is not counted.

A warm-up pass first runs the same mix (with at most one upload) over the same API, unmeasured,
on sessions it then closes, so most step shapes the run will use are compiled (XLA compiles a
program per shape: seconds each, which would otherwise be most of p99); with `--api both` each
API has its warm-up before its run (HTTP's then compiles little, but the HTTP stack's first
request is slow: here, one 32-token prompt at a time on an otherwise idle tiny 4-shard server
whose steps were compiled, the first streamed completion took 174 ms to its first token, the
rest of its 8 tokens arriving at once, against 60-96 ms for the next three). `--no-warmup`
skips them.

serving.json holds the first run's figures at the top level (the session protocol's unless
`--api http`), under the same keys as before `--api` existed; `runs` holds every run's by API
(`session`, `http`) and, with `--api both`, `comparison` the side-by-side table's rows.
serving.png has a timeline per run and every run's latency distributions.

The client, the server and its 16 virtual devices share this machine's cores, so on a CPU the
figures are the whole system's, not the device's. Extends queue in arrival order, so a chat
turn's prompt sent while an upload prefills waits for the whole upload (`chat prompt ms`).

Measured with the defaults on the development machine (2 shared x86 cores, 16 virtual devices,
load average about 12 from other work): 5.0 min in all (server start 8 s, warm-up 234 s, the
measured run 53 s); 377 tokens/s; TTFT p50 1.3 s, p99 2.5 s (12 samples); ITL p50 54 ms, p99
3.7 s (372 samples: a decode step that carries a 1024-token prefill chunk takes seconds); chat
prompt p99 31 s; uploads 539 and 272 tokens/s; host share 0.2% (0.6 ms engine host + 0.4 ms
server CPU against 559 ms device per step).

`--api both --quick` on the same machine with nothing else running: 45 s in all. Session
protocol vs HTTP, 3 TTFT and 45 ITL samples each, so a rough comparison: TTFT p50 760 ms vs
1,374 ms (HTTP's includes the turn's 128-token prompt); turn to first token p50 1,146 vs
1,374 ms, p99 1,545 vs 1,720 ms; ITL p50 18.9 vs 16.7 ms, p99 414 vs 417 ms; host CPU 0.48 vs
0.59 ms per generated token (server event-loop CPU 0.36 vs 0.49 ms, engine host 0.12 vs
0.10 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib
import json
import os
import pathlib
import time
from typing import AsyncIterator

import numpy as np

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.cli.args import finite_nonnegative_float, length, positive_int
from cp_runtime.serving.process import ServerProcess

__all__ = ["Workload", "build_parser", "parse_args", "main", "pages_per_shard_for"]

TOKEN_ENV = "CP_RUNTIME_TOKEN"
STARTUP_S = 300.0
# --api: the APIs measured, in order.
APIS = {"session": ("session",), "http": ("http",), "both": ("session", "http")}
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


def _httpx():
    """The httpx module, or None when it is not installed. Some installs (the openai SDK's
    dependency among them) ship it as `httpx2`, the same API under another name."""
    for name in ("httpx", "httpx2"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser(
        "serving", "Concurrent clients (long uploads and short chats) against a real server "
                   "over its socket: TTFT and inter-token latency percentiles, upload prefill "
                   "rates, aggregate tokens/s, and the host's share of each step; the chats "
                   "over the session protocol, the OpenAI-compatible HTTP API, or both.",
        quick="a small mix for about a minute on a CPU (explicit workload flags win)",
        check=_check)
    p.add_argument("--api", choices=list(APIS), default="session",
                   help="how the chats talk to the server: the session protocol, streamed "
                        "/v1/completions over HTTP (uploads stay on the session protocol), or "
                        "both in turn against the same server, compared in one table")
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
    p.add_argument("--address", type=_address, metavar="HOST:PORT", default=None,
                   help="measure a running server instead of starting one (the server flags "
                        "below are then unused)")
    p.add_argument("--http-address", type=_address, metavar="HOST:PORT", default=None,
                   help="with --address and --api http or both: the running server's HTTP "
                        "address (its --http-port)")
    p.add_argument("--auth-token", default=None,
                   help=f"token for --address and --http-address (when unset: ${TOKEN_ENV}, "
                        f"if set)")
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="generations decoded together in one step")
    p.add_shared(model="tiny", shards=16, kv_cache_dtype="fp8_e4m3", page_size=16,
                 pages_per_shard=None, chunk_size=1024, seed="the random prompt tokens",
                 out="out", progress=True, devices=False)
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


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    """`--quick` applied to the workload (`args.workload`), `--api` expanded (`args.apis`, the
    APIs in the order measured), and a server to start sized for the workload."""
    values = {name: getattr(args, name) for name in WORKLOAD}
    args.workload = Workload(**{name: WORKLOAD[name][1 if args.quick else 0] if v is None else v
                                for name, v in values.items()})
    if args.workload.uploads + args.workload.chats == 0:
        parser.error("--uploads 0 --chats 0: nothing to run")
    args.apis = APIS[args.api]
    if "http" in args.apis:
        _check_http(parser, args)
    if args.address is None:
        if args.chunk_size % args.page_size:
            parser.error(f"--chunk-size {args.chunk_size}: not a multiple of --page-size "
                         f"{args.page_size}")
        need = pages_per_shard_for(args.workload, args.shards, args.page_size)
        if args.pages_per_shard is not None and args.pages_per_shard < need:
            parser.error(f"--pages-per-shard {args.pages_per_shard}: the workload needs "
                         f"{need}")
    args.auth_token = args.auth_token or os.environ.get(TOKEN_ENV) or None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), `--quick` applied (`args.workload`), `--api`
    expanded (`args.apis`, the APIs in the order measured), then `--out` created (`args.out`
    a Path)."""
    return build_parser().parse_args(argv)


def _check_http(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What `--api http` or `both` needs: an HTTP client, and an HTTP address for --address."""
    if _httpx() is None:
        parser.error(f"--api {args.api}: needs httpx, which is not installed: pip install httpx")
    if args.address is not None and args.http_address is None:
        parser.error(f"--api {args.api} with --address: give the server's HTTP address too "
                     f"(--http-address HOST:PORT)")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pages_per_shard_for(w: Workload, shards: int, page_size: int) -> int:
    """Pages per shard that hold every session of the workload at once: a session of P pages
    takes at most ceil(P / shards) on any shard; one more each for a generation's reservation
    (its last token) and page rounding."""
    lengths = [w.upload_tokens] * w.uploads + [w.chat_length] * w.chats
    return sum(_cdiv(_cdiv(n + 1, page_size), shards) + 1 for n in lengths)


# -- the server ---------------------------------------------------------------------------
def _server_process(args: argparse.Namespace, pages_per_shard: int) -> ServerProcess:
    """`cp-runtime serve` for this workload, on a free port (and a free HTTP port when an API
    measured is HTTP)."""
    http = ["--http-port", "0"] if "http" in args.apis else []
    return ServerProcess(["--model", args.model, "--shards", str(args.shards),
                          "--kv-cache-dtype", args.kv_cache_dtype,
                          "--page-size", str(args.page_size),
                          "--pages-per-shard", str(pages_per_shard),
                          "--chunk-size", str(args.chunk_size),
                          "--max-batch", str(args.max_batch), *http], startup_s=STARTUP_S)


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
    turn: list = dataclasses.field(default_factory=list)       # turn start to first token
    itl: list = dataclasses.field(default_factory=list)
    token_times: list = dataclasses.field(default_factory=list)
    progress: list = dataclasses.field(default_factory=list)   # (t, tokens done)


def _chat_prompts(w: Workload, vocab: int, rng) -> list[np.ndarray]:
    """Each turn's prompt, int32[chat_prompt] random ids (the same for every API)."""
    return [rng.integers(0, vocab, w.chat_prompt, dtype=np.int32) for _ in range(w.chat_turns)]


def _record_turn(rec: _Record, prompt_tokens: int, turn_start: float, sent: float,
                 stamps: list[float], t0: float) -> None:
    """Add one chat turn's timestamps (perf_counter seconds) to `rec`."""
    rec.prefill_tokens += prompt_tokens
    rec.ttft.append(stamps[0] - sent)
    rec.turn.append(stamps[0] - turn_start)
    rec.itl += np.diff(stamps).tolist()
    rec.token_times += [s - t0 for s in stamps]
    rec.decode_tokens += len(stamps)


async def _upload(address, token, w: Workload, vocab: int, rng, t0: float, index: int,
                  bar) -> _Record:
    from cp_runtime.serving.session.client import AsyncClient

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
    """One chat over the session protocol: each turn an extend, then a streamed generate."""
    from cp_runtime.serving.session.client import AsyncClient

    rec = _Record("chat", index)
    prompts = _chat_prompts(w, vocab, rng)
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
            bar.update(len(prompt))
            sent = time.perf_counter()
            stamps = []
            async for _ in session.stream(max_tokens=w.chat_tokens):
                stamps.append(time.perf_counter())
                bar.update(1)
            _record_turn(rec, len(prompt), begin, sent, stamps, t0)
        rec.end = time.perf_counter() - t0
        await session.close()
    return rec


async def _sse_chunks(client, body: dict) -> AsyncIterator[dict]:
    """The chunks of one streamed `POST /v1/completions`: each `data: {...}` event parsed, up
    to `data: [DONE]`. An error status raises RuntimeError with the server's answer."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"POST /v1/completions: HTTP {r.status_code}: {r.text[:1000]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue                          # the blank line that ends each event
            if line == "data: [DONE]":
                return
            yield json.loads(line[len("data: "):])


def _chunk_tokens(chunk: dict) -> list[int]:
    """The token ids one streamed chunk carries ([] for the closing one, with no token)."""
    choices = chunk.get("choices") or [{}]
    return choices[0].get("token_ids") or []


async def _chat_http(http: str, address, token, w: Workload, vocab: int, rng, t0: float,
                     index: int, bar) -> _Record:
    """One chat over HTTP: each turn one streamed /v1/completions of the turn's prompt, the
    first keeping its session (`session: true`), later ones continuing it by id; the session is
    closed over the session protocol at the end (HTTP has no request that closes it)."""
    from cp_runtime.serving.session.client import AsyncClient

    httpx = _httpx()
    rec = _Record("chat", index)
    prompts = _chat_prompts(w, vocab, rng)
    await asyncio.sleep(index * w.chat_stagger_ms / 1000)
    session: bool | str = True
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # No timeout: a turn may wait tens of seconds behind an upload's prefill. No proxies from
    # the environment: the server is local.
    async with httpx.AsyncClient(base_url=f"http://{http}", headers=headers, timeout=None,
                                 trust_env=False) as client:
        rec.start = time.perf_counter() - t0
        for turn, prompt in enumerate(prompts):
            if turn:
                await asyncio.sleep(w.think_ms / 1000)
            # ignore_eos: every turn generates --chat-tokens, as over the session protocol
            # (a model with a tokenizer stops at its EOS token on HTTP otherwise).
            body = {"prompt": prompt.tolist(), "max_tokens": w.chat_tokens, "temperature": 0,
                    "stream": True, "return_token_ids": True, "session": session,
                    "ignore_eos": True}
            sent, stamps = time.perf_counter(), []
            async for chunk in _sse_chunks(client, body):
                now = time.perf_counter()
                session = chunk.get("session", session)
                ids = _chunk_tokens(chunk)
                if ids and not stamps:
                    bar.update(len(prompt))       # prefilled once the first token is out
                stamps += [now] * len(ids)
                bar.update(len(ids))
            if not isinstance(session, str):
                raise RuntimeError("the server's /v1/completions returned no session id "
                                   "(needs cp-runtime's `session` extension)")
            _record_turn(rec, len(prompt), sent, sent, stamps, t0)
        rec.end = time.perf_counter() - t0
    async with AsyncClient(address, token=token) as closer:
        await closer.session(session).close()
    return rec


async def _run_mix(address, token, w: Workload, vocab: int, seed: int, bar,
                   chat=_chat) -> tuple[list[_Record], float]:
    """Every user at once, the chats run by `chat` (`_chat`, or `_chat_http` bound to an HTTP
    address); returns their records and the wall time."""
    rng = np.random.default_rng(seed)
    rngs = rng.spawn(w.uploads + w.chats)
    t0 = time.perf_counter()
    records = await asyncio.gather(
        *(_upload(address, token, w, vocab, rngs[i], t0, i, bar) for i in range(w.uploads)),
        *(chat(address, token, w, vocab, rngs[w.uploads + i], t0, i, bar)
          for i in range(w.chats)))
    return list(records), time.perf_counter() - t0


async def _stats(address, token) -> dict:
    from cp_runtime.serving.session.client import AsyncClient

    async with AsyncClient(address, token=token) as client:
        return await client.stats()


async def _hello(address, token) -> dict:
    from cp_runtime.serving.session.client import AsyncClient

    async with AsyncClient(address, token=token) as client:
        return client.server


@dataclasses.dataclass
class _Run:
    """One API's measured run: its records, `stats` before and after, and the summary."""

    api: str                                         # "session" or "http"
    warmup_s: float | None
    wall_s: float
    records: list[_Record]
    before: dict
    after: dict
    summary: dict


def _progress(w: Workload, desc: str, disable: bool):
    """A tqdm bar over the tokens `w` sends and receives."""
    from tqdm import tqdm

    return tqdm(total=w.uploads * w.upload_tokens + w.chats * w.chat_length, unit="tok",
                unit_scale=True, desc=desc, disable=disable)


async def _measure(api: str, args: argparse.Namespace, address: str, http: str | None,
                   vocab: int) -> _Run:
    """One API's warm-up (unless --no-warmup) and measured run, `stats` read around the run."""
    w, token = args.workload, args.auth_token
    chat = _chat if api == "session" else functools.partial(_chat_http, http)
    warmup_s = None
    if not args.no_warmup:
        t = time.perf_counter()
        warm = dataclasses.replace(w, uploads=min(w.uploads, 1))
        with _progress(warm, f"{api} warm-up", args.no_progress) as bar:
            await _run_mix(address, token, warm, vocab, args.seed + 1, bar, chat)
        warmup_s = time.perf_counter() - t
    before = await _stats(address, token)
    with _progress(w, f"{api} run", args.no_progress) as bar:
        records, wall_s = await _run_mix(address, token, w, vocab, args.seed, bar, chat)
    after = await _stats(address, token)
    return _Run(api, warmup_s, wall_s, records, before, after,
                summarize(records, wall_s, before, after))


async def _measure_all(args: argparse.Namespace, address: str,
                       http: str | None) -> tuple[dict, list[_Run]]:
    """The server's hello, and a _Run per API of `args.apis`, one after the other."""
    hello = await _hello(address, args.auth_token)
    runs = [await _measure(api, args, address, http, hello["vocab_size"]) for api in args.apis]
    return hello, runs


# -- figures ------------------------------------------------------------------------------
def _pct(xs, q) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else None


def _diff(before: dict, after: dict, key: str) -> float:
    return float(after.get(key, 0) or 0) - float(before.get(key, 0) or 0)


def _per(count: float):
    """x -> 1000 x / count (seconds per item -> ms per item), or None when count is 0."""
    return (lambda s: 1000 * s / count) if count else (lambda s: None)


def _latencies(name: str, xs: list[float]) -> dict:
    """`{name}_samples` and `{name}_p50_ms`, `_p99_ms`, `_max_ms` of `xs` (seconds)."""
    return {f"{name}_samples": len(xs), f"{name}_p50_ms": _ms(_pct(xs, 50)),
            f"{name}_p99_ms": _ms(_pct(xs, 99)), f"{name}_max_ms": _ms(max(xs, default=None))}


def summarize(records: list[_Record], wall_s: float, before: dict, after: dict) -> dict:
    uploads = [r for r in records if r.kind == "upload"]
    prefill = sum(r.prefill_tokens for r in records)
    decode = sum(r.decode_tokens for r in records)
    steps = _diff(before, after, "steps_total")
    host, device = _diff(before, after, "host_s_total"), _diff(before, after, "device_s_total")
    cpu = _diff(before, after, "server_cpu_s")
    generated = _diff(before, after, "decode_tokens_total")
    per_step, per_token = _per(steps), _per(generated)
    return {
        "wall_s": wall_s,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "tokens_per_s": (prefill + decode) / wall_s,
        **{k: v for name in ("ttft", "prompt", "itl", "turn")
           for k, v in _latencies(name, [x for r in records for x in getattr(r, name)]).items()},
        "uploads": [{"index": r.index, "tokens": r.prefill_tokens, "upload_s": r.upload_s,
                     "prefill_tok_per_s": r.prefill_tokens / r.upload_s} for r in uploads],
        "engine": {"steps": int(steps), "host_s": host, "device_s": device,
                   "server_cpu_s": cpu,
                   "prefill_tokens": int(_diff(before, after, "prefill_tokens_total")),
                   "decode_tokens": int(generated),
                   "host_ms_per_step": per_step(host), "device_ms_per_step": per_step(device),
                   "server_cpu_ms_per_step": per_step(cpu),
                   "host_share": ((host + cpu) / (host + cpu + device)
                                  if host + cpu + device > 0 else None),
                   "host_ms_per_token": per_token(host),
                   "server_cpu_ms_per_token": per_token(cpu),
                   "host_cpu_ms_per_token": per_token(host + cpu)},
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else 1000 * s


def _timeline(ax, records: list[_Record], title: str) -> None:
    """One row per user: uploads as bars shaded by progress, chat tokens as dots."""
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
    ax.set_title(title, fontsize="small")
    ax.grid(axis="x", alpha=0.3)


def plot(path: pathlib.Path, runs: list[_Run], title: str) -> pathlib.Path:
    """Left: a timeline per API run, one row per user; right: every run's TTFT and ITL
    distributions (empirical CDFs)."""
    from cp_runtime.benchmarks._shared.plots import _pyplot, _save

    plt = _pyplot()
    fig = plt.figure(figsize=(12, 4.5 * len(runs)))
    grid = fig.add_gridspec(len(runs), 2, width_ratios=[3, 2])
    cdf = fig.add_subplot(grid[:, 1])
    plotted = False
    for i, run in enumerate(runs):
        named = f"{run.api}: " if len(runs) > 1 else ""
        _timeline(fig.add_subplot(grid[i, 0]), run.records,
                  f"{named}timeline: uploads (bars, ticks = progress events), chat tokens "
                  f"(dots)")
        for name in ("ttft", "itl"):
            xs = np.sort([x * 1000 for r in run.records for x in getattr(r, name)])
            if len(xs):
                cdf.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post",
                         label=f"{named}{name.upper()} (n={len(xs)})")
                plotted = True
    if plotted:
        cdf.set_xscale("log")
        cdf.legend(fontsize="small")
    cdf.set_xlabel("ms (client-side)")
    cdf.set_ylabel("fraction of samples")
    cdf.set_title("latency distributions", fontsize="small")
    cdf.grid(alpha=0.3)
    fig.suptitle(title, fontsize="medium")
    return _save(fig, path)


# -- tables -------------------------------------------------------------------------------
# The side-by-side table of `--api both`: (row label, summary key, or engine.KEY).
COMPARED = (("TTFT p50 ms", "ttft_p50_ms"), ("TTFT p99 ms", "ttft_p99_ms"),
            ("turn to first token p50 ms", "turn_p50_ms"),
            ("turn to first token p99 ms", "turn_p99_ms"),
            ("ITL p50 ms", "itl_p50_ms"), ("ITL p99 ms", "itl_p99_ms"),
            ("host CPU ms/token", "engine.host_cpu_ms_per_token"),
            ("engine host ms/token", "engine.host_ms_per_token"),
            ("server CPU ms/token", "engine.server_cpu_ms_per_token"),
            ("tokens generated", "engine.decode_tokens"),
            ("TTFT samples", "ttft_samples"), ("ITL samples", "itl_samples"))


def _field(summary: dict, key: str):
    """summary[key], or summary["engine"][KEY] for "engine.KEY"."""
    head, _, rest = key.partition(".")
    return summary[head][rest] if rest else summary[head]


def comparison(runs: list[_Run]) -> list[dict]:
    """COMPARED's rows: {"measure": label, API: value for each run}."""
    return [{"measure": label, **{run.api: _field(run.summary, key) for run in runs}}
            for label, key in COMPARED]


def _print_run(run: _Run, w: Workload, server_desc: str, cores: int) -> None:
    """One run's latencies and uploads, as `--api session` always printed them."""
    s = run.summary
    rows = [{"measure": "TTFT ms", "n": s["ttft_samples"], "p50": s["ttft_p50_ms"],
             "p99": s["ttft_p99_ms"], "max": s["ttft_max_ms"]},
            {"measure": "ITL ms", "n": s["itl_samples"], "p50": s["itl_p50_ms"],
             "p99": s["itl_p99_ms"], "max": s["itl_max_ms"]}]
    if run.api == "session":                     # over HTTP the prompt is in TTFT
        rows.append({"measure": "chat prompt ms", "n": s["prompt_samples"],
                     "p50": s["prompt_p50_ms"], "p99": s["prompt_p99_ms"],
                     "max": s["prompt_max_ms"]})
    rows += [{"measure": f"upload {u['index']} tok/s", "n": u["tokens"],
              "p50": u["prefill_tok_per_s"], "max": u["upload_s"]} for u in s["uploads"]]
    over = "" if run.api == "session" else " (chats over HTTP)"
    print_table(rows, ["measure", "n", "p50", "p99", "max"],
                title=f"serving{over}: {w.uploads} uploads x {w.upload_tokens} tokens, "
                      f"{w.chats} chats x {w.chat_turns} turns x ({w.chat_prompt} prompt + "
                      f"{w.chat_tokens} generated); {server_desc}; {cores} cores (upload rows: "
                      f"n = tokens, p50 = prefill tok/s, max = upload s)")


def _print_totals(runs: list[_Run]) -> None:
    """Each run's aggregate rate and per-step split (the api column only with several)."""
    rows = []
    for run in runs:
        s, e = run.summary, run.summary["engine"]
        rows.append({"api": run.api, "wall_s": s["wall_s"],
                     "tokens": s["prefill_tokens"] + s["decode_tokens"],
                     "tok/s": s["tokens_per_s"], "steps": e["steps"],
                     "host ms/step": e["host_ms_per_step"],
                     "device ms/step": e["device_ms_per_step"],
                     "server cpu ms/step": e["server_cpu_ms_per_step"],
                     "host share": e["host_share"]})
    columns = ["wall_s", "tokens", "tok/s", "steps", "host ms/step", "device ms/step",
               "server cpu ms/step", "host share"]
    print_table(rows, (["api"] if len(runs) > 1 else []) + columns)


def _print_comparison(runs: list[_Run]) -> None:
    print_table(comparison(runs), ["measure", *(run.api for run in runs)],
                title="session protocol vs HTTP, same server and workload (TTFT: session from "
                      "the generate sent, HTTP from the request sent, its prompt's prefill "
                      "included; turn to first token: from the turn's first request on both; "
                      "host CPU = (engine host + server event-loop CPU) / tokens generated)")


def _run_json(run: _Run) -> dict:
    return {"warmup_s": run.warmup_s, **run.summary, "stats_before": run.before,
            "stats_after": run.after, "records": [dataclasses.asdict(r) for r in run.records]}


# -- main ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    w = args.workload
    server = None
    if args.address is None:
        pages = args.pages_per_shard or pages_per_shard_for(w, args.shards, args.page_size)
        started = time.perf_counter()
        server = _server_process(args, pages)
        address, http = server.address, server.http_address
        startup_s = time.perf_counter() - started
    else:
        address, http, startup_s = args.address, args.http_address, None
    try:
        hello, runs = asyncio.run(_measure_all(args, address, http))
    finally:
        if server is not None:
            server.stop()
    server_desc = (f"{hello['model']}, S={hello['shards']}, {hello['kv_cache_dtype']}, "
                   f"page {hello['page_size']}, {hello['pages_per_shard']} pages/shard")
    info = machine()
    for run in runs:
        _print_run(run, w, server_desc, info["cpu_count"])
        print()
    _print_totals(runs)
    if len(runs) > 1:
        print()
        _print_comparison(runs)
    # The top level is the first run's (the session protocol's unless --api http), as it was
    # before --api; `runs` holds every run by API.
    payload = {"args": {k: v for k, v in vars(args).items() if k != "auth_token"},
               "workload": dataclasses.asdict(w), "api": args.api, "server": {
                   "address": address if server is None else None,
                   "http_address": http if server is None else None,
                   "command": server.command if server else None, "startup_s": startup_s,
                   "hello": hello},
               **_run_json(runs[0]),
               "runs": {run.api: _run_json(run) for run in runs},
               "comparison": comparison(runs) if len(runs) > 1 else None}
    path = write_json(args.out / "serving.json", payload)
    png = plot(args.out / "serving.png", runs,
               f"serving ({', '.join(args.apis)}): {w.uploads} uploads, {w.chats} chats; "
               f"{server_desc}")
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
