"""The `cp-runtime` command line.

    cp-runtime serve --model NAME --shards 16 ...     serve sessions over TCP (prints
                                                     "listening on HOST:PORT")
    cp-runtime demo [--tokens 1m]                    a served long-context session, end to end
    cp-runtime capacity --model glm-5.2 --json       bytes per token and tokens that fit
    cp-runtime compile --model glm-5.2 --layers 4    every program compiled for a TPU slice
    cp-runtime bench NAME [...]                      a benchmark (niah, serving, throughput, ...)

The same flag means the same thing in every subcommand and benchmark (cp_runtime.cli.args).
Benchmarks load on demand, by name, through their one table (cp_runtime.benchmarks.registry,
read here by name too): nothing else in cp_runtime imports them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.resources
import json
import logging
import os
import re
import sys
import time

from cp_runtime import __version__
from cp_runtime.cache.capacity import DEFAULT_TOPOLOGY, TOPOLOGIES, slice_report
from cp_runtime.cli import demo
from cp_runtime.cli.args import (CommandLineParser, HelpFormatter, add_backend, add_checkpoint,
                                 add_chunk_size,
                                 add_expert_groups, add_gathers, add_kv_cache_dtype,
                                 add_latent_memory, add_model,
                                 add_page_size, add_pages_per_shard, add_selection, add_shards,
                                 add_strict_fields, add_weight_dtype, add_weights,
                                 finite_nonnegative_float, finite_positive_float,
                                 length, nonnegative_length, positive_int)
from cp_runtime.cli.compile import add_compile, run_compile
from cp_runtime.config import (MERGE_VARIANTS, ConfigError, RuntimeConfig,
                               check_runtime_for_model, load_model_config, load_runtime_config)
from cp_runtime.engine.precompile import SAMPLING_CHOICES, enable_compile_cache
from cp_runtime.model.source import WeightsSource
from cp_runtime.optional import MissingDependency, require
from cp_runtime.parallel.devices import init_cpu_devices
from cp_runtime.platform import keep_jax_off_absent_tpus
from cp_runtime.serving.app import build_server, check_bind, check_port_free, serve_forever
from cp_runtime.serving.backend import ServerLimits
from cp_runtime.serving.state.token_store import FSYNC_POLICIES, TokenStore

__all__ = ["main", "build_parser"]

EXECUTORS = ("local", "ray")
TOKEN_ENV = "CP_RUNTIME_TOKEN"


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve sessions over TCP (msgpack frames)",
                       formatter_class=HelpFormatter,
                       description="Start a server: load the model, build the sharded KV pool "
                                   "on local devices, and serve the protocol of "
                                   "docs/protocol.md. Prints 'listening on HOST:PORT' once it "
                                   "accepts connections; SIGINT or SIGTERM end it cleanly.")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a runtime TOML (configs/runtime/*.toml; fields as RuntimeConfig's): "
                        "its values replace these flags' defaults, and flags given on the "
                        "command line override the file")
    _add_serve_model(p.add_argument_group("model"))
    _add_serve_cache(p.add_argument_group("cache"))
    _add_serve_parallelism(p.add_argument_group("parallelism"))
    g = p.add_argument_group("scheduling")
    add_chunk_size(g)
    g.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                   help="generations decoded together in one step")
    g.add_argument("--max-queued-tokens", type=nonnegative_length, default=None, metavar="N",
                   help="bound on the prefill tokens queued extends still have to run: an "
                        "extend that would pass it is refused at once as overloaded "
                        "(retryable), one into an empty queue is always taken "
                        "(docs/performance.md); k/m suffixes allowed; 0: no bound (default: "
                        "what the engine prefills in 10 s at its measured rate, at least 16 "
                        "chunks)")
    g.add_argument("--max-model-len", type=length, default=None, metavar="N",
                   help="tokens one session may hold, as vLLM's (k/m suffixes allowed; "
                        "default: the whole pool); it also bounds the tables --precompile "
                        "compiles")
    g.add_argument("--prefix-cache-entries", type=nonnegative_length, default=64, metavar="N",
                   help="sessions kept after stateless HTTP completions so that later prompts "
                        "starting the same way reuse their cached pages (docs/http.md); the "
                        "least recently used is closed when the pool is short or there are "
                        "more; 0: none kept")
    _add_serve_server(p.add_argument_group("server and limits"))
    _add_serve_state(p.add_argument_group("state"))
    _add_serve_compile(p.add_argument_group("compilation"))
    _add_serve_executor(p.add_argument_group("executor"))


def _add_serve_model(g) -> None:
    add_model(g, "tiny", why="random weights small enough to start in seconds anywhere")
    add_checkpoint(g)
    g.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of a config's random weights")
    add_weights(g)
    add_weight_dtype(g)
    add_expert_groups(g)


def _add_serve_cache(g) -> None:
    add_kv_cache_dtype(g)
    add_selection(g)
    add_latent_memory(g)
    add_page_size(g)
    add_pages_per_shard(g, 1024)


def _add_serve_parallelism(g) -> None:
    add_shards(g)
    g.add_argument("--merge", choices=MERGE_VARIANTS, default="auto",
                   help="where the shards' attention partials meet (auto: all_gather for "
                        "small steps, else head_exchange with sharded weights and hidden_psum "
                        "with replicated; `cp-runtime bench merge` compares them)")
    add_gathers(g)
    add_backend(g)


def _add_serve_server(g) -> None:
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind; anything but loopback needs --auth-token")
    g.add_argument("--port", type=int, default=7777, metavar="N",
                   help="TCP port (0: any free port)")
    g.add_argument("--http-port", type=int, default=None, metavar="N",
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /health, "
                        "/metrics; docs/http.md) on this port of --host, same engine, token "
                        "and limits (0: any free port; unset: no HTTP; the http extra)")
    add_strict_fields(g)
    g.add_argument("--auth-token", default=None,
                   help=f"token clients must present (when unset: ${TOKEN_ENV}, if set)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="the runtime's log lines on stderr: start-up phases and their seconds, "
                        "compiles, a summary every --log-summary-s, recoveries, warnings; "
                        "debug adds one line per request (op, session, tokens, ms, outcome)")
    g.add_argument("--log-summary-s", type=finite_nonnegative_float, default=60.0, metavar="S",
                   help="seconds between info summaries of what was served (requests, "
                        "refusals, tokens in and out, pages used); 0: none")
    for f in dataclasses.fields(ServerLimits):
        g.add_argument("--" + f.name.replace("_", "-"), type=positive_int, default=f.default,
                       metavar="S" if f.name.endswith("_s") else "N", help=f.metadata["help"])


def _add_serve_state(g) -> None:
    g.add_argument("--state-dir", metavar="DIR", default=None,
                   help="keep every session's token log here; a server restarted on the same "
                        "directory brings its sessions back (docs/state.md)")
    g.add_argument("--fsync", choices=FSYNC_POLICIES, default="interval",
                   help="when token logs are fsynced: always (every step), interval (at most "
                        "every --fsync-interval s; a killed process loses nothing), never")
    g.add_argument("--fsync-interval", type=finite_positive_float, default=1.0,
                   help="seconds between fsyncs under --fsync interval")


def _add_serve_compile(g) -> None:
    g.add_argument("--precompile", choices=PRECOMPILE_CHOICES, default="auto",
                   help="step programs compiled before the server is ready, with a line each "
                        "(docs/deploy.md): plain = every prefill chunk and decode batch bucket "
                        "at every page-table width up to --max-model-len; all = also each "
                        "decode program's sampling variants (penalties, logit_bias, "
                        "logprobs); none = each compiles on first use; auto = plain on TPUs, "
                        "none on CPUs")
    g.add_argument("--compile-cache", "--compilation-cache-dir", dest="compile_cache",
                   metavar="DIR", default=None,
                   help="JAX's persistent compilation cache (default: DIR/compile-cache under "
                        "--state-dir, else none): a restart loads its programs instead of "
                        "compiling them; with --executor ray, a path on every host")


def _add_serve_executor(g) -> None:
    g.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="where shards run: local = the devices of this process; ray = one "
                        "worker process per host (--hosts x --devices-per-host = --shards), "
                        "an embedded Ray or the cluster at --ray-address (needs the ray "
                        "extra: pip install 'cp-runtime[ray]')")
    g.add_argument("--hosts", type=positive_int, default=2,
                   help="--executor ray: worker processes, one per host")
    g.add_argument("--devices-per-host", type=positive_int, default=8,
                   help="--executor ray: devices each worker owns (CPU: virtual devices)")
    g.add_argument("--ray-address", default=None,
                   help="--executor ray: attach to this Ray cluster ('auto': the one this "
                        "machine belongs to) instead of starting an embedded one")
    g.add_argument("--platform", choices=("auto", "cpu", "tpu"), default="auto",
                   help="--executor ray: the workers' devices (auto: tpu when the Ray "
                        "cluster has TPU resources)")
    g.add_argument("--tpu-topology", default=None,
                   help="--executor ray on TPU: the slice topology (e.g. 2x2x2), reserved "
                        "whole through ray.util.tpu slice placement (with --tpu-version)")
    g.add_argument("--tpu-version", default=None,
                   help="--executor ray on TPU: the accelerator generation (e.g. v7x)")
    g.add_argument("--heartbeat-s", type=finite_positive_float, default=1.0,
                   help="--executor ray: seconds between worker heartbeats")
    g.add_argument("--heartbeat-timeout-s", type=finite_positive_float, default=10.0,
                   help="--executor ray: a worker silent this long is dead")
    g.add_argument("--step-timeout-s", type=finite_positive_float, default=60.0,
                   help="--executor ray: a step running longer than this fails its worker "
                        "group (the first step of each shape, which compiles, gets "
                        "--setup-timeout-s)")
    g.add_argument("--setup-timeout-s", type=finite_positive_float, default=900.0,
                   help="--executor ray: starting a worker group (placement, "
                        "jax.distributed, weights) and each first step of a shape")


LOG_LEVELS = ("debug", "info", "warning", "error")
PRECOMPILE_CHOICES = ("auto", *SAMPLING_CHOICES, "none")


def configure_logging(level: str) -> None:
    """The runtime's loggers (`cp_runtime.*`) to stderr at `level`, with time and source."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("cp_runtime")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


# serve flag (argparse dest) -> the RuntimeConfig field it sets
RUNTIME_FLAGS = {"model": "model", "kv_cache_dtype": "kv_cache_dtype", "page_size": "page_size",
                 "shards": "num_shards", "pages_per_shard": "pages_per_shard",
                 "chunk_size": "chunk_size", "max_batch": "max_batch", "backend": "backend",
                 "weights": "weights", "weight_dtype": "weight_dtype", "merge": "merge",
                 "gathers": "gathers", "max_queued_tokens": "max_queued_tokens",
                 "prefix_cache_entries": "prefix_cache_entries",
                 "expert_groups": "expert_groups",
                 "prefill_expert_groups": "prefill_expert_groups",
                 "latent_memory": "latent_memory",
                 "latent_device_pages": "latent_device_pages", "selection": "selection",
                 "max_model_len": "max_model_len"}


def _flag_of(field: str) -> str:
    dest = next((d for d, f in RUNTIME_FLAGS.items() if f == field), field)
    return "--" + dest.replace("_", "-")


def _name_flags(message: str) -> str:
    """A RuntimeConfig error in the vocabulary of the command line: `page_size=24 must ...`
    and `field 'page_size'=24: ...` become `--page-size 24 ...`."""
    return re.sub(r"(?:field )?'?\b(" + "|".join(RUNTIME_FLAGS.values()) + r")'?=",
                  lambda m: _flag_of(m.group(1)) + " ", message)


def serve_runtime(args, typed: set[str]) -> RuntimeConfig:
    """The runtime `serve` runs: its flags, or with --config FILE the file over the flags'
    defaults and the flags in `typed` (argparse dests given on the command line) over both.
    Errors name the flag, or the file for a value that came from it."""
    flags = {field: getattr(args, dest) for dest, field in RUNTIME_FLAGS.items()}
    if args.config is None:
        try:
            return RuntimeConfig(**flags)
        except ConfigError as e:
            raise ConfigError(_name_flags(str(e))) from None
    given = {field: flags[field] for dest, field in RUNTIME_FLAGS.items() if dest in typed}
    return load_runtime_config(args.config, defaults=flags, **given)


def _run_serve(args, typed: set[str]) -> int:
    started = time.perf_counter()
    token = args.auth_token or os.environ.get(TOKEN_ENV) or None
    check_bind(args.host, token)                     # before any loading
    check_port_free(args.host, args.port)
    if args.http_port is not None:
        check_port_free(args.host, args.http_port, "--http-port")
        for module in ("uvicorn", "starlette", "prometheus_client"):
            require(module, "--http-port", "http")
    runtime = serve_runtime(args, typed)
    source = WeightsSource(model=runtime.model, checkpoint=args.checkpoint, seed=args.seed)
    model = source.config()
    runtime = dataclasses.replace(runtime, model=model.name)
    try:
        check_runtime_for_model(model, runtime, args.config)
    except ConfigError as e:
        raise ConfigError(e if args.config else _name_flags(str(e))) from None
    limits = ServerLimits(**{f.name: getattr(args, f.name)
                             for f in dataclasses.fields(ServerLimits)})
    factory = None
    if args.executor == "ray":
        factory = _ray_executor_factory(args)
    else:
        init_cpu_devices(runtime.num_shards)
        if compile_cache_dir(args):
            enable_compile_cache(compile_cache_dir(args))
    state = (TokenStore(args.state_dir, fsync=args.fsync, interval_s=args.fsync_interval)
             if args.state_dir else None)
    server = build_server(source, runtime, host=args.host, port=args.port,
                          auth_token=token, limits=limits, state=state,
                          executor_factory=factory, summary_interval_s=args.log_summary_s,
                          http_port=args.http_port, strict_fields=args.strict_fields,
                          precompile=args.precompile)
    try:
        serve_forever(server, started=started)
    finally:
        server.engine.executor.close()
    return 0


def typed_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The argparse dests the user gave in `argv`: argv parsed again with every default of
    `parser` and its subcommands suppressed, so a flag typed with its default value counts."""
    actions = []

    def walk(p):
        for a in p._actions:                        # argparse keeps no public list of them
            if isinstance(a, argparse._SubParsersAction):
                for child in a.choices.values():
                    walk(child)
            else:
                actions.append(a)

    walk(parser)
    saved = [(a, a.default) for a in actions]
    for a in actions:
        a.default = argparse.SUPPRESS
    try:
        return set(vars(parser.parse_args(argv)))
    finally:
        for a, default in saved:
            a.default = default


def compile_cache_dir(args) -> str | None:
    """`--compile-cache`, else the state dir's compile-cache folder, else None."""
    if args.compile_cache:
        return args.compile_cache
    return os.path.join(args.state_dir, "compile-cache") if args.state_dir else None


def _ray_executor_factory(args):
    """RayExecutor(source, runtime) with the serve flags; cp_runtime.cluster (and Ray) load
    only here, by name."""
    if args.hosts * args.devices_per_host != args.shards:
        raise ValueError(f"--hosts {args.hosts} x --devices-per-host {args.devices_per_host} "
                         f"must equal --shards {args.shards}")
    require("ray", "--executor ray", "ray")
    cluster = importlib.import_module("cp_runtime.cluster.ray_executor")

    def factory(source, runtime):
        return cluster.RayExecutor(
            source, runtime, hosts=args.hosts, devices_per_host=args.devices_per_host,
            address=args.ray_address, platform=args.platform, heartbeat_s=args.heartbeat_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s, step_timeout_s=args.step_timeout_s,
            setup_timeout_s=args.setup_timeout_s,
            tpu_topology=args.tpu_topology, tpu_version=args.tpu_version,
            compilation_cache_dir=compile_cache_dir(args))

    return factory


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="a served long-context session on 16 local CPU shards",
                       description=demo.__doc__)
    demo.add_arguments(p)


def _add_capacity(sub) -> None:
    p = sub.add_parser("capacity", help="bytes per token and tokens that fit, per cache dtype",
                       description="Per device of a deployment: HBM, the weights' shard (from "
                                   "the config's tensors and weight dtype), a reserve for "
                                   "activations, the KV bytes left, and the tokens that fit "
                                   "at bf16 and fp8 (cache bytes per token: latent + indexer, "
                                   "all layers); docs/capacity.md gives the arithmetic.")
    p.formatter_class = HelpFormatter
    add_model(p, "glm-5.2", why="the model a slice is planned for")
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="a Hugging Face checkpoint directory: the model its config.json "
                        "describes instead of --model (only config.json is read; "
                        "docs/checkpoints.md)")
    add_kv_cache_dtype(p)
    p.add_argument("--topology", choices=list(TOPOLOGIES), default=None,
                   help="a known slice (TPU v7x: 96 GiB per device, 2 devices per chip); "
                        f"default {DEFAULT_TOPOLOGY} unless --devices and --hbm-gib are given")
    p.add_argument("--devices", type=positive_int, default=None,
                   help="devices holding weights and cache (with --hbm-gib, for any slice)")
    p.add_argument("--hbm-gib", type=finite_positive_float, default=None,
                   help="HBM per device in GiB (with --devices)")
    add_weight_dtype(p)
    add_weights(p)
    p.add_argument("--reserve-gib", type=finite_positive_float, default=None,
                   help="GiB per device kept for activations (default: 10%% of HBM)")
    p.add_argument("--weights-gib", type=finite_positive_float, default=None,
                   help="override: GiB per device taken by weights and activations together "
                        "(no weights computed, no reserve unless --reserve-gib)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _run_capacity(args) -> int:
    if args.checkpoint is not None:
        from cp_runtime.weights.checkpoint import read_hf_config
        model = read_hf_config(args.checkpoint)
    else:
        model = load_model_config(args.model)
    if (args.devices is None) != (args.hbm_gib is None):
        raise ValueError("--devices and --hbm-gib go together")
    if args.topology is not None and args.devices is not None:
        raise ValueError("give --topology, or --devices with --hbm-gib, not both")
    report = slice_report(model, args.kv_cache_dtype, topology=args.topology,
                          devices=args.devices, hbm_gib=args.hbm_gib,
                          weight_dtype=args.weight_dtype, weights=args.weights,
                          reserve_gib=args.reserve_gib, weights_gib=args.weights_gib)
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
        return 0
    r = report
    print(f"model {r.model} on {r.topology or 'a custom slice'}: {r.devices} devices x "
          f"{r.hbm_gib_per_device:g} GiB HBM")
    print(f"per device: weights {r.weights_gib_per_device:.2f} GiB"
          + (f" ({r.weight_dtype}, {r.weights})" if r.weight_dtype else "")
          + f", reserve {r.reserve_gib_per_device:.2f} GiB, KV {r.kv_gib_per_device:.2f} GiB"
          + ("" if r.weights_fit else "  (weights and reserve exceed HBM: nothing fits)"))
    print(f"{'cache dtype':<12} {'bytes/token':>12} {'tokens that fit':>16}")
    print(f"{'bf16':<12} {r.bytes_per_token_bf16:>12,} {r.tokens_that_fit_bf16:>16,}")
    print(f"{'fp8':<12} {r.bytes_per_token_fp8:>12,} {r.tokens_that_fit_fp8:>16,}")
    if r.kv_cache_dtype not in ("bf16", "fp8_e4m3", "fp8_e5m2"):
        print(f"{r.kv_cache_dtype:<12} {r.bytes_per_token:>12,} {r.tokens_that_fit:>16,}")
    print(f"ratio bf16 / {r.kv_cache_dtype}: {r.ratio_vs_bf16:.2f}x")
    host_gib = r.tokens_that_fit_host_latent * r.host_bytes_per_token / r.devices / 2**30
    print(f"with the latent cache in host memory (--latent-memory host), {r.kv_cache_dtype}: "
          f"the devices hold {r.device_bytes_per_token_host_latent:,} bytes a token (the "
          f"indexer's), {r.tokens_that_fit_host_latent:,} tokens; the hosts "
          f"{r.host_bytes_per_token:,} bytes a token, {host_gib:,.1f} GiB a device at that "
          "many (fewer tokens if the hosts hold less)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    try:
        docs = importlib.resources.files("cp_runtime.docs")
    except ModuleNotFoundError:       # a source tree put on PYTHONPATH without its docs/
        docs = "the repository's docs/ (not beside this copy of cp_runtime)"
    parser = CommandLineParser(
        prog="cp-runtime", formatter_class=HelpFormatter,
        description="Long-context serving runtime for DeepSeek Sparse Attention models: a paged "
                    "fp8 MLA cache sharded by position over a context-parallel mesh.",
        epilog=f"The docs/NAME.md files these helps name are installed in {docs}.")
    parser.add_argument("--version", action="version", version=f"cp-runtime {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_demo(sub)
    _add_capacity(sub)
    add_compile(sub)
    _add_bench(sub)
    return parser


def _benchmarks():
    """The benchmarks' table, cp_runtime.benchmarks.registry: imported by name, like the
    benchmarks themselves, so that no module of cp_runtime imports the suite."""
    return importlib.import_module("cp_runtime.benchmarks.registry")


def _add_bench(sub) -> None:
    table = _benchmarks().BENCHMARKS
    width = max(len(b.name) for b in table)
    listing = "\n".join(f"  {b.name:<{width}}  {b.purpose}" for b in table)
    bench = sub.add_parser("bench", help="run a benchmark of the long-context suite",
                           formatter_class=HelpFormatter,
                           description="Run one benchmark of the long-context suite "
                                       "(cp-runtime bench NAME --help for its flags).",
                           epilog=f"benchmarks:\n{listing}")
    bench.add_argument("name", nargs="?", choices=[b.name for b in table], metavar="NAME",
                       help="the benchmark, one of those listed below")
    bench.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS",
                       help="the benchmark's own flags (see cp-runtime bench NAME --help)")


def _run_benchmark(name: str, argv: list[str]) -> int:
    benchmark = _benchmarks().get(name)
    if "-h" not in argv and "--help" not in argv and benchmark.plots:
        require("matplotlib", f"cp-runtime bench {name}", "bench")      # before any work
    return _benchmarks().run(name, argv)


def main(argv: list[str] | None = None) -> int:
    keep_jax_off_absent_tpus()
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            configure_logging(args.log_level)
            return _run_serve(args, typed_flags(parser, argv) if args.config else set())
        if args.command == "demo":
            return demo.run(args)
        if args.command == "capacity":
            return _run_capacity(args)
        if args.command == "compile":
            return run_compile(args)
        if args.name is None:
            print(f"cp-runtime bench: name a benchmark: {', '.join(_benchmarks().names())} "
                  "(cp-runtime bench NAME --help for its flags)", file=sys.stderr)
            return 2
        return _run_benchmark(args.name, args.rest)
    except (ConfigError, ValueError, MissingDependency) as e:
        print(f"cp-runtime: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
