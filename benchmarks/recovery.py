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
import pathlib
import sys
import tempfile
import time

import numpy as np

import cp_runtime
from cp_runtime.benchmarks.common import (ServeProcess, apply_quick, print_table, quick_help,
                                         write_json)
from cp_runtime.cache.layout import cdiv
from cp_runtime.cli.args import (HelpFormatter, add_chunk_size, add_kv_cache_dtype, add_model,
                                 add_no_progress, add_out, add_page_size, add_shards, check_out_dir,
                                 check_page_size_for_model, comma_list, length_list)
from cp_runtime.serving.protocol import UnavailableError

__all__ = ["build_parser", "main", "measure"]

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
        server = ServeProcess(flags)
        with cp_runtime.Client(server.address) as client:
            session = client.create_session()
            vocab = client.server["vocab_size"]
            session.extend(np.random.default_rng(tokens).integers(0, vocab, tokens))
            if mode == "snapshot":
                session.snapshot()
        server.kill()
        t_kill = time.monotonic()
        server = ServeProcess(flags)
        listening = time.monotonic() - t_kill
        try:
            restored, first = _first_token(server.address, session.id, t_kill)
        finally:
            server.stop()
    return {"tokens": tokens, "mode": mode, "listening_s": round(listening, 2),
            "restored_s": round(restored, 2), "first_token_s": round(first, 2)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cp-runtime bench recovery", description=__doc__,
                                formatter_class=HelpFormatter)
    add_model(p, "small")
    add_shards(p, 16)
    add_kv_cache_dtype(p, "fp8_e4m3")
    add_page_size(p, 64, why="64-token pages, as the TPU deployment configs use")
    add_chunk_size(p, 4096, why="a restored log re-prefills in 4x fewer steps")
    p.add_argument("--lengths", type=length_list, default=None,
                   help=f"session lengths to recover, k/m suffixes "
                        f"({quick_help(QUICK, 'lengths')})")
    p.add_argument("--modes", default=MODES, type=comma_list(str, choices=MODES),
                   help="how the cache comes back: log (re-prefill), snapshot")
    p.add_argument("--quick", action="store_true", help="the shortest session only")
    add_no_progress(p)
    add_out(p, "out/recovery")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    check_page_size_for_model(parser, args.model, args.page_size)
    out = check_out_dir(parser, args.out)
    rows = [measure(args, n, mode) for n in args.lengths for mode in args.modes]
    print_table(rows, ["tokens", "mode", "listening_s", "restored_s", "first_token_s"],
                title=f"kill -9 -> restart -> first token ({args.model}, S = {args.shards}, "
                      f"{args.kv_cache_dtype}, chunk {args.chunk_size})")
    path = write_json(pathlib.Path(out) / "recovery.json",
                      {"args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
