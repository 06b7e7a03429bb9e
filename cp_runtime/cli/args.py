"""Command-line flags shared by every entry point (`serve`, `demo`, `capacity`, each benchmark),
so one flag means one thing everywhere:

    --model NAME            a model config name (configs/models/NAME.toml)
    --checkpoint DIR        a Hugging Face checkpoint directory instead of a config's random
                            (or hand-built) weights
    --kv-cache-dtype D      one latent cache dtype;  --kv-cache-dtypes D,D  a list of them
    --selection token|page  what the DSA indexer selects (token: the model as trained)
    --weight-dtype D        the weights' dtype on the device (auto: the model's own)
    --weights MODE          weights whole on every device, split over them, or auto
    --shards N              context-parallel shard count (a list `1,16` where a benchmark sweeps)
    --chunk-size N          prefill tokens per step
    --page-size N, --pages-per-shard N
    --out DIR               where JSON and PNG results go (checked before any work)
    --no-progress           no progress bars

A shared flag has one common default (--chunk-size 1024, --page-size 16, --shards 16, --backend
auto, --kv-cache-dtype fp8_e4m3); a command whose default differs passes `why=`, and its help
says why.

Sizes take `k` and `m` suffixes (`8k` = 8192, `1m` = 1048576) wherever they count tokens. A bad
value is an argparse usage error (exit 2, the flag named), never a traceback; `cp-runtime`'s
parsers (`CommandLineParser`) print it as one line, without the usage page.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import re

from cp_runtime.config import (BACKENDS, GATHER_MODES, LATENT_MEMORIES, MODEL_WEIGHT_DTYPES,
                               SELECTIONS, WEIGHT_MODES, load_model_config, model_names)
from cp_runtime.dtypes import KV_CACHE_DTYPES

__all__ = [
    "CommandLineParser",
    "HelpFormatter",
    "add_backend",
    "add_checkpoint",
    "add_chunk_size",
    "add_gathers",
    "add_kv_cache_dtype",
    "add_kv_cache_dtypes",
    "add_latent_memory",
    "add_selection",
    "add_model",
    "add_no_progress",
    "add_out",
    "add_page_size",
    "add_weight_dtype",
    "add_weights",
    "add_pages_per_shard",
    "add_shard_counts",
    "add_shards",
    "check_checkpoint_dir",
    "check_not_below_page",
    "check_out_dir",
    "check_page_size",
    "check_page_size_for_model",
    "comma_list",
    "format_default",
    "format_length",
    "finite_nonnegative_float",
    "finite_positive_float",
    "length",
    "length_list",
    "model_name",
    "nonnegative_length",
    "parse_length",
    "positive_int",
    "positive_int_list",
]


class CommandLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, `PROG: error: MESSAGE`, instead of the
    usage page first (serve's is 30 lines, which buried the line that says what was wrong); an
    error that names no flag (a missing or unknown argument) adds where the flags are listed.
    Its subcommands' parsers are of this class too (argparse's `parser_class`)."""

    def error(self, message: str):
        hint = "" if message.startswith("argument ") else f" (see `{self.prog} --help`)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but arguments no parser took are reported by the subcommand they
        were given to (`cp-runtime serve: error: unrecognized arguments: ...`)."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):   # no public accessor
                    parser = action.choices.get(getattr(namespace, action.dest, None), self)
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and ends each flag's help with its default, written
    as a user would type it (`8k,128k`, `bf16,fp8_e4m3`). A flag whose help already speaks of
    its default ("(default ..." in its text), or whose default is unset (None) or off (False),
    gets no default appended."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS or "(default" in text):
            return text
        typed = format_default(default, action.type).replace("%", "%%")
        return f"{text} (default: {typed})"


def format_default(value, kind=None) -> str:
    """`value` as it would be typed on the command line: lists comma-joined, token counts with
    their k/m suffix when `kind` is a length type (`8192` -> `8k`)."""
    if isinstance(value, (list, tuple)):
        item_kind = getattr(kind, "item_type", kind)
        return ",".join(format_default(v, item_kind) for v in value)
    if kind in (length, nonnegative_length) and isinstance(value, int):
        return format_length(value)
    return str(value)


def format_length(n: int) -> str:
    """8192 -> '8k', 1048576 -> '1m', 5000 -> '5000' (the inverse of parse_length)."""
    for suffix, shift in (("m", 20), ("k", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def parse_length(text: str) -> int:
    """'8k' -> 8192, '1m' -> 1048576, '5000' -> 5000. Raises ValueError on anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"bad length {text!r}: use a number with an optional k or m suffix")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]
    return int(m.group(1)) * scale


def length(text: str) -> int:
    """argparse type: a positive token count with an optional k/m suffix."""
    try:
        n = parse_length(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return n


def _converted(text: str, convert, what: str):
    """convert(text), or the argparse error that says `text` is not `what`."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    n = _converted(text, int, "an integer")
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return n


def finite_positive_float(text: str) -> float:
    """argparse type: a finite float > 0 (refuses inf and nan)."""
    x = _converted(text, float, "a number")
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number above 0")
    return x


def comma_list(item_type, *, choices=None):
    """argparse type: a non-empty comma-separated list, each item through `item_type`."""

    def parse(text: str) -> list:
        parts = [p.strip() for p in str(text).split(",")]
        if not text.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list")
        items = [item_type(p) for p in parts]
        if choices is not None:
            bad = [i for i in items if i not in choices]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"{bad[0]!r} is not one of {', '.join(map(str, choices))}")
        return items

    parse.item_type = item_type        # read by HelpFormatter to print defaults as typed
    return parse


length_list = comma_list(length)
positive_int_list = comma_list(positive_int)


def nonnegative_length(text: str) -> int:
    """argparse type: a token count >= 0 with an optional k/m suffix (0 turns a feature off)."""
    try:
        return parse_length(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def finite_nonnegative_float(text: str) -> float:
    """argparse type: a finite float >= 0 (refuses inf and nan)."""
    x = _converted(text, float, "a number")
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number, 0 or more")
    return x


def add_strict_fields(p: argparse.ArgumentParser) -> None:
    """`--strict-fields`: the HTTP API refuses unknown request fields instead of ignoring them."""
    p.add_argument("--strict-fields", action="store_true",
                   help="HTTP: refuse a request body naming a field the API does not know "
                        "(400 naming it) instead of ignoring it, as vLLM does (docs/http.md)")


def model_name(text: str) -> str:
    """argparse type of --model: a model config's name (configs/models/NAME.toml)."""
    names = model_names()
    if text not in names:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; choose from "
                                         f"{', '.join(names)}")
    return text


def add_model(p: argparse.ArgumentParser, default: str, why: str | None = None) -> None:
    """`--model`: no common default (a server to try starts on a toy model, the TPU planning
    commands on the model they plan for), so each command says why it picks its own."""
    p.add_argument("--model", default=default, type=model_name, choices=model_names(),
                   metavar="NAME",
                   help=f"model config name, one of: {', '.join(model_names())}"
                        + (f" (default {default}: {why})" if why else ""))


def add_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="Hugging Face checkpoint directory (config.json, tokenizer.json, "
                        "*.safetensors); its config replaces --model")


def add_gathers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gathers", choices=GATHER_MODES, default="auto",
                   help="how the step's all-gathers (selection candidates, all_gather merges) "
                        "run: flat, one collective over every shard; staged, groups of shards "
                        "then the groups' results; native, on CPU one in-process gather (every "
                        "shard in this process); auto: on CPU native where it can run, else "
                        "staged with 8+ shards")


def _why(why: str | None) -> str:
    """The help's note on a default that differs from the common one (see the module doc)."""
    return f"; this command's default differs: {why}" if why else ""


def add_kv_cache_dtype(p: argparse.ArgumentParser, default: str = "fp8_e4m3",
                       why: str | None = None) -> None:
    p.add_argument("--kv-cache-dtype", default=default, choices=list(KV_CACHE_DTYPES),
                   help="latent cache dtype: fp8_e4m3 or fp8_e5m2, 1 byte a value (the "
                        "indexer cache stays bf16); bf16; f32 (exact, for tests); auto: the "
                        "model's activation dtype, bf16" + _why(why))


def add_weight_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weight-dtype", choices=["auto", *MODEL_WEIGHT_DTYPES], default="auto",
                   help="the weights' dtype on the device: fp8, block-scaled matmul weights "
                        "(embedding, lm head, router bf16) as the public GLM-5 / DeepSeek-V3.2 "
                        "checkpoints store them; bf16; f32 (exact, for tests); auto: the "
                        "model's own (a checkpoint's, or the config's weight_dtype)")


def add_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=WEIGHT_MODES, default="auto",
                   help="replicated: every device holds the whole model; sharded: each holds "
                        "its part (heads, features, experts, vocabulary), as a model larger "
                        "than one device needs; auto: sharded when the whole model would take "
                        "more than a quarter of one device's memory")


def add_expert_groups(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-groups", type=positive_int, default=1, metavar="N",
                   help="with sharded weights, the routed experts in N groups of whole "
                        "experts, each group's features split over its share of the shards "
                        "(N must divide the shards): a prefill chunk's device runs about 1/N "
                        "of its (token, expert) pairs, a decode step may read N times the "
                        "features; 1: every shard a slice of every expert")
    p.add_argument("--prefill-expert-groups", type=positive_int, default=1, metavar="N",
                   help="with sharded weights and one expert group, the experts exchanged "
                        "into N groups while long prompts prefill (before a step with a whole "
                        "chunk, an all-to-all of each MoE layer's experts within blocks of N "
                        "shards) and back before the next step with no prefill: the prompt's "
                        "pairs as in --expert-groups N, a decode step's experts read by every "
                        "shard as in one (N must divide the shards); 1: never exchanged")


def add_latent_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--latent-memory", choices=LATENT_MEMORIES, default="device",
                   help="where each shard's latent cache lives: device, in its HBM; host, in "
                        "its host's pinned memory as 32-bit words, each step copying only "
                        "the pages it reads (its selected pages, or its rows' tables in a "
                        "long chunk) and writes into HBM and back: the cache holds what the "
                        "hosts hold, at the cost of those copies (the indexer's cache stays "
                        "in HBM)")
    p.add_argument("--latent-device-pages", type=int, default=0, metavar="N",
                   help="with --latent-memory host: hold the first N page slots of each "
                        "shard in HBM all the same. Prompts are prefilled there (no page "
                        "copies from the host each chunk), and the engine moves finished "
                        "sessions' pages to the host when a prompt needs the room "
                        "(default: 0, every page on the host)")


def add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--selection", choices=SELECTIONS, default="token",
                   help="what each query attends: token, its index_topk highest-scoring "
                        "earlier tokens, the model as trained (as transformers, vLLM and "
                        "SGLang compute it); page, its own page and the index_topk / "
                        "page-size earlier pages ranked by their best token, an "
                        "approximation that reads whole pages and serves a different model "
                        "(default: token)")


def add_kv_cache_dtypes(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--kv-cache-dtypes", default=comma_list(str, choices=KV_CACHE_DTYPES)(default),
                   type=comma_list(str, choices=KV_CACHE_DTYPES), metavar="D[,D...]",
                   help=f"latent cache dtypes to compare, from: {', '.join(KV_CACHE_DTYPES)}")


def add_shards(p: argparse.ArgumentParser, default: int = 16, why: str | None = None) -> None:
    p.add_argument("--shards", type=positive_int, metavar="N", default=default,
                   help="context-parallel shards (devices holding the KV cache)" + _why(why))


def add_chunk_size(p: argparse.ArgumentParser, default: int = 1024,
                   why: str | None = None) -> None:
    p.add_argument("--chunk-size", type=length, metavar="N", default=default,
                   help="prefill tokens per step (k/m suffixes allowed)" + _why(why))


def add_page_size(p: argparse.ArgumentParser, default: int = 16, why: str | None = None) -> None:
    p.add_argument("--page-size", type=positive_int, metavar="N", default=default,
                   help="tokens per KV page (a multiple of 16)" + _why(why))


def add_pages_per_shard(p: argparse.ArgumentParser, default: int | None,
                        why: str | None = None) -> None:
    p.add_argument("--pages-per-shard", type=positive_int, metavar="N", default=default,
                   help="KV pages per shard" + ("" if default else
                                                " (default: sized for the longest context)")
                        + _why(why))


def add_out(p: argparse.ArgumentParser, default: str | None, why: str | None = None) -> None:
    p.add_argument("--out", metavar="DIR", default=default,
                   help="directory for the JSON (and PNG) results" + _why(why))


def add_no_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def check_out_dir(parser: argparse.ArgumentParser, out: str | None) -> pathlib.Path | None:
    """Create `out` if needed and check it is a writable directory, before any work is done;
    a bad path is a usage error (parser.error exits 2)."""
    if out is None:
        return None
    path = pathlib.Path(out)
    if path.exists() and not path.is_dir():
        parser.error(f"--out {out}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {out}: cannot create it ({e.strerror})")
    if not os.access(path, os.W_OK):
        parser.error(f"--out {out}: not writable")
    return path


def add_shard_counts(p: argparse.ArgumentParser, default: str = "16",
                     why: str | None = None) -> None:
    """`--shards` for a benchmark that sweeps shard counts: a comma list like `1,16`."""
    p.add_argument("--shards", type=positive_int_list, default=default, metavar="N[,N...]",
                   help="context-parallel shard counts to sweep, e.g. 1,16" + _why(why))


def add_backend(p: argparse.ArgumentParser, default: str = "auto",
                why: str | None = None) -> None:
    p.add_argument("--backend", default=default, choices=BACKENDS,
                   help="kernel backend: pallas, the Pallas TPU kernels; pallas_interpret, "
                        "the same kernels in Pallas's interpreter (any platform, slow); xla, "
                        "XLA ops and the native CPU indexer; reference, the plain reference "
                        "maths (kernels/reference.py); auto: pallas on a TPU, xla elsewhere"
                        + _why(why))


def check_page_size(parser: argparse.ArgumentParser, page_size: int) -> None:
    """A page holds a multiple of 16 tokens (RuntimeConfig's rule); otherwise a usage error."""
    if page_size % 16:
        parser.error(f"--page-size {page_size}: must be a multiple of 16")


def check_not_below_page(parser: argparse.ArgumentParser, flag: str, lengths,
                         page_size: int) -> None:
    """Each of `lengths` (an int or a list) is at least one page; otherwise a usage error."""
    for n in [lengths] if isinstance(lengths, int) else lengths:
        if n < page_size:
            parser.error(f"{flag} {n}: below the page size {page_size}")


def check_checkpoint_dir(parser: argparse.ArgumentParser, checkpoint: str | None) -> None:
    """`--checkpoint DIR` is a directory holding config.json and tokenizer.json (the weights
    are checked when they load); otherwise a usage error."""
    if checkpoint is None:
        return
    path = pathlib.Path(checkpoint)
    if not path.is_dir():
        parser.error(f"--checkpoint {checkpoint}: not a directory")
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        parser.error(f"--checkpoint {checkpoint}: no {missing[0]}")


def check_page_size_for_model(parser: argparse.ArgumentParser, model: str,
                              page_size: int) -> None:
    """`--model`'s index_topk is a whole number of `--page-size` pages (selection picks
    index_topk / page_size pages: config.check_runtime_for_model's rule); otherwise a usage
    error."""
    topk = load_model_config(model).index_topk
    if topk % page_size:
        parser.error(f"--page-size {page_size}: --model {model}'s index_topk {topk} is not a "
                     "multiple of it")
