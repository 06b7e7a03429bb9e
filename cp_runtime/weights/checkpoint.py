"""Read a Hugging Face DeepSeek-V3.2 or GLM-5 checkpoint directory: config, weights, tokenizer.

    config.json                       -> ModelConfig           (`read_hf_config`; model_type
                                         `deepseek_v32` or `glm_moe_dsa`; rope as `rope_theta`
                                         + `rope_scaling`, or `rope_parameters`; every key as
                                         transformers reads it)
    model.safetensors, or shards listed by model.safetensors.index.json (`weight_map`)
                                      -> Params, HF names      (`load_hf_params`)
    tokenizer.json (+ tokenizer_config.json for the BOS token) -> HFTokenizer (`load_tokenizer`)

fp8 block quantisation (config `quantization_config` {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [bo, bi]}): a weight `X.weight` f8_e4m3[out, in] comes with
`X.weight_scale_inv` f32[ceil(out / bo), ceil(in / bi)], and

    W[o, i] = f32(X.weight[o, i]) * X.weight_scale_inv[o // bo, i // bi]

(the last block of a row or column may be partial). The reader hands fp8 weights out as stored,
with their scales (cp_runtime.weights.fp8_blocks.HostBlock); whoever needs the values
dequantises, each weight one f32 product rounded once, the same bit for bit however the blocks
are walked. Scales stored in another float format (bf16, or e8m0 for the power-of-two
`scale_fmt: ue8m0`) are widened to f32 where they are used.

Files are read tensor by tensor from a memory map of each file, and only the tensors the config
needs (`cp_runtime.weights.params.param_shapes`): the multi-token-prediction layers a checkpoint
stores as `model.layers.{num_hidden_layers + i}` are never read. The safetensors layout is
parsed here (8-byte little-endian header length, JSON header, data) because the `safetensors`
package's numpy and flax loaders (0.8) look for `numpy.float8_e4m3fn`, which numpy lacks; JAX's
numpy dtypes (ml_dtypes) stand in for fp8 and bf16.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import struct
from typing import Any

import jax.numpy as jnp
import numpy as np

from cp_runtime.config import ConfigError, ModelConfig, RopeScaling
from cp_runtime.weights.fp8_blocks import HostBlock, to_stored
from cp_runtime.weights.params import Params, expert_sources, model_shapes, param_shapes

__all__ = [
    "CheckpointBlocks",
    "HFTokenizer",
    "check_tokenizer",
    "load_checkpoint",
    "load_hf_params",
    "load_tokenizer",
    "read_hf_config",
]

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)

# ModelConfig fields read from config.json, with transformers' meaning (its
# configuration_deepseek_v32.py / configuration_glm_moe_dsa.py and modeling files; the table
# key by key is docs/reference-semantics.md). Every family names them as ModelConfig does
# except where _RENAMED says otherwise. `first_k_dense_replace` and `indexer_types` are derived
# (`_first_k_dense`, `_indexer_types`), the rope from `rope_parameters` or `rope_theta` +
# `rope_scaling` (`_rope_settings`). `n_routed_experts` may come as `num_experts`, which wins,
# as in transformers.
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "index_n_heads", "index_head_dim", "index_topk", "intermediate_size",
             "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
             "n_shared_experts")
_OPTIONAL = ("rms_norm_eps", "routed_scaling_factor", "tie_word_embeddings",
             "n_group", "topk_group", "norm_topk_prob", "mla_rope_interleaved",
             "index_rope_interleaved")
# The one table of names that differ: {model_type: {ModelConfig field: config.json key}}.
# DeepSeek-V3.2 fixes both rope layouts (MLA pairs, indexer halves) and names neither.
# transformers' GlmMoeDsa reads neither of its keys either (it always interleaves, both);
# this reader honours them where a config states them (as vLLM and SGLang do), and takes
# transformers' layout where it does not (_DEFAULTS).
_RENAMED = {
    "deepseek_v32": {"mla_rope_interleaved": None, "index_rope_interleaved": None},
    "glm_moe_dsa": {"mla_rope_interleaved": "rope_interleave",
                    "index_rope_interleaved": "indexer_rope_interleave"},
}
# What each architecture takes for an _OPTIONAL field its config.json leaves out: transformers'
# class defaults (DeepseekV32Config, GlmMoeDsaConfig), and for the rope layouts its modeling
# files (MLA: interleaved pairs in both; indexer: halves in DeepSeek-V3.2, pairs in GLM-5).
# ModelConfig's own defaults are for its TOML files, not these.
_DEFAULTS = {
    "deepseek_v32": {"rms_norm_eps": 1e-6, "routed_scaling_factor": 2.5,
                     "tie_word_embeddings": False, "n_group": 8, "topk_group": 4,
                     "norm_topk_prob": True, "mla_rope_interleaved": True,
                     "index_rope_interleaved": False},
    "glm_moe_dsa": {"rms_norm_eps": 1e-5, "routed_scaling_factor": 2.5,
                    "tie_word_embeddings": False, "n_group": 1, "topk_group": 1,
                    "norm_topk_prob": True, "mla_rope_interleaved": True,
                    "index_rope_interleaved": True},
}
# transformers' defaults of the derived fields (both classes): leading dense layers, and
# GLM-5's indexer schedule (offset, frequency).
FIRST_K_DENSE_DEFAULT = 3
INDEX_SKIP_TOPK_OFFSET_DEFAULT = 2
# Settings the model implements one way only: (field, value when absent, the supported value).
# transformers reads none of the first four (sigmoid scores, noaux_tc group-limited top-k, an
# MoE layer wherever mlp_layer_types says "sparse"); a config that names another value
# describes a model neither transformers' class nor this runtime computes, and is refused.
_FIXED = (("scoring_func", "sigmoid", "sigmoid"), ("topk_method", "noaux_tc", "noaux_tc"),
          ("hidden_act", "silu", "silu"), ("moe_layer_freq", 1, 1),
          ("attention_bias", False, False))
_FLOATS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
# YaRN's fields as transformers reads them (`x or default` for the betas; a missing mscale or
# mscale_all_dim is 0, "not given", in RopeScaling.rope_mscale's rule).
_YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}
_YARN_MSCALES = ("mscale", "mscale_all_dim")

# safetensors dtype names -> numpy dtypes (JAX's for those numpy lacks); little-endian.
_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
           "BF16": np.dtype(jnp.bfloat16), "F8_E4M3": np.dtype(jnp.float8_e4m3fn),
           "F8_E5M2": np.dtype(jnp.float8_e5m2), "F8_E8M0": np.dtype(jnp.float8_e8m0fnu),
           "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
           "I8": np.dtype("i1"), "U64": np.dtype("<u8"), "U32": np.dtype("<u4"),
           "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
_QUANTIZED = ("F8_E4M3", "F8_E5M2")      # weights that come with a block scale
# A header longer than this is refused before it is read (the safetensors library's own bound).
MAX_HEADER_BYTES = 100 * 1000 * 1000


# -- config -------------------------------------------------------------------------------
def _rope_settings(hf: dict, where: str) -> tuple[float | None, dict | None]:
    """(rope_theta, the scaling table or None) as transformers takes them: a non-empty
    `rope_scaling` (the classic format) wins over `rope_parameters` (the newer table, which
    transformers 5 writes; type "default" is plain rope); rope_theta from the table, else the
    top-level `rope_theta` (else ModelConfig's 10000, transformers' default_theta)."""
    table = hf.get("rope_scaling") or hf.get("rope_parameters") or None
    if table is None:
        return hf.get("rope_theta"), None
    if not isinstance(table, dict) or any(isinstance(v, dict) for v in table.values()):
        raise ValueError(f"{where}: rope parameters {table!r} are not one flat table (rope "
                         "per layer type is not supported)")
    if table.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor={table['partial_rotary_factor']!r} "
                         "is not supported (only 1: rope on all qk_rope_head_dim dims)")
    kind = table.get("rope_type", table.get("type", "default"))
    theta = table.get("rope_theta", hf.get("rope_theta"))
    return theta, (None if kind == "default" else table)


def _rope_scaling(rs: dict | None, hf: dict, where: str) -> RopeScaling | None:
    """RopeScaling of a YaRN table, each field as transformers' _compute_yarn_parameters reads
    it: `original_max_position_embeddings` from the config's top level where it is there (that
    wins), else the table, else max_position_embeddings; `factor` required (transformers'
    validation refuses a YaRN table without it)."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "yarn":
        raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported (only 'yarn')")
    original = (hf.get("original_max_position_embeddings")
                or rs.get("original_max_position_embeddings")
                or hf.get("max_position_embeddings"))
    if original is None:
        raise ValueError(f"{where}: rope_scaling lacks 'original_max_position_embeddings' (and "
                         "the config has no 'max_position_embeddings')")
    factor = rs.get("factor")
    if factor is None:
        raise ValueError(f"{where}: rope_scaling lacks 'factor'")
    values = {k: float(rs.get(k) or default) for k, default in _YARN_BETAS.items()}
    values |= {k: float(rs.get(k) or 0.0) for k in _YARN_MSCALES}
    if rs.get("attention_factor") is not None:
        values["attention_factor"] = float(rs["attention_factor"])
    try:
        return RopeScaling(factor=float(factor), original_max_position_embeddings=int(original),
                           truncate=bool(rs.get("truncate", True)), **values)
    except ConfigError as e:
        raise ValueError(f"{where}: {e}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _indexer_types(hf: dict, kind: str, layers: int, where: str) -> tuple[str, ...]:
    """Which layers carry an indexer, as transformers derives GlmMoeDsaConfig.indexer_types;
    the first rule that applies wins:

    1. DeepSeek-V3.2: every layer (its class has no shared indexers, and ignores these keys);
    2. an explicit `indexer_types` list ("full" / "shared" per layer);
    3. an `index_topk_pattern`: a string of F (full) and S (shared), one a layer, or a list;
    4. GLM-5's schedule `index_topk_freq` f (default 1, at least 1) with
       `index_skip_topk_offset` o (default 2): layer i is full iff max(i - o + 1, 0) % f == 0
       (o = 3, f = 4 over 78 layers: 0, 1, 2, 6, 10, ..., 74); with neither, every layer.
    """
    if kind == "deepseek_v32":
        return ("full",) * layers
    if hf.get("indexer_types") is not None:
        return tuple(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            bad = sorted(set(pattern) - {"F", "S"})
            if bad:
                raise ValueError(f"{where}: index_topk_pattern={pattern!r} has {bad[0]!r}; "
                                 "only F (full) and S (shared)")
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        if isinstance(pattern, list):
            return tuple(pattern)
        raise ValueError(f"{where}: index_topk_pattern={pattern!r} is neither a string of F "
                         "and S nor a list")
    freq = hf.get("index_topk_freq")
    offset = hf.get("index_skip_topk_offset")
    freq = 1 if freq is None else freq
    offset = INDEX_SKIP_TOPK_OFFSET_DEFAULT if offset is None else offset
    if not _is_int(freq):
        raise ValueError(f"{where}: index_topk_freq={freq!r} must be an integer")
    if not _is_int(offset):
        raise ValueError(f"{where}: index_skip_topk_offset={offset!r} must be an integer")
    freq = max(freq, 1)                                     # transformers' max(freq, 1)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(layers))


def _first_k_dense(hf: dict, layers: int, where: str) -> int:
    """Leading dense-MLP layers as transformers derives mlp_layer_types: an explicit
    `mlp_layer_types` wins (it must be dense layers then sparse ones: this runtime's layout),
    else `first_k_dense_replace` (default 3), at most num_hidden_layers."""
    types = hf.get("mlp_layer_types")
    if types is None:
        given = hf.get("first_k_dense_replace")
        given = FIRST_K_DENSE_DEFAULT if given is None else given
        if not _is_int(given) or given < 0:
            raise ValueError(f"{where}: first_k_dense_replace={given!r} must be an integer "
                             ">= 0")
        return min(given, layers)
    k = next((i for i, t in enumerate(types) if t != "dense"), len(types))
    if len(types) != layers or any(t != "sparse" for t in types[k:]):
        raise ValueError(f"{where}: mlp_layer_types must be {layers} entries, 'dense' ones then "
                         f"'sparse' ones; got {types!r}")
    return k


def _weight_dtype(hf: dict) -> str:
    """The checkpoint's own weight dtype: fp8 when `quantization_config` block-quantises it,
    else its `dtype` (transformers 5's name) or `torch_dtype` (4.x's; bf16 when neither)."""
    if hf.get("quantization_config"):
        return "fp8"
    dtype = hf.get("dtype") or hf.get("torch_dtype")
    return "f32" if dtype == "float32" else "bf16"


def read_hf_config(model_dir: str | pathlib.Path) -> ModelConfig:
    """ModelConfig of a DeepSeek-V3.2 (`deepseek_v32`) or GLM-5 (`glm_moe_dsa`) checkpoint
    directory's config.json; named after the directory. Every key means what it means to
    transformers' class for the model_type, defaults included (`_DEFAULTS`;
    docs/reference-semantics.md). GLM-5's names that differ from DeepSeek's are mapped by
    `_RENAMED`; its indexer schedule and dense layers are derived by `_indexer_types` and
    `_first_k_dense`. Raises ValueError naming a missing field or an unsupported setting."""
    d = pathlib.Path(model_dir)
    path = d / "config.json"
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return _model_config(hf, d.name, where=str(path))


def _model_config(hf: dict[str, Any], name: str, where: str) -> ModelConfig:
    """ModelConfig from a config.json dict; `where` prefixes error messages."""
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type {kind!r} is not supported "
                         f"(expected one of {MODEL_TYPES})")
    if hf.get("num_experts") is not None:          # transformers' BC name: it wins
        hf = {**hf, "n_routed_experts": hf["num_experts"]}
    missing = [k for k in _REQUIRED if hf.get(k) is None]
    if missing:
        raise ValueError(f"{where}: lacks required field {missing[0]!r}"
                         + (f" (and {missing[1:]})" if missing[1:] else ""))
    for field, default, supported in _FIXED:
        if hf.get(field, default) != supported:
            raise ValueError(f"{where}: {field}={hf[field]!r} is not supported "
                             f"(only {supported!r})")
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != hf["num_attention_heads"]:
        # MLA expands the latent to every head: transformers' classes fail on fewer.
        raise ValueError(f"{where}: num_key_value_heads={kv_heads!r} differs from "
                         f"num_attention_heads={hf['num_attention_heads']!r} (MLA has one "
                         "key and value per head)")
    theta, scaling = _rope_settings(hf, where)
    values = {k: hf[k] for k in _REQUIRED}
    keys = {k: _RENAMED[kind].get(k, k) for k in _OPTIONAL}
    values |= {k: hf[key] if key and hf.get(key) is not None else _DEFAULTS[kind][k]
               for k, key in keys.items()}
    if theta is not None:
        values["rope_theta"] = theta
    values |= {k: float(values[k]) for k in _FLOATS if k in values}     # JSON may write 10000
    layers = hf["num_hidden_layers"]
    values["weight_dtype"] = _weight_dtype(hf)
    values["indexer_types"] = _indexer_types(hf, kind, layers, where)
    values["first_k_dense_replace"] = _first_k_dense(hf, layers, where)
    try:
        return ModelConfig(name=name, rope_scaling=_rope_scaling(scaling, hf, where),
                           **values)
    except ConfigError as e:                 # an inconsistent combination of fields
        raise ValueError(f"{where}: {e}") from None


# -- weights ------------------------------------------------------------------------------
def _read_header(path: pathlib.Path) -> tuple[dict[str, dict], int]:
    """({tensor name: {"dtype", "shape", "data_offsets"}}, byte where the data starts) of a
    .safetensors file, checked before anything in it is trusted: the 8-byte header length is at
    most MAX_HEADER_BYTES and fits the file, the header is a JSON object, every entry is valid
    (`_check_entry`) and the entries tile the data section exactly (`_check_layout`). Raises
    ValueError naming the file (and the tensor)."""
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path}: {size} bytes, too short for the 8-byte header length")
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: header length {n} exceeds "
                             + (f"the {MAX_HEADER_BYTES}-byte limit" if n > MAX_HEADER_BYTES
                                else f"the {size - 8} bytes after it (truncated file?)"))
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    if not isinstance(header.pop("__metadata__", {}), dict):
        raise ValueError(f"{path}: header '__metadata__' is not an object")
    for name, info in header.items():
        _check_entry(path, name, info)
    _check_layout(path, header, size - 8 - n)
    return header, 8 + n


def _is_index(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_entry(path: pathlib.Path, name: str, info: Any) -> None:
    """One header entry: a known dtype name, a shape of ints >= 0, data_offsets [begin, end]
    with begin <= end, and end - begin = prod(shape) * itemsize."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: header entry is {info!r}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    if not isinstance(shape, list) or not all(map(_is_index, shape)):
        raise ValueError(f"{where}: shape {shape!r} is not a list of integers >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_index, offsets))
            or offsets[0] > offsets[1]):
        raise ValueError(f"{where}: data_offsets {offsets!r} is not [begin, end] with "
                         "0 <= begin <= end")
    want = math.prod(shape) * _DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != want:
        raise ValueError(f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} "
                         f"bytes; {dtype} {shape} needs {want}")


def _check_layout(path: pathlib.Path, header: dict[str, dict], data_bytes: int) -> None:
    """The entries, by begin offset, cover [0, data_bytes) with no gap and no overlap."""
    end, last = 0, None
    for name, info in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, stop = info["data_offsets"]
        if begin < end:
            raise ValueError(f"{path}: tensor {name!r} at bytes [{begin}, {stop}) overlaps "
                             f"tensor {last!r}, which ends at {end}")
        if begin > end:
            raise ValueError(f"{path}: tensor {name!r} starts at byte {begin}, leaving a gap "
                             f"after byte {end}" + (f" (the end of {last!r})" if last else ""))
        if stop > data_bytes:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {stop}, past the "
                             f"{data_bytes}-byte data section (truncated file?)")
        end, last = stop, name
    if end != data_bytes:
        raise ValueError(f"{path}: {data_bytes - end} bytes after the last tensor "
                         f"{last!r} belong to no tensor")


class _SafetensorsFile:
    """One .safetensors file: its checked header, and tensors read one at a time from a memory
    map."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.header, start = _read_header(path)
        empty = path.stat().st_size == start                   # mmap refuses zero bytes
        self._map = (np.zeros(0, np.uint8) if empty
                     else np.memmap(path, dtype=np.uint8, mode="r", offset=start))

    def dtype_name(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def read(self, name: str, axis: int | None = None, lo: int = 0,
             hi: int | None = None) -> np.ndarray:
        """The tensor `name` (or its elements lo..hi along `axis`) as a fresh array of its
        stored dtype. Only the bytes of that range are copied out of the map: rows are one
        contiguous run, a column range one run per row."""
        info = self.header[name]
        start, end = info["data_offsets"]
        whole = self._map[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        if axis is None:
            return np.array(whole)                                # copy: one tensor in memory
        index = [slice(None)] * whole.ndim
        index[axis] = slice(lo, hi)
        return np.array(whole[tuple(index)])


def _weight_map(d: pathlib.Path) -> tuple[dict[str, str], str]:
    """({tensor name: file name}, where the map came from): the index, or the single file."""
    if (d / INDEX_FILE).exists():
        index = json.loads((d / INDEX_FILE).read_text())
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{d / INDEX_FILE}: no 'weight_map' table")
        return index["weight_map"], INDEX_FILE
    if (d / SINGLE_FILE).exists():
        return dict.fromkeys(_SafetensorsFile(d / SINGLE_FILE).header, SINGLE_FILE), SINGLE_FILE
    raise ValueError(f"{d}: neither {SINGLE_FILE} nor {INDEX_FILE}")


def _block_size(d: pathlib.Path) -> tuple[int, int]:
    """fp8 weight block [out, in] from config.json's quantization_config."""
    q = json.loads((d / "config.json").read_text()).get("quantization_config") or {}
    if q and (q.get("quant_method"), q.get("fmt", "e4m3")) != ("fp8", "e4m3"):
        raise ValueError(f"{d / 'config.json'}: quantization_config {q} is not supported "
                         "(only quant_method 'fp8' with fmt 'e4m3')")
    bo, bi = q.get("weight_block_size", DEFAULT_BLOCK)
    return int(bo), int(bi)


class _Reader:
    """Reads tensors by HF name across the checkpoint's files, opening each file once."""

    def __init__(self, d: pathlib.Path):
        self.dir = d
        self.weight_map, self.source = _weight_map(d)
        self.block = _block_size(d)
        self._files: dict[str, _SafetensorsFile] = {}

    def _file_of(self, name: str, needed_by: str) -> _SafetensorsFile:
        fname = self.weight_map.get(name)
        if fname is None:
            raise ValueError(f"{self.dir / self.source}: missing tensor {name!r}" + (
                f" (the scale of {needed_by!r})" if needed_by != name else ""))
        if fname not in self._files:
            if not (self.dir / fname).exists():
                raise ValueError(f"{self.dir}: shard file {fname!r} (holding {name!r}) is "
                                 "missing")
            self._files[fname] = _SafetensorsFile(self.dir / fname)
        f = self._files[fname]
        if name not in f.header:
            raise ValueError(f"{f.path}: tensor {name!r} is listed for this file but absent")
        return f

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file_of(name, name).shape(name)

    def read(self, name: str, axis: int | None = None, lo: int = 0,
             hi: int | None = None) -> HostBlock:
        """Tensor `name` (or its elements lo..hi along `axis`) as stored; an fp8 weight comes
        with its whole block-scale table. Only that range's bytes are read."""
        f = self._file_of(name, name)
        w = f.read(name, axis, lo, hi)
        if f.dtype_name(name) not in _QUANTIZED:
            return HostBlock(w)
        if w.ndim != 2:
            raise ValueError(f"{f.path}: fp8 tensor {name!r} has shape {w.shape}; block "
                             "scales need a 2-D weight")
        scale_name = name + SCALE_SUFFIX
        sf = self._file_of(scale_name, name)
        scale = sf.read(scale_name)
        want = tuple(math.ceil(n / b) for n, b in zip(f.shape(name), self.block))
        if scale.shape != want:
            raise ValueError(f"{sf.path}: {scale_name!r} has shape {scale.shape}; weight "
                             f"{f.shape(name)} in blocks of {list(self.block)} needs {want}")
        first = (lo if axis == 0 else 0, lo if axis == 1 else 0)
        return HostBlock(w, scale, self.block, first)


class CheckpointBlocks:
    """A checkpoint as a block source (cp_runtime.weights.placement): model-layout shapes, and
    any range of one tensor read from the files alone. Construction checks every tensor's shape
    from the headers, reading no weight."""

    def __init__(self, model_dir: str | pathlib.Path, cfg: ModelConfig):
        self.reader = _Reader(pathlib.Path(model_dir))
        self.model = cfg
        self.shapes = model_shapes(cfg)
        self.block = self.reader.block            # [out, in] values per fp8 scale
        for name, shape in param_shapes(cfg).items():
            got = self.reader.shape(name)
            if got != shape:
                fname = self.reader.weight_map[name]
                raise ValueError(f"{self.reader.dir / fname}: tensor {name!r} has shape {got}, "
                                 f"config {cfg.name} needs {shape}")

    def read(self, name: str, axis: int | None, lo: int, hi: int,
             experts: tuple[int, int] | None = None) -> HostBlock:
        """Elements lo..hi along `axis` of model-layout tensor `name` (all when axis is None),
        as stored (fp8 with its scales). A stack of experts [E, a, b] reads experts lo..hi
        (axis 0) or elements lo..hi of every expert's axis 1 or 2 (of experts
        experts[0]..experts[1] only, where given), each expert's HF [b, a] part transposed
        into the stack, scales, block and first element too."""
        sources = expert_sources(name, self.model)
        if sources is None:
            return self.reader.read(name, axis, lo, hi)
        experts = sources if experts is None else sources[experts[0]:experts[1]]
        if axis in (None, 0):
            chosen = experts if axis is None else experts[lo:hi]
            parts = [self.reader.read(e) for e in chosen]
        else:                              # model axes 1, 2 are the HF tensor's axes 1, 0
            parts = [self.reader.read(e, 2 - axis, lo, hi) for e in experts]
        if not parts:
            return HostBlock(np.zeros((0, *self.shapes[name][1:]), np.float32))
        values = np.stack([p.values.T for p in parts])
        if parts[0].scales is None:
            return HostBlock(values)
        return HostBlock(values, np.stack([p.scales.T for p in parts]), parts[0].block[::-1],
                         parts[0].first[::-1])


def load_hf_params(model_dir: str | pathlib.Path, cfg: ModelConfig,
                   dtype=jnp.float32) -> Params:
    """The tensors `cfg` needs, by HF name, dequantised and cast to `dtype`. Raises ValueError
    naming the tensor and file for a missing tensor, shard file or scale, or a wrong shape."""
    reader = _Reader(pathlib.Path(model_dir))
    params = {}
    for name, shape in param_shapes(cfg).items():
        x = to_stored(reader.read(name), "f32", None)[0]
        if x.shape != shape:
            fname = reader.weight_map[name]
            raise ValueError(f"{reader.dir / fname}: tensor {name!r} has shape {x.shape}, "
                             f"config {cfg.name} needs {shape}")
        params[name] = jnp.asarray(x, dtype)
    return params


# -- tokenizer ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HFTokenizer:
    """A `tokenizers.Tokenizer` and the BOS id to put before a document (None: no BOS)."""

    tokenizer: Any
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def _bos_token(d: pathlib.Path) -> str | None:
    """The BOS token text from tokenizer_config.json (a string or an AddedToken dict)."""
    path = d / "tokenizer_config.json"
    if not path.exists():
        return None
    tc = json.loads(path.read_text())
    bos = tc.get("bos_token")
    if not tc.get("add_bos_token", True) or bos is None:
        return None
    return bos["content"] if isinstance(bos, dict) else bos


def load_tokenizer(model_dir: str | pathlib.Path) -> HFTokenizer:
    """The checkpoint's tokenizer.json, with the BOS token of tokenizer_config.json."""
    try:
        # Imported here: only checkpoint runs need the optional `hf` extra.
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("reading a checkpoint's tokenizer needs the `tokenizers` package: "
                         "pip install 'cp-runtime[hf]'") from None
    d = pathlib.Path(model_dir)
    if not (d / "tokenizer.json").exists():
        raise ValueError(f"{d}: no tokenizer.json (a fast-tokenizer file is required; "
                         "tokenizer.model alone is not supported)")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    bos = _bos_token(d)
    bos_id = None if bos is None else tok.token_to_id(bos)
    if bos is not None and bos_id is None:
        raise ValueError(f"{d / 'tokenizer_config.json'}: bos_token {bos!r} is not in "
                         "tokenizer.json's vocabulary")
    return HFTokenizer(tok, bos_id)


def load_checkpoint(model_dir: str | pathlib.Path, dtype=jnp.float32
                    ) -> tuple[ModelConfig, Params, HFTokenizer]:
    """Config, weights and tokenizer of a checkpoint directory."""
    d = pathlib.Path(model_dir)
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory")
    cfg = read_hf_config(d)
    tokenizer = load_tokenizer(d)
    check_tokenizer(d, cfg, tokenizer)
    return cfg, load_hf_params(d, cfg, dtype), tokenizer


def check_tokenizer(model_dir: str | pathlib.Path, cfg: ModelConfig,
                    tokenizer: HFTokenizer) -> None:
    """Raise ValueError when the tokenizer has ids the model has no embedding for."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"{model_dir}: the tokenizer has {tokenizer.vocab_size} tokens, the "
                         f"model's vocab_size is {cfg.vocab_size}")
