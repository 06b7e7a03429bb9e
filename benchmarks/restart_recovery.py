"""Restart recovery: how long a session of N tokens takes to answer again after its server is
killed (`kill -9`) and restarted on the same state directory.

Per length, two runs, each a fresh server process with `--state-dir`:
    log        the session's cache is rebuilt by prefilling its token log
    snapshot   a snapshot was taken before the kill: the cache comes back from it
and three times from the kill: `listening` (the new process accepts connections: JAX start,
weights, pool), `restored` (the session's first request is no longer refused as unavailable)
and `first token` (a one-token greedy generation on the restored session has returned: the
recovery a user sees). Compiles are inside these times, as they are after a real restart.

    cp-runtime bench recovery --lengths 8k,128k --out out/recovery
    cp-runtime bench recovery --quick                      # 8K only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np

import cp_runtime
from cp_runtime.benchmarks._shared.bench_parser import TPU_PAGES, BenchmarkParser
from cp_runtime.benchmarks._shared.results import print_table, write_json
from cp_runtime.cache.layout import cdiv
from cp_runtime.cli.args import comma_list, length_list
from cp_runtime.serving.process import ServerProcess
from cp_runtime.serving.session.protocol import UnavailableError

__all__ = ["build_parser", "main", "measure", "parse_args"]

MODES = ("log", "snapshot")
QUICK = {"lengths": ("8k,128k", "8k")}


def _server_flags(args, tokens: int, state_dir: str) -> list[str]:
    pages = cdiv(cdiv(tokens + 8, args.page_size), args.shards) + 2
    return ["--model", args.model, "--shards", str(args.shards), "--kv-cache-dtype",
            args.kv_cache_dtype, "--page-size", str(args.page_size), "--pages-per-shard",
            str(pages), "--chunk-size", str(args.chunk_size), "--state-dir", state_dir]


def _first_token(address: str, session_id: str, t_kill: float) -> tuple[float, float]:
    """Seconds from the kill until the session stops being restored, and until its first
    generated token."""
    with cp_runtime.Client(address) as client:
        session = client.session(session_id)
        while True:
            try:
                if not session.info()["restoring"]:
                    break
            except UnavailableError:
                pass
            time.sleep(0.05)
        restored = time.monotonic() - t_kill
        session.generate(max_tokens=1)
        return restored, time.monotonic() - t_kill


def measure(args, tokens: int, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as state:
        flags = _server_flags(args, tokens, state)
        server = ServerProcess(flags)
        with cp_runtime.Client(server.address) as client:
            session = client.create_session()
            vocab = client.server["vocab_size"]
            session.extend(np.random.default_rng(tokens).integers(0, vocab, tokens))
            if mode == "snapshot":
                session.snapshot()
        server.kill()
        t_kill = time.monotonic()
        server = ServerProcess(flags)
        listening = time.monotonic() - t_kill
        try:
            restored, first = _first_token(server.address, session.id, t_kill)
        finally:
            server.stop()
    return {"tokens": tokens, "mode": mode, "listening_s": round(listening, 2),
            "restored_s": round(restored, 2), "first_token_s": round(first, 2)}


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("recovery", __doc__, quick="the shortest session only",
                        quick_values=QUICK)
    p.add_argument("--lengths", type=length_list,
                   help="session lengths to recover, k/m suffixes")
    p.add_argument("--modes", default=MODES, type=comma_list(str, choices=MODES),
                   help="how the cache comes back: log (re-prefill), snapshot")
    p.add_shared(model="small", shards=16, kv_cache_dtype="fp8_e4m3", page_size=64,
                 chunk_size=4096, out="out/recovery", progress=True, devices=False,
                 why={"page_size": TPU_PAGES,
                      "chunk_size": "a restored log re-prefills in 4x fewer steps"})
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), `--quick` applied, then `--out` created."""
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [measure(args, n, mode) for n in args.lengths for mode in args.modes]
    print_table(rows, ["tokens", "mode", "listening_s", "restored_s", "first_token_s"],
                title=f"kill -9 -> restart -> first token ({args.model}, S = {args.shards}, "
                      f"{args.kv_cache_dtype}, chunk {args.chunk_size})")
    path = write_json(args.out / "recovery.json",
                      {"args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
