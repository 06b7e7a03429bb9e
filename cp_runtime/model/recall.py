"""A hand-built retrieval model: the DSA-MLA architecture with weights set by hand, no training.

What it measures: the runtime's retrieval path. A query token can only answer if (1) the DSA
indexer puts the needle into the query's top-k tokens (its page among the top pages in page
selection) and (2) the sparse MLA attention,
reading the paged, sharded, possibly fp8 latent cache, picks the needle's latent row out of
those pages. Recall on this model is recall of that path: the selection, the context-parallel
top-K and merge, and the cache's precision. What it does not measure: language ability, or how
a trained model spreads retrieval over layers and heads. Good recall here is necessary for a
real model to recall through the runtime, never sufficient.

Tokens (`RecallLayout`; ids in this order):
    filler          haystack: a weak random key and a noise vector
    hub             a token the indexer scores above any fact (like a trained model's sink
                    tokens) but whose latent the attention ignores: it only uses up top-K slots
    fact(k, v)      key k and value v, the "needle"
    query(k)        asks for the value stored under key k; the next token should be answer(v)
    answer(v)

Keys are unit vectors in `key_dim` dimensions, zero-mean (so the indexer's LayerNorm only
rescales them). They come in `len(rhos)` levels; level `rho` holds clusters of keys whose
pairwise cosine is `rho` on average (orthonormal cluster centres c, random offsets n orthogonal
to c, u = sqrt(rho) c + sqrt(1 - rho) n). A needle's distractors are its cluster siblings with
other values.

Weights (one layer, MLP zero, every RoPE part zero, so positions play no part):
    MLA      c = RMSNorm([u | e_v | noise]) (a fact: its key, its value one-hot, no noise);
             q_lat = beta [u_query | 0 | 0], beta set so a query scores its own fact at
             `target_logit`; a sibling at rho scores rho * target_logit. W_uv reads e_v,
             o_proj writes it into the residual's value block, lm_head maps value j to answer(j).
    indexer  k = LayerNorm([0_rope | u | noise]), q = [0_rope | u_query | hub_gain * h_hub],
             w constant: facts score in proportion to the key cosine, hubs hub_gain times a
             perfect fact, filler near zero.

Why the path is required: a query attends its `index_topk` best-scoring tokens (in page
selection, its own page plus the top `index_topk // page_size` earlier pages); a needle is read
only if the indexer selected it. With the indexer blinded (weights_proj = 0, every key scores
0, ties go to the earliest positions) or with `hub` tokens filling the top-k, recall falls to
zero: the query reads filler, and every answer
token gets the same logit (tests/model/test_recall.py).

Why precision matters: the needle and a sibling at cosine rho differ by
target_logit * (1 - rho) in the attention logit (1.3 at rho = 0.98, target 64). Rounding the
latent row of a key that matches the query moves its logit by (std, measured over all keys):
0.035 in bf16, 0.49 in fp8_e4m3, 0.91 in fp8_e5m2. So with close siblings in the context, e5m2
(and less often e4m3) hands the answer to a sibling where bf16 keeps it; benchmarks/niah.py's
`distract` variant measures how often.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from cp_runtime.config import ModelConfig, load_model_config
from cp_runtime.model.attention_inputs import mla_inputs
from cp_runtime.model.ops import rms_norm
from cp_runtime.weights.params import Params, layer_params, param_shapes

__all__ = ["RecallLayout", "RecallModel", "build_recall_model"]


@dataclasses.dataclass(frozen=True)
class RecallLayout:
    """Token ids and hidden-state blocks of the recall model; the config must match it.

    hidden = [fact key | query key | value | noise | flags]  (flag 0 is a constant 1)
    """

    key_dim: int = 32
    n_values: int = 32
    noise_dim: int = 16
    flag_dim: int = 16
    n_filler: int = 256
    rhos: tuple[float, ...] = (0.9, 0.95, 0.98)
    clusters_per_level: int = 10
    keys_per_cluster: int = 8

    def __post_init__(self) -> None:
        if self.clusters_per_level * len(self.rhos) > self.key_dim - 1:
            raise ValueError(f"{len(self.rhos)} levels x {self.clusters_per_level} clusters need "
                             f"that many orthonormal zero-mean centres; key_dim={self.key_dim} "
                             f"gives {self.key_dim - 1}")
        if not all(0.0 < r < 1.0 for r in self.rhos):
            raise ValueError(f"rhos={self.rhos} must lie in (0, 1)")

    # -- sizes ----------------------------------------------------------------------------
    @property
    def n_keys(self) -> int:
        return len(self.rhos) * self.clusters_per_level * self.keys_per_cluster

    @property
    def hidden_size(self) -> int:
        return 2 * self.key_dim + self.n_values + self.noise_dim + self.flag_dim

    @property
    def kv_lora_rank(self) -> int:
        return self.key_dim + self.n_values + self.noise_dim

    @property
    def q_lora_rank(self) -> int:
        return self.key_dim + self.flag_dim

    def index_head_dim(self, rope_dim: int) -> int:
        return rope_dim + self.key_dim + self.noise_dim

    # -- hidden blocks --------------------------------------------------------------------
    @property
    def fact_key(self) -> slice:
        return slice(0, self.key_dim)

    @property
    def query_key(self) -> slice:
        return slice(self.key_dim, 2 * self.key_dim)

    @property
    def value(self) -> slice:
        return slice(2 * self.key_dim, 2 * self.key_dim + self.n_values)

    @property
    def noise(self) -> slice:
        start = 2 * self.key_dim + self.n_values
        return slice(start, start + self.noise_dim)

    @property
    def bias(self) -> int:
        """The flag that is 1 for every token."""
        return 2 * self.key_dim + self.n_values + self.noise_dim

    # -- token ids ------------------------------------------------------------------------
    @property
    def hub(self) -> int:
        return self.n_filler

    @property
    def _fact0(self) -> int:
        return self.n_filler + 1

    @property
    def _query0(self) -> int:
        return self._fact0 + self.n_keys * self.n_values

    @property
    def _answer0(self) -> int:
        return self._query0 + self.n_keys

    @property
    def vocab_size(self) -> int:
        return self._answer0 + self.n_values

    def fact(self, key: int, value: int) -> int:
        self._check_key(key)
        if not 0 <= value < self.n_values:
            raise ValueError(f"value {value} outside [0, {self.n_values})")
        return self._fact0 + key * self.n_values + value

    def query(self, key: int) -> int:
        self._check_key(key)
        return self._query0 + key

    def answer(self, value: int) -> int:
        if not 0 <= value < self.n_values:
            raise ValueError(f"value {value} outside [0, {self.n_values})")
        return self._answer0 + value

    @property
    def answer_ids(self) -> range:
        return range(self._answer0, self._answer0 + self.n_values)

    def filler(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n random filler token ids, i32[n]."""
        return rng.integers(0, self.n_filler, size=n, dtype=np.int32)

    # -- keys -----------------------------------------------------------------------------
    def key_id(self, level: int, cluster: int, member: int) -> int:
        if not (0 <= level < len(self.rhos) and 0 <= cluster < self.clusters_per_level
                and 0 <= member < self.keys_per_cluster):
            raise ValueError(f"no key ({level=}, {cluster=}, {member=})")
        return (level * self.clusters_per_level + cluster) * self.keys_per_cluster + member

    def level_of(self, key: int) -> int:
        self._check_key(key)
        return key // (self.clusters_per_level * self.keys_per_cluster)

    def siblings(self, key: int) -> list[int]:
        """The other keys of `key`'s cluster (cosine rho to it)."""
        self._check_key(key)
        first = key - key % self.keys_per_cluster
        return [k for k in range(first, first + self.keys_per_cluster) if k != key]

    def _check_key(self, key: int) -> None:
        if not 0 <= key < self.n_keys:
            raise ValueError(f"key {key} outside [0, {self.n_keys})")

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the first config size that disagrees with this layout."""
        want = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.key_dim,
            "v_head_dim": self.n_values,
            "index_head_dim": self.index_head_dim(cfg.qk_rope_head_dim),
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "index_n_heads": 1,
        }
        for name, value in want.items():
            if getattr(cfg, name) != value:
                raise ValueError(f"config {cfg.name}: {name}={getattr(cfg, name)}, the recall "
                                 f"layout needs {value}")
        if cfg.is_moe_layer(0) or cfg.indexer_types != ("full",) or cfg.tie_word_embeddings:
            raise ValueError(f"config {cfg.name}: the recall model is one dense layer with a "
                             "full indexer and an untied lm_head")


@dataclasses.dataclass(frozen=True)
class RecallModel:
    """Config, layout and weights; `keys` f32[n_keys, key_dim] are the unit fact keys."""

    cfg: ModelConfig
    layout: RecallLayout
    params: Params
    keys: np.ndarray

    def key_cosine(self, a: int, b: int) -> float:
        return float(self.keys[a] @ self.keys[b])


def _zero_mean_basis(rng: np.random.Generator, dim: int, count: int) -> np.ndarray:
    """`count` orthonormal zero-mean vectors f64[count, dim]."""
    raw = rng.standard_normal((dim, count))
    raw -= raw.mean(0, keepdims=True)                               # project out the all-ones
    q, _ = np.linalg.qr(raw)                                        # [dim, count]
    return q.T


def _unit_zero_mean(rng: np.random.Generator, n: int, dim: int,
                    orthogonal_to: np.ndarray | None = None) -> np.ndarray:
    """n random unit vectors f64[n, dim], zero-mean (and orthogonal to one unit vector)."""
    x = rng.standard_normal((n, dim))
    x -= x.mean(-1, keepdims=True)
    if orthogonal_to is not None:
        x -= np.outer(x @ orthogonal_to, orthogonal_to)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _fact_keys(layout: RecallLayout, rng: np.random.Generator) -> np.ndarray:
    """Unit keys f64[n_keys, key_dim]: u = sqrt(rho) c + sqrt(1 - rho) n, c the cluster's
    centre (orthonormal across clusters), n a random unit offset orthogonal to c. Two keys of a
    cluster have cosine rho + (1 - rho) n.n' (rho on average, spread (1 - rho) / sqrt(key_dim):
    no exact ties, so a ranking among siblings is decided by the keys, not by tie-breaking)."""
    n_clusters = len(layout.rhos) * layout.clusters_per_level
    centres = _zero_mean_basis(rng, layout.key_dim, n_clusters)    # [clusters, key_dim]
    keys = np.zeros((layout.n_keys, layout.key_dim))
    for c in range(n_clusters):
        rho = layout.rhos[c // layout.clusters_per_level]
        offsets = _unit_zero_mean(rng, layout.keys_per_cluster, layout.key_dim, centres[c])
        first = c * layout.keys_per_cluster
        keys[first: first + layout.keys_per_cluster] = (np.sqrt(rho) * centres[c]
                                                        + np.sqrt(1 - rho) * offsets)
    return keys


def _embeddings(layout: RecallLayout, keys: np.ndarray, hub_dir: np.ndarray,
                rng: np.random.Generator, filler_key_strength: float) -> np.ndarray:
    """The embedding table f64[vocab, hidden]."""
    emb = np.zeros((layout.vocab_size, layout.hidden_size))
    emb[:, layout.bias] = 1.0
    # Filler: a weak random key (so scores are noisy, not all zero) and a noise vector that
    # neither the MLA query nor the indexer query reads.
    emb[: layout.n_filler, layout.fact_key] = filler_key_strength * _unit_zero_mean(
        rng, layout.n_filler, layout.key_dim)
    emb[: layout.n_filler, layout.noise] = _unit_zero_mean(rng, layout.n_filler,
                                                           layout.noise_dim, hub_dir)
    emb[layout.hub, layout.noise] = hub_dir
    for key in range(layout.n_keys):
        for value in range(layout.n_values):
            row = layout.fact(key, value)
            emb[row, layout.fact_key] = keys[key]
            emb[row, layout.value.start + value] = 1.0
        emb[layout.query(key), layout.query_key] = keys[key]
    # Answer tokens are never needed as inputs; give them filler-like noise.
    answers = list(layout.answer_ids)
    emb[answers, layout.noise] = _unit_zero_mean(rng, len(answers), layout.noise_dim, hub_dir)
    return emb


def _attention_weights(cfg: ModelConfig, layout: RecallLayout, hub_dir: np.ndarray,
                       hub_gain: float) -> dict[str, np.ndarray]:
    """Layer-0 attention and indexer weights with the MLA query gain still at 1."""
    kd, nv, nd, rope = layout.key_dim, layout.n_values, layout.noise_dim, cfg.qk_rope_head_dim
    shapes = param_shapes(cfg)
    w = {name[len("model.layers.0."):]: np.zeros(shape) for name, shape in shapes.items()
         if name.startswith("model.layers.0.self_attn.")}
    const = kd  # the q_lora lane that carries the constant flag
    # q_lora = RMSNorm([query key | constant]).
    w["self_attn.q_a_proj.weight"][:kd, layout.query_key] = np.eye(kd)
    w["self_attn.q_a_proj.weight"][const, layout.bias] = 1.0
    w["self_attn.q_a_layernorm.weight"][:] = 1.0
    # q_nope = query key; q_pe = 0 (its rows stay zero).
    w["self_attn.q_b_proj.weight"][:kd, :kd] = np.eye(kd)
    # a = [fact key | value | noise | 0_rope]; c = RMSNorm of the first three.
    kva = w["self_attn.kv_a_proj_with_mqa.weight"]
    kva[:kd, layout.fact_key] = np.eye(kd)
    kva[kd: kd + nv, layout.value] = np.eye(nv)
    kva[kd + nv: kd + nv + nd, layout.noise] = np.eye(nd)
    w["self_attn.kv_a_layernorm.weight"][:] = 1.0
    # W_kv_b = [W_uk (nope x kv_lora) ; W_uv (v x kv_lora)]: match on the key, read the value.
    kvb = w["self_attn.kv_b_proj.weight"]
    kvb[:kd, :kd] = np.eye(kd)
    kvb[kd: kd + nv, kd: kd + nv] = np.eye(nv)
    w["self_attn.o_proj.weight"][layout.value, :] = np.eye(nv)
    # Indexer: k = LayerNorm([0_rope | fact key | noise]) (rope lanes weighted 0),
    # q = [0_rope | query key | hub_gain * hub_dir], w = the constant flag.
    wk = w["self_attn.indexer.wk.weight"]
    wk[rope: rope + kd, layout.fact_key] = np.eye(kd)
    wk[rope + kd: rope + kd + nd, layout.noise] = np.eye(nd)
    w["self_attn.indexer.k_norm.weight"][rope:] = 1.0
    wq = w["self_attn.indexer.wq_b.weight"]
    wq[rope: rope + kd, :kd] = np.eye(kd)
    wq[rope + kd: rope + kd + nd, const] = hub_gain * hub_dir
    w["self_attn.indexer.weights_proj.weight"][0, layout.bias] = 1.0
    return w


def _query_fact_logit(params: Params, cfg: ModelConfig, layout: RecallLayout) -> float:
    """The attention logit of query(0) on fact(0, 0) under `params` (f32, no cache rounding)."""
    p = layer_params(params, 0)
    tokens = jnp.asarray([layout.fact(0, 0), layout.query(0)])
    x = params["model.embed_tokens.weight"][tokens]
    h = rms_norm(x, p["input_layernorm.weight"], cfg.rms_norm_eps)
    q_row, kv_row, _ = mla_inputs(p, cfg, h, jnp.zeros((2,), jnp.int32))
    return float(q_row[1, 0] @ kv_row[0]) * cfg.softmax_scale


def build_recall_model(cfg: ModelConfig | None = None, *, layout: RecallLayout | None = None,
                       seed: int = 0, target_logit: float = 64.0, hub_gain: float = 2.0,
                       answer_gain: float = 2.0, filler_key_strength: float = 0.3
                       ) -> RecallModel:
    """Build the recall model's weights for `cfg` (default: configs/models/recall.toml).

    target_logit: attention logit of a query on its own fact (a sibling at cosine rho gets
                  rho * target_logit); sets how sharp, and how precision-sensitive, a read is.
    hub_gain:     indexer score of a hub token relative to a perfect fact.
    answer_gain:  lm_head gain from the value block to the answer tokens.
    filler_key_strength: norm of a filler token's random key relative to a fact key.
    """
    cfg = load_model_config("recall") if cfg is None else cfg
    layout = RecallLayout() if layout is None else layout
    layout.check(cfg)
    rng = np.random.default_rng(seed)
    keys = _fact_keys(layout, rng)
    hub_dir = _unit_zero_mean(rng, 1, layout.noise_dim)[0]
    emb = _embeddings(layout, keys, hub_dir, rng, filler_key_strength)
    attn = _attention_weights(cfg, layout, hub_dir, hub_gain)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(cfg).items():
        local = name[len("model.layers.0."):]
        if local in attn:
            params[name] = attn[local]
        elif name.endswith("layernorm.weight") or name == "model.norm.weight":
            params[name] = np.ones(shape)
        else:
            params[name] = np.zeros(shape)                         # MLP, lm_head (below)
    params["model.embed_tokens.weight"] = emb
    head = params["lm_head.weight"]
    for value in range(layout.n_values):
        head[layout.answer(value), layout.value.start + value] = answer_gain
    out = {name: jnp.asarray(v, jnp.float32) for name, v in params.items()}
    # Scale q_nope so that a query scores its own fact at target_logit.
    gain = target_logit / _query_fact_logit(out, cfg, layout)
    name = "model.layers.0.self_attn.q_b_proj.weight"
    out[name] = out[name] * gain
    return RecallModel(cfg=cfg, layout=layout, params=out, keys=keys.astype(np.float32))
