"""Model and runtime configuration: frozen dataclasses loaded from TOML files.

A model file under `configs/models/NAME.toml` describes shapes only (no weights). A runtime file
under `configs/runtime/` sets RuntimeConfig's fields: how much it holds, and its `strategy`'s
knobs (how a step runs) as flat keys beside them; `resolve_strategy` turns their "auto"s into
choices for a model and platform. Every size the runtime uses comes from here, never from a
literal. A file that is missing a field, has an unknown field, or a value of the wrong kind raises
`ConfigError` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.resources
import math
import pathlib
import tomllib
import typing
from typing import Any

from cp_runtime.dtypes import KV_CACHE_DTYPES

__all__ = [
    "CONFIG_DIR",
    "ConfigError",
    "ModelConfig",
    "RopeScaling",
    "ResolvedStrategy",
    "RuntimeConfig",
    "STRATEGY_KEYS",
    "Strategy",
    "check_runtime_for_model",
    "load_model_config",
    "load_runtime_config",
    "model_names",
    "resolve_strategy",
    "yarn_mscale",
]

# The repository's configs/ folder, installed as the package data of `cp_runtime.configs`.
CONFIG_DIR = pathlib.Path(str(importlib.resources.files("cp_runtime.configs")))
LANES = 128  # TPU lane width: every cached vector part is padded to a multiple of this.
INDEXER_TYPES = ("full", "shared")
# Where a shard's latent cache lives (RuntimeConfig.latent_memory).
LATENT_MEMORIES = ("device", "host")
SELECTIONS = ("token", "page")
# "auto" picks one by the model's size (cp_runtime.weights.format.resolve_weight_mode).
WEIGHT_MODES = ("auto", "replicated", "sharded")  # cp_runtime.weights.sharding describes each
# Dtypes a model's weights are published in (cp_runtime.weights.format describes each).
MODEL_WEIGHT_DTYPES = ("fp8", "bf16", "f32")


class ConfigError(ValueError):
    """A config file or value is invalid; the message names the file and the field."""


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _check_sizes(owner: str, obj: Any, positive: tuple[str, ...],
                 non_negative: tuple[str, ...] = (), floats: tuple[str, ...] = ()) -> None:
    """Raise ConfigError naming the first field of `obj` that is not an int > 0 (`positive`),
    an int >= 0 (`non_negative`), or a finite float > 0 (`floats`); `owner` prefixes it."""
    for names, low, what in ((positive, 1, "a positive integer"),
                             (non_negative, 0, "an integer >= 0")):
        for name in names:
            v = getattr(obj, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"{owner}{name}={v!r} must be {what}")
    for name in floats:
        v = getattr(obj, name)
        if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                or v <= 0):
            raise ConfigError(f"{owner}{name}={v!r} must be a finite number above 0")


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times: 0.1 m ln(factor) + 1,
    and exactly 1 when nothing is stretched (factor <= 1)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN rope scaling (the HF `rope_scaling` of type "yarn"; DeepSeek-V3's defaults), with
    transformers' meaning of every field (modeling_rope_utils._compute_yarn_parameters and
    yarn_apply_mscale; docs/reference-semantics.md).

    Rotary dims that turn fewer than `beta_slow` times over `original_max_position_embeddings`
    tokens get their frequency divided by `factor`, dims turning more than `beta_fast` times
    keep it, and a linear ramp blends the ones between (cp_runtime.model.ops.rope_frequencies);
    the ramp's ends are rounded out to whole dims (floor, ceil) unless `truncate` is false.
    The softmax scale gains yarn_mscale(factor, mscale_all_dim)**2 (1 when mscale_all_dim is 0).
    cos and sin are multiplied by `rope_mscale`: `attention_factor` where given, else
    yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) where both are non-zero
    (1 when they are equal, as in every public DeepSeek config), else yarn_mscale(factor, 1).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ConfigError(f"rope_scaling.factor={self.factor} must be at least 1")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(f"rope_scaling.original_max_position_embeddings="
                              f"{self.original_max_position_embeddings} must be positive")
        if not 0 < self.beta_slow <= self.beta_fast:
            raise ConfigError(f"rope_scaling: need 0 < beta_slow={self.beta_slow} <= "
                              f"beta_fast={self.beta_fast}")

    @property
    def attention_mscale(self) -> float:
        """Factor on the softmax scale: yarn_mscale(factor, mscale_all_dim) squared."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    @property
    def rope_mscale(self) -> float:
        """Factor on the rotated rope part (cos and sin) of queries and keys, as transformers
        computes YaRN's attention_factor: the given one, else the ratio of the two mscales
        where both are non-zero, else yarn_mscale(factor, 1)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor,
                                                                       self.mscale_all_dim)
        return yarn_mscale(self.factor, 1.0)


# ModelConfig's sizes: dimensions and counts that must be >= 1; MoE counts that may be 0 (a dense
# model has no experts); floats that must be finite and above 0.
_MODEL_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
                "intermediate_size", "moe_intermediate_size", "n_group", "topk_group")
_MODEL_COUNTS = ("first_k_dense_replace", "n_routed_experts", "num_experts_per_tok",
                 "n_shared_experts")
_MODEL_FLOATS = ("rms_norm_eps", "mla_norm_eps", "rope_theta", "routed_scaling_factor")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes of a DSA-MLA decoder (DeepSeek-V3.2 family). Names follow the HF config."""

    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]
    first_k_dense_replace: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    rms_norm_eps: float = 1e-6
    # eps of MLA's inner RMSNorms (q_a_layernorm, kv_a_layernorm): 1e-6 in DeepSeek's and
    # transformers' code whatever rms_norm_eps is (GLM-5's 1e-5 is its other norms' only).
    mla_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    mla_rope_interleaved: bool = True
    index_rope_first: bool = True
    index_rope_interleaved: bool = False   # indexer rope on pairs (GLM-5) or halves
    index_hadamard: bool = True
    routed_scaling_factor: float = 1.0
    tie_word_embeddings: bool = False
    # Group-limited routing (DeepSeek-V3 noaux_tc): keep the topk_group of n_group expert groups
    # with the highest sum of their two best biased scores, then the top-k experts among them.
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    rope_scaling: RopeScaling | None = None
    # The dtype the model's weights come in, which `--weight-dtype auto` keeps: a checkpoint's
    # own (fp8 when it is block-quantised); for a config's random weights, this field.
    weight_dtype: str = "f32"

    def __post_init__(self) -> None:
        _check_sizes(f"{self.name}: ", self, _MODEL_SIZES, _MODEL_COUNTS, _MODEL_FLOATS)
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(f"{self.name}: first_k_dense_replace={self.first_k_dense_replace} "
                              f"> num_hidden_layers={self.num_hidden_layers}")
        if self.n_routed_experts and not self.num_experts_per_tok:
            raise ConfigError(f"{self.name}: num_experts_per_tok=0 with n_routed_experts="
                              f"{self.n_routed_experts}; a MoE layer needs at least one")
        if len(self.indexer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"{self.name}: indexer_types has {len(self.indexer_types)} entries, "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        bad = [t for t in self.indexer_types if t not in INDEXER_TYPES]
        if bad:
            raise ConfigError(f"{self.name}: indexer_types {bad[0]!r} not in {INDEXER_TYPES}")
        if self.indexer_types[0] != "full":
            raise ConfigError(f"{self.name}: indexer_types[0] must be 'full' (a shared layer "
                              "reuses the selection of an earlier full layer)")
        if self.index_hadamard and self.index_head_dim & (self.index_head_dim - 1):
            raise ConfigError(f"{self.name}: index_head_dim={self.index_head_dim} must be a "
                              "power of two for the Hadamard rotation")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(f"{self.name}: qk_rope_head_dim={self.qk_rope_head_dim} must be "
                              "even and at most index_head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"{self.name}: num_experts_per_tok > n_routed_experts")
        if self.weight_dtype not in MODEL_WEIGHT_DTYPES:
            raise ConfigError(f"{self.name}: weight_dtype={self.weight_dtype!r} is not one of "
                              f"{MODEL_WEIGHT_DTYPES}")
        self._check_groups()

    def _check_groups(self) -> None:
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"{self.name}: need n_group={self.n_group} >= 1 and "
                              f"1 <= topk_group={self.topk_group} <= n_group")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"{self.name}: n_routed_experts={self.n_routed_experts} is not "
                              f"a multiple of n_group={self.n_group}")
        reachable = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > reachable:
            raise ConfigError(f"{self.name}: num_experts_per_tok={self.num_experts_per_tok} > "
                              f"{reachable} experts in topk_group={self.topk_group} groups")

    # Derived sizes (one place each).
    @property
    def latent_nope_pad(self) -> int:
        """Lanes of the cached latent `c`, padded to 128."""
        return _round_up(self.kv_lora_rank, LANES)

    @property
    def latent_rope_pad(self) -> int:
        """Lanes of the cached `k_pe`, padded to 128."""
        return _round_up(self.qk_rope_head_dim, LANES)

    @property
    def latent_dim(self) -> int:
        """D_lat_pad: width of one cached latent row `[c | k_pe]` (640 for GLM-5.2)."""
        return self.latent_nope_pad + self.latent_rope_pad

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Layer ids with an indexer (and an indexer cache)."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def num_full_layers(self) -> int:
        return len(self.full_layers)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's attention factor when rope is scaled."""
        if self.rope_scaling is None:
            return self.qk_head_dim ** -0.5
        return self.qk_head_dim ** -0.5 * self.rope_scaling.attention_mscale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.n_routed_experts > 0

    def indexer_slot(self, layer: int) -> int:
        """Index into the indexer cache of the `full` layer whose selection `layer` uses."""
        last = max(i for i in self.full_layers if i <= layer)
        return self.full_layers.index(last)


# --- The strategy: how a step runs, apart from how much it holds --------------------------------


class _Choice(enum.StrEnum):
    """A strategy knob's values: str-valued, so a TOML or command-line string is the value and
    a member compares equal to its string (and hashes as it), and shows as it."""

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, name: str, value: Any) -> Any:
        """The member named by `value` (a member or its string); ConfigError naming the knob."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not one of {cls.values()}") from None


class Backend(_Choice):
    """Which kernels run a step (cp_runtime.kernels.dispatch)."""
    AUTO = "auto"
    XLA = "xla"
    REFERENCE = "reference"
    PALLAS = "pallas"
    PALLAS_INTERPRET = "pallas_interpret"


class Merge(_Choice):
    """How attention partials meet (cp_runtime.parallel.collectives describes each)."""
    AUTO = "auto"
    GATHER_PSUM = "gather_psum"
    ALL_TO_ALL = "all_to_all"
    ALL_GATHER = "all_gather"
    HEAD_SCATTER = "head_scatter"
    HEAD_EXCHANGE = "head_exchange"
    HIDDEN_PSUM = "hidden_psum"


class Gathers(_Choice):
    AUTO = "auto"
    FLAT = "flat"
    STAGED = "staged"
    NATIVE = "native"


class Attention(_Choice):
    AUTO = "auto"
    GATHER_Q = "gather_q"
    GATHER_KV = "gather_kv"


class WireDtype(_Choice):
    AUTO = "auto"
    F32 = "f32"
    BF16 = "bf16"


class MlpRows(_Choice):
    AUTO = "auto"
    WIRE = "wire"
    FP8 = "fp8"


class IndexerScores(_Choice):
    AUTO = "auto"
    CACHE = "cache"
    FP8 = "fp8"


class TpuSchedule(_Choice):
    """How XLA:TPU's latency-hiding scheduler orders a step
    (cp_runtime.engine.step.compiler_options)."""
    OVERLAP = "overlap"
    XLA = "xla"


class Residual(_Choice):
    AUTO = "auto"
    REPLICATED = "replicated"


class RowAttention(_Choice):
    AUTO = "auto"
    HEADS = "heads"
    ROWS = "rows"
    WEIGHTS = "weights"


class ChunkHalves(_Choice):
    """Whether a chunk's rows run as two interleaved halves (cp_runtime.model.halves)."""
    AUTO = "auto"
    ON = "on"
    OFF = "off"


# Each knob's values, as the command line's choices and error messages list them.
BACKENDS = Backend.values()
MERGE_VARIANTS = Merge.values()
GATHER_MODES = Gathers.values()
ATTENTION_LAYOUTS = Attention.values()
RESIDUAL_MODES = Residual.values()
ROW_ATTENTION_MODES = RowAttention.values()
CHUNK_HALVES = ChunkHalves.values()
WIRE_DTYPE_CHOICES = WireDtype.values()
MLP_ROWS_CHOICES = MlpRows.values()
INDEXER_SCORES_CHOICES = IndexerScores.values()
TPU_SCHEDULES = TpuSchedule.values()


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How the runtime runs a step, each knob an enum (a string of its values converts on
    construction; a bad one raises ConfigError naming the knob). AUTO is resolved once, for a
    model and a platform, by `resolve_strategy` (its rules, and why, are there; a choice a
    step prices by its own shapes is in the function its comment names). RuntimeConfig holds
    one (`strategy`)."""

    # Which kernels run the step (cp_runtime.kernels.dispatch): "auto", pallas on a TPU, else
    # xla (resolved where the kernels are selected: `select_kernels`).
    backend: Backend = Backend.AUTO
    # How attention partials meet (cp_runtime.parallel.merge.resolve_merge prices "auto" per
    # step by the partials' bytes, the weights' split and the wire dtype).
    merge: Merge = Merge.AUTO
    # How the step's all-gathers run (selection candidates; all_gather merges): "flat", one
    # collective over every shard; "staged", groups of shards then the groups' results;
    # "native", on CPU the in-process gather (every shard in one process); "auto", on CPU
    # native where it can run for parts up to 8 KiB a shard, else staged with 8 or more
    # shards, else flat; flat elsewhere (cp_runtime.parallel.collectives).
    gathers: Gathers = Gathers.AUTO
    # Where a step's queries meet the position-sharded cache (cp_runtime.model.attention):
    # "gather_q", every shard gets every head of q and attends the pages it owns, and the
    # partials are merged (`merge`); "gather_kv", every shard gets the pages of the rows' page
    # tables and attends its own heads over all of them: no merge (weights split by head);
    # "auto", gather_kv where it moves fewer bytes (a prefill chunk of a long context) and
    # the heads split evenly, else gather_q (priced per step: cp_runtime.model.
    # attention_modes.attention_layout).
    attention: Attention = Attention.AUTO
    # The dtype split weights' activations cross the interconnect in (q heads, merge partials,
    # the joined partial sums of row-parallel matmuls and experts; cp_runtime.weights.shards):
    # "f32"; "bf16", half the bytes, each joined sum rounded to bf16; "auto", bf16 on a TPU and
    # f32 elsewhere (the CPU path stays the exact reference).
    wire_dtype: WireDtype = WireDtype.AUTO
    # How a prefill chunk's MLP rows are gathered and read where the residual stream is split
    # by row (`residual`): "fp8", as e4m3 values with one f32 scale a row, half the bytes of
    # bf16 on the interconnect and into the experts' kernel (each row routed before it is
    # rounded; cp_runtime.kernels.fp8_rows); "wire", in wire_dtype; "auto", fp8 on a TPU and wire
    # elsewhere (the CPU path stays the exact reference). Decode steps' rows are not split.
    mlp_rows: MlpRows = MlpRows.AUTO
    # How a prefill chunk's indexer scores its keys: "fp8", each query head and each key
    # rounded to e4m3 with its own f32 scale, multiplied at the MXU's fp8 rate (the rounding
    # DeepSeek-V3.2's reference indexer makes; the pool keeps its keys in their own dtype;
    # cp_runtime.kernels.indexer.quantized_scores_inputs); "cache", the queries against the
    # keys as the pool holds them; "auto", fp8 on a TPU and cache elsewhere (the CPU path stays
    # the exact reference). Decode steps, one query a row, read their keys as they are: their
    # cost is the keys' bytes, which rounding them first would only add to.
    indexer_scores: IndexerScores = IndexerScores.AUTO
    # How XLA:TPU schedules a step: "overlap", with its scheduler's memory-pressure tracking
    # off, so collectives and SparseCore transfers run beside compute although the pool fills
    # HBM (whether the program fits is still the compiler's own check); "xla", XLA's default,
    # which near its memory limit runs each of them alone. Programs for other devices ignore it.
    tpu_schedule: TpuSchedule = TpuSchedule.OVERLAP
    # The residual stream between layers: "auto", split by row over the shards where a step
    # runs gather_kv and its rows divide evenly (each device norms and projects its own rows;
    # the joined sums are reduce-scattered, what the heads and experts need all-gathered:
    # cp_runtime.weights.shards; decided per step: ShardAttention.splits_rows); "replicated",
    # every row on every device.
    residual: Residual = Residual.AUTO
    # Where a step splits its rows (`residual`): "heads", each shard attends its own heads of
    # every row; "rows", every head of its own rows (its heads of q and the outputs traded by
    # two all-to-alls; each page a block of queries reads then serves every head); "weights",
    # every head of its own rows from the head-split attention weights gathered whole; "auto",
    # the one the attention kernel's bound plus what each sends price lowest, per step
    # (cp_runtime.model.attention_modes.row_attention_mode: the heads early in a prompt).
    row_attention: RowAttention = RowAttention.AUTO
    # A prefill chunk as two halves of its rows, interleaved layer by layer so that each half's
    # all-gathers and reduce-scatters run beside the other half's compute (cp_runtime.model.
    # halves; every weight is then read twice a layer): "on", wherever each device attends
    # every head of its own rows (`row_attention` "weights") and each half's rows divide
    # evenly over the shards; "auto", the same on a TPU only (elsewhere nothing runs beside a
    # collective); "off".
    chunk_halves: ChunkHalves = ChunkHalves.AUTO

    def __post_init__(self) -> None:
        hints = _strategy_hints()
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, hints[f.name].parse(f.name, getattr(self, f.name)))


@functools.cache
def _strategy_hints() -> dict[str, type[_Choice]]:
    return typing.get_type_hints(Strategy)


# The strategy's knobs: flat keys of a runtime TOML file, keywords of RuntimeConfig(...) and
# dataclasses.replace(runtime, ...), and command-line flags, all of which land in `strategy`.
STRATEGY_KEYS = tuple(f.name for f in dataclasses.fields(Strategy))


@dataclasses.dataclass(frozen=True)
class ResolvedStrategy:
    """A Strategy with every choice that a model and a platform decide made (`resolve_strategy`).

    wire_dtype, mlp_rows, indexer_scores and chunk_halves are concrete. merge, gathers,
    attention, residual and row_attention pass through as given: their AUTO is a choice each
    step makes by its own shapes (the functions their Strategy comments name), not one a
    model and platform fix. backend passes through to `select_kernels`, which picks by the
    process's default device (an AOT compile for a TPU from a CPU host keeps xla)."""

    backend: Backend
    merge: Merge
    gathers: Gathers
    attention: Attention
    wire_dtype: WireDtype          # F32 or BF16
    mlp_rows: MlpRows              # WIRE or FP8
    indexer_scores: IndexerScores  # CACHE or FP8
    tpu_schedule: TpuSchedule
    residual: Residual
    row_attention: RowAttention
    chunk_halves: bool             # whether a chunk whose rows split may run as two halves
    platform: str                  # the devices' platform it was resolved for ("tpu", "cpu")


def resolve_strategy(strategy: Strategy, model: ModelConfig, platform: str) -> ResolvedStrategy:
    """`strategy` for `model` on devices of `platform` (jax's name: "tpu", "cpu", ...): the
    one place a knob's AUTO becomes a value. make_step calls it when it builds a step program
    (the engine's and the AOT compiler's alike). `model` is the model the step runs; no rule
    reads it yet."""
    del model
    tpu = platform == "tpu"
    return ResolvedStrategy(
        backend=strategy.backend, merge=strategy.merge, gathers=strategy.gathers,
        attention=strategy.attention, tpu_schedule=strategy.tpu_schedule,
        residual=strategy.residual, row_attention=strategy.row_attention,
        # bf16 on the interconnect halves what a TPU's collectives move; on the CPU the
        # exact f32 path is the reference the TPU's is checked against.
        wire_dtype=_auto(strategy.wire_dtype, WireDtype.BF16 if tpu else WireDtype.F32),
        # fp8 rows halve a TPU chunk's MLP gathers and its experts' reads; the CPU stays exact.
        mlp_rows=_auto(strategy.mlp_rows, MlpRows.FP8 if tpu else MlpRows.WIRE),
        # fp8 scores run at the MXU's fp8 rate, the rounding DeepSeek-V3.2's reference indexer
        # makes; the CPU scores the cache as it is (the exact path).
        indexer_scores=_auto(strategy.indexer_scores,
                             IndexerScores.FP8 if tpu else IndexerScores.CACHE),
        # Two halves pay off where each half's collectives run beside the other's compute:
        # on a TPU; on the CPU nothing runs beside a collective.
        chunk_halves=_auto(strategy.chunk_halves,
                           ChunkHalves.ON if tpu else ChunkHalves.OFF) == ChunkHalves.ON,
        platform=platform)


def _auto(choice: _Choice, auto: _Choice) -> _Choice:
    return auto if choice == "auto" else choice


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How much the runtime holds and runs (the model, dtypes, shards, pages, chunk, batch,
    selection, and the weights' mode and dtype, which cp_runtime.weights.format.
    resolve_runtime_weights fixes at load by the devices' memory), and how it runs a step:
    `strategy`, a Strategy.

    The strategy's knobs (STRATEGY_KEYS: backend, merge, gathers, attention, wire_dtype,
    mlp_rows, indexer_scores, tpu_schedule, residual, row_attention, chunk_halves) are flat
    everywhere a user writes them: keys at the top level of a runtime TOML file
    (`merge = "all_gather"`), a command's flag where it has one (`serve --merge
    all_gather`, `compile --row-attention rows`), and keywords
    here and in dataclasses.replace: `RuntimeConfig(merge="all_gather")` is
    `RuntimeConfig(strategy=Strategy(merge="all_gather"))`, and `replace(runtime,
    gathers="flat")` changes that knob of runtime.strategy alone. Code reads them from
    `runtime.strategy`, or resolved for a model and platform (`resolve_strategy`)."""

    model: str = "tiny"
    kv_cache_dtype: str = "fp8_e4m3"
    # What the DSA indexer selects for each query (cp_runtime.parallel.selection): "token", the
    # index_topk highest-scoring tokens at or before its position, the model as trained (what
    # DeepSeek's and Zhipu's reference code, transformers, vLLM and SGLang compute); "page",
    # its own page plus the index_topk / page_size earlier pages ranked by their best token, an
    # approximation that reads fewer, whole pages but serves a different model
    # (docs/architecture.md gives its measured distance from the reference).
    selection: str = "token"
    # Where each shard's latent cache lives: "device", in its HBM; "host", in its host's pinned
    # memory, a step moving only the pages it reads or writes to HBM (cp_runtime.cache.
    # host_pages): the cache then holds what the hosts' memory holds, at the cost of those
    # copies. The indexer cache stays on the device either way (every step scores all of it).
    latent_memory: str = "device"
    # With latent_memory "host": how many of each shard's page slots are held in HBM all the
    # same. Sessions take the lowest free slots, so these first; a step whose pages all lie
    # there runs the device pool's program over them (no copies from the host), and the
    # engine moves other sessions' pages to the host when a new prompt needs the room
    # (cp_runtime.engine.spill).
    latent_device_pages: int = 0
    page_size: int = 16
    num_shards: int = 16
    pages_per_shard: int = 64
    chunk_size: int = 64
    max_batch: int = 8
    # "replicated": every device holds the whole model; "sharded": each holds ~1/S of it
    # (cp_runtime.weights.sharding), which a model bigger than one device needs; "auto": sharded
    # when the whole model would take more than a quarter of a device's memory.
    weights: str = "auto"
    # "auto" (the model's own dtype), "fp8", "bf16" or "f32" (cp_runtime.weights.format).
    weight_dtype: str = "auto"
    # Sharded weights' routed experts in this many groups of whole experts, each group's
    # experts split by inner feature over num_shards / expert_groups shards: 1, every shard
    # holds a slice of every expert (a decode step's few experts read by all shards evenly);
    # more, each shard runs only its group's (token, expert) pairs of a prefill chunk, about
    # 1 / expert_groups of them (cp_runtime.model.expert_groups). Must divide num_shards.
    expert_groups: int = 1
    # Sharded weights' routed experts held in one group, and exchanged into this many groups
    # while long prompts prefill (cp_runtime.weights.regroup): before a step with a whole
    # chunk_size chunk every MoE layer's expert stacks go, layer by layer and in place, to
    # prefill_expert_groups groups (an all-to-all within blocks of that many shards), and they
    # come back to one group before the next step with no prefill. A prefill shard then runs
    # about 1 / N of its (token, expert) pairs, as in expert_groups N, while a decode step
    # reads every expert from every shard, as in one group. 1: never exchanged. Must divide
    # num_shards; needs expert_groups 1.
    prefill_expert_groups: int = 1
    key_block_pages: int = 64
    query_block: int = 64
    # Tokens one engine step may run (decode rows + one prefill chunk); absent: chunk_size +
    # max_batch, so a full chunk always rides along with a full decode batch.
    step_token_budget: int | None = None
    # Prefill tokens queued extends may hold before the next extend is refused as overloaded
    # (an extend into an empty queue is always taken); 0: no bound; absent: auto, what the
    # engine prefills in 10 s at its rate measured over the last minute, and at least 16 chunks
    # (cp_runtime.engine.core).
    max_queued_tokens: int | None = None
    # Sessions kept after stateless HTTP requests so later prompts reuse their cached prefix
    # (cp_runtime.engine.prefix_cache); the least recently used goes first when the pool is
    # short or there are more; 0: none kept.
    prefix_cache_entries: int = 64
    # Tokens one session may hold (its context and what a request would generate past it), as
    # vLLM's max_model_len; absent: the whole pool. It also bounds the page tables `serve`
    # compiles at start-up (cp_runtime.engine.precompile).
    max_model_len: int | None = None
    # How a step runs (the class docstring: its knobs are also flat keywords and TOML keys).
    strategy: Strategy = Strategy()

    @property
    def admission_bound(self) -> int:
        """max_queued_tokens, or the auto bound's floor (16 chunks) when absent; 0: none."""
        if self.max_queued_tokens is None:
            return 16 * self.chunk_size
        return self.max_queued_tokens

    def __post_init__(self) -> None:
        _check_sizes("", self, ("page_size", "num_shards", "pages_per_shard", "chunk_size",
                                "max_batch", "key_block_pages", "query_block"))
        _check_sizes("", self, ("expert_groups", "prefill_expert_groups"))
        for field in ("expert_groups", "prefill_expert_groups"):
            groups = getattr(self, field)
            if self.num_shards % groups:
                raise ConfigError(f"{field}={groups} must divide num_shards={self.num_shards}")
            if groups > 1 and self.weights == "replicated":
                raise ConfigError(f"{field}={groups} splits the experts over the shards: it "
                                  "needs weights='sharded', not 'replicated'")
        if self.expert_groups > 1 and self.prefill_expert_groups > 1:
            raise ConfigError(f"prefill_expert_groups={self.prefill_expert_groups} regroups "
                              "experts held in one group: it needs expert_groups=1, not "
                              f"{self.expert_groups}")
        if self.step_token_budget is not None:
            _check_sizes("", self, ("step_token_budget",))
        if self.max_queued_tokens is not None and (
                not isinstance(self.max_queued_tokens, int) or self.max_queued_tokens < 0):
            raise ConfigError(f"max_queued_tokens={self.max_queued_tokens!r} must be an "
                              "integer >= 0 (0: no bound)")
        if self.max_model_len is not None and (
                not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            raise ConfigError(f"max_model_len={self.max_model_len!r} must be a positive "
                              "integer (absent: the whole pool)")
        if not isinstance(self.prefix_cache_entries, int) or self.prefix_cache_entries < 0:
            raise ConfigError(f"prefix_cache_entries={self.prefix_cache_entries!r} must be an "
                              "integer >= 0 (0: none kept)")
        if self.page_size % 16:
            raise ConfigError(f"page_size={self.page_size} must be a positive multiple of 16")
        if not isinstance(self.strategy, Strategy):
            raise ConfigError(f"strategy={self.strategy!r} must be a Strategy")
        if self.strategy.attention == "gather_kv" and self.weights == "replicated":
            raise ConfigError("attention='gather_kv' needs weights split by head "
                              "(weights = 'sharded'), not 'replicated'")
        if self.weights not in WEIGHT_MODES:
            raise ConfigError(f"weights={self.weights!r} is not one of {WEIGHT_MODES}")
        if self.weight_dtype not in ("auto", *MODEL_WEIGHT_DTYPES):
            raise ConfigError(f"weight_dtype={self.weight_dtype!r} is not one of "
                              f"{('auto', *MODEL_WEIGHT_DTYPES)}")
        needs = {"head_scatter": "sharded", "head_exchange": "sharded",
                 "hidden_psum": "replicated"}.get(self.strategy.merge)
        if needs is not None and self.weights not in (needs, "auto"):
            raise ConfigError(f"merge={self.strategy.merge.value!r} needs weights={needs!r}, not "
                              f"{self.weights!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of "
                              f"{tuple(KV_CACHE_DTYPES)}")
        if self.selection not in SELECTIONS:
            raise ConfigError(f"selection={self.selection!r} is not one of {SELECTIONS}")
        if self.latent_memory not in LATENT_MEMORIES:
            raise ConfigError(f"latent_memory={self.latent_memory!r} is not one of "
                              f"{LATENT_MEMORIES}")
        if self.latent_device_pages and self.latent_memory != "host":
            raise ConfigError(f"latent_device_pages={self.latent_device_pages} needs "
                              f"latent_memory='host' (with 'device' every page is in HBM)")
        if not 0 <= self.latent_device_pages < self.pages_per_shard:
            raise ConfigError(f"latent_device_pages={self.latent_device_pages} must be at least "
                              f"0 and less than pages_per_shard={self.pages_per_shard}")



def _with_flat_strategy(init):
    """RuntimeConfig's __init__, also taking the strategy's knobs as flat keywords (the class
    docstring): they replace those knobs of `strategy` (given, else the default)."""
    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        knobs = {k: kwargs.pop(k) for k in STRATEGY_KEYS if k in kwargs}
        if knobs:
            base = kwargs.get("strategy", Strategy())
            if not isinstance(base, Strategy):
                raise ConfigError(f"strategy={base!r} must be a Strategy")
            kwargs["strategy"] = dataclasses.replace(base, **knobs)
        init(self, *args, **kwargs)
    return __init__


RuntimeConfig.__init__ = _with_flat_strategy(RuntimeConfig.__init__)  # type: ignore[method-assign]


def check_runtime_for_model(model: ModelConfig, runtime: RuntimeConfig,
                            path: str | pathlib.Path | None = None) -> None:
    """Raise ConfigError unless `runtime` can run `model`: runtime.model names it, and, in page
    selection, the model's index_topk is a whole number of runtime pages (it picks index_topk /
    page_size pages). `path`, the runtime file if it came from one, prefixes the message."""
    where = f"{path}: " if path is not None else ""
    if runtime.model != model.name:
        raise ConfigError(f"{where}field 'model'={runtime.model!r} but the model in use is "
                          f"{model.name!r}")
    if runtime.selection == "page" and model.index_topk % runtime.page_size:
        raise ConfigError(f"{where}field 'page_size'={runtime.page_size}: model {model.name}'s "
                          f"index_topk={model.index_topk} is not a positive multiple of it")


def _nested_dataclass(hint: Any) -> type | None:
    """The dataclass in a field type such as `RopeScaling | None`, if any."""
    for t in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(t):
            return t
    return None


def _check_type(path: pathlib.Path, name: str, value: Any, hint: Any) -> Any:
    """Coerce/validate one TOML value against a dataclass field type."""
    nested = _nested_dataclass(hint)
    if nested is not None:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: field {name!r} must be a table, got {value!r}")
        return _from_toml(nested, path, value, prefix=f"{name}.")
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: field {name!r} must be a list, got {value!r}")
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type) and issubclass(hint, _Choice):
        return value                   # a strategy knob: Strategy names a bad value
    expected = hint if isinstance(hint, type) else None
    if expected is not None and (not isinstance(value, expected)
                                 or (expected is int and isinstance(value, bool))):
        raise ConfigError(f"{path}: field {name!r} must be {expected.__name__}, got {value!r}")
    return value


def _from_toml(cls: type, path: pathlib.Path, data: dict[str, Any], prefix: str = "") -> Any:
    """Build `cls` from a TOML table; `prefix` names a nested table in messages."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{path}: unknown field {prefix + unknown[0]!r}")
    missing = [n for n, f in fields.items() if n not in data
               and f.default is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{path}: missing field {prefix + missing[0]!r}")
    values = {n: _check_type(path, prefix + n, v, hints[n]) for n, v in data.items()}
    try:
        return cls(**values)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _read_toml(path: pathlib.Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


def _expand_indexer_types(path: pathlib.Path, data: dict[str, Any]) -> dict[str, Any]:
    """`indexer_types` may be given as a list or as `indexer_full_layers` (the full ids)."""
    data = dict(data)
    if "indexer_full_layers" in data:
        if "indexer_types" in data:
            raise ConfigError(f"{path}: give indexer_types or indexer_full_layers, not both")
        ids = data.pop("indexer_full_layers")
        n = data.get("num_hidden_layers", 0)
        if not isinstance(n, int) or isinstance(n, bool):
            raise ConfigError(f"{path}: field 'num_hidden_layers' must be int, got {n!r}")
        if not isinstance(ids, list):
            raise ConfigError(f"{path}: field 'indexer_full_layers' must be a list, got {ids!r}")
        bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool)
               or not 0 <= i < n]
        if bad or len(set(ids)) != len(ids):
            raise ConfigError(f"{path}: field 'indexer_full_layers' must list distinct layer "
                              f"ids in [0, num_hidden_layers={n}); got "
                              f"{bad[0] if bad else 'a repeated id'!r}")
        full = set(ids)
        data["indexer_types"] = ["full" if i in full else "shared" for i in range(n)]
    return data


def model_names() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.toml"))


def load_model_config(name_or_path: str | pathlib.Path) -> ModelConfig:
    """Load `configs/models/<name>.toml`, or a TOML file given by path."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".toml":
        path = CONFIG_DIR / "models" / f"{name_or_path}.toml"
        if not path.exists():
            raise ConfigError(f"unknown model {name_or_path!r}; choices: {model_names()}")
    data = _expand_indexer_types(path, _read_toml(path))
    data.setdefault("name", path.stem)
    return _from_toml(ModelConfig, path, data)


def _runtime_from_toml(path: pathlib.Path, data: dict[str, Any]) -> RuntimeConfig:
    """A RuntimeConfig from a runtime file's table: the strategy's knobs are top-level keys
    (RuntimeConfig's docstring), gathered into its `strategy`."""
    if "strategy" in data:
        raise ConfigError(f"{path}: unknown field 'strategy' (the strategy's knobs are "
                          f"top-level keys: {', '.join(STRATEGY_KEYS)})")
    rest = {k: v for k, v in data.items() if k not in STRATEGY_KEYS}
    strategy = _from_toml(Strategy, path, {k: v for k, v in data.items() if k in STRATEGY_KEYS})
    try:
        return dataclasses.replace(_from_toml(RuntimeConfig, path, rest), strategy=strategy)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def load_runtime_config(path: str | pathlib.Path, model: ModelConfig | None = None,
                        defaults: dict[str, Any] | None = None,
                        **overrides: Any) -> RuntimeConfig:
    """Load a runtime TOML file over `defaults` (fields the file leaves out; else
    RuntimeConfig's own); keyword overrides win over the file. Given the `model` it will run,
    also `check_runtime_for_model` (errors name this file)."""
    path = pathlib.Path(path)
    data = {**(defaults or {}), **_read_toml(path),
            **{k: v for k, v in overrides.items() if v is not None}}
    runtime = _runtime_from_toml(path, data)
    if model is not None:
        check_runtime_for_model(model, runtime, path)
    return runtime
