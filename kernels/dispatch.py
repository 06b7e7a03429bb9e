"""Which implementation of the per-shard hot paths a step uses.

`xla` is the XLA path for backends without the TPU kernels: the reference cache write, the
indexer tiled for XLA:CPU (kernels/xla_indexer.py; a decode step's takes the one-pass native
handler of kernels/native_indexer.py on CPU) and attention that only touches the pages a
shard owns (kernels/xla_sparse.py); `reference` is the plain
references (kernels/reference.py); `pallas` the TPU kernels, the experts' grouped matmul from
fp8 blocks among them (kernels/expert_matmul.py); `pallas_interpret` the same kernels in TPU
interpret mode (CPU tests). The XLA and reference sets run experts in XLA (`expert_matmul`
None: cp_runtime.model.moe picks its XLA path). `auto` picks pallas on TPU and xla
elsewhere. An unknown name is refused with the list of choices. Each backend's functions are
wrapped to the reference's signatures in kernels/adapters.py.

`MODEL_KERNELS` (`ModelKernels`) holds the model's own choices between a Pallas kernel and
XLA (its linears, MLA's per-head products, the router, the shared experts, how the routed
experts run) with their row thresholds: the model (cp_runtime.model) asks it and holds only
maths. Those choices follow the platform a program is lowered for, not the backend name.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from cp_runtime.kernels import (adapters, expert_matmul, latent_heads, native_indexer, reference,
                               router, scaled_linear, shared_expert, token_candidates,
                               whole_heads, xla_sparse)
from cp_runtime.kernels.fp8_rows import Fp8Rows
from cp_runtime.kernels.vmem import LANES

if TYPE_CHECKING:
    from cp_runtime.config import ModelConfig

__all__ = ["Kernels", "select_kernels", "resolve_backend", "ModelKernels", "MODEL_KERNELS"]


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The per-shard operations, all with the signatures of kernels/reference.py (including the
    `cache_dtype` keyword for caches in storage form, and `sparse_attention`'s `sel_masks`, the
    entries' token masks, None for page mode); `expert_matmul` None where the model's
    XLA path runs the experts. `indexer_page_scores` also takes `tie` (kernels/indexer.py):
    arrays tied to its scores, returned beside them; and `fp8`: score the queries and keys
    rounded to e4m3 (`indexer.quantized_scores_inputs`), at the MXU's fp8 rate on a TPU.
    `indexer_token_candidates` (token selection) takes the same and `k`: one XLA function on
    every backend (kernels/token_candidates.py)."""

    name: str
    write_kv: Callable
    indexer_page_scores: Callable
    sparse_attention: Callable
    indexer_token_candidates: Callable
    expert_matmul: Callable | None = None


TOKEN_CANDIDATES = adapters.tied_after(
    adapters.scored_in_fp8(token_candidates.indexer_token_candidates))

REFERENCE = Kernels("reference", reference.write_kv,
                    adapters.tied_after(adapters.scored_in_fp8(reference.indexer_page_scores)),
                    adapters.reads_words(reference.sparse_attention), TOKEN_CANDIDATES)

BACKEND_CHOICES = ("auto", "xla", "reference", "pallas", "pallas_interpret")  # config.Backend


def _xla(num_shards: int) -> Kernels:
    return Kernels("xla", reference.write_kv,
                   adapters.tied_after(
                       adapters.scored_in_fp8(native_indexer.indexer_page_scores)),
                   adapters.reads_words(functools.partial(xla_sparse.sparse_attention_owned,
                                                  num_shards=num_shards)), TOKEN_CANDIDATES)


def _pallas(interpret: bool) -> Kernels:
    return Kernels(
        "pallas_interpret" if interpret else "pallas",
        functools.partial(adapters.pallas_write, interpret=interpret),
        functools.partial(adapters.pallas_scores, interpret=interpret),
        functools.partial(adapters.pallas_attention, interpret=interpret),
        TOKEN_CANDIDATES,
        functools.partial(adapters.pallas_experts, interpret=interpret))


def resolve_backend(name: str) -> str:
    """Strategy.backend for this process: "auto" is pallas where jax's default backend is
    the TPU, else xla (the process's default backend, not a mesh's devices: the one "auto"
    that config.resolve_strategy leaves to this)."""
    if name not in BACKEND_CHOICES:
        raise ValueError(f"unknown kernel backend {name!r}; choices: {', '.join(BACKEND_CHOICES)}")
    if name == "auto":
        return "pallas" if jax.default_backend() == "tpu" else "xla"
    return name


def select_kernels(name: str, num_shards: int = 1) -> Kernels:
    """The kernel set for a backend name (see the module docstring)."""
    resolved = resolve_backend(name)
    if resolved == "reference":
        return REFERENCE
    if resolved == "xla":
        return _xla(num_shards)
    return _pallas(interpret=resolved == "pallas_interpret")


# The model's own operations (cp_runtime.model): where each runs a Pallas kernel on a TPU.

# Steps of at most this many tokens run block-scaled linears through the Pallas kernel on a
# TPU (`ModelKernels.linear`). Longer ones keep XLA's fusion, which folds the norm before a
# matmul and the cast after it into the matmul; through the kernel those became passes of
# their own (its inputs' casts, its f32 outputs) and a prefill chunk compiled slower
# (docs/notes/2026-12-03-decode-step.md,
# "Decode's fp8 linears from VMEM, and a router on every device").
LINEAR_KERNEL_MAX_ROWS = 256
# A weight of at least this many elements takes the kernel at any number of rows: the
# head-split weights a device gathers whole to attend every head of its own rows (GLM-5.2's
# q_b, 25M, and o_proj, 100M), whose scales XLA broadcast to f32 and wrote to HBM at every
# row count compiled, and q_a (12.6M) and the indexer's wq_b (8.4M), whose scales XLA
# broadcast the same way. Smaller weights keep XLA's fusion of the norm before and the cast
# after, which routing every linear through the kernel lost
# (docs/notes/2026-12-02-prefill-layout.md, "The gathered weights read as fp8 blocks"; the 8M
# threshold: docs/notes/2026-12-06-indexer.md, "Three passes XLA added beside the kernels").
LINEAR_KERNEL_MIN_ELEMENTS = 8 << 20
# Steps of at most this many rows run kv_b's per-head products (W_uk on the queries; the
# merge with W_uv) in the kernels of kernels/latent_heads.py on a TPU. The merge's VMEM holds
# one head's partials from every shard, [S, R, Dv + 1] f32, twice: 2.6 MB each at S = 16,
# R = 64.
LATENT_KERNEL_MAX_ROWS = 64
# Steps of at most this many tokens route through the Pallas kernel on a TPU
# (`ModelKernels.route`).
ROUTER_KERNEL_MAX_ROWS = 64
# Without an expert_matmul kernel (the XLA path: CPU), steps of at most this many tokens with
# block-scaled (fp8) experts run every expert on every token straight from its fp8 blocks
# (`ModelKernels.routed_experts`): each expert's weights are read once, as fp8. Longer steps
# group the tokens by expert, whose ragged matmuls need the weights dequantised first: a bf16
# copy of every expert, written and read again each step, which a prefill chunk's thousands
# of tokens amortise and a decode step cannot.
EVERY_EXPERT_MAX_ROWS = 64


def _rows(x) -> int:
    """The rows of x[..., features]."""
    return int(np.prod(x.shape[:-1]))


@dataclasses.dataclass(frozen=True)
class ModelKernels:
    """Where the model's maths (cp_runtime.model) runs a Pallas kernel on a TPU rather than
    XLA: every such choice, and the row thresholds above, in one object the model asks
    (`MODEL_KERNELS`). Each method takes the operands and the model's own forms of the
    computation: `xla`, the kernel's computation in XLA, with the kernel's operands and
    result (the program lowered for another platform runs it), and `without_kernel`, the
    model's path where no kernel takes these operands. A kernel runs under
    `jax.lax.platform_dependent`, so one program serves every platform and the kernel runs
    only where it is lowered for a TPU; every branch computes the same values (to the
    roundings each method names)."""

    def linear_takes(self, w_shape: tuple[int, ...], s_shape: tuple[int, ...],
                     rows: int) -> bool:
        """Whether a linear of `rows` rows on a TPU runs the block-scaled weight (w_shape,
        scales s_shape) through kernels/scaled_linear.py."""
        few_rows = rows <= LINEAR_KERNEL_MAX_ROWS
        large = int(np.prod(w_shape)) >= LINEAR_KERNEL_MIN_ELEMENTS
        return (few_rows or large) and scaled_linear.supports(w_shape, s_shape)

    def latent_heads_take(self, w: jax.Array, s: jax.Array | None, rows: int) -> bool:
        """Whether a step of `rows` rows runs kv_b (w, scales s) through kernels/
        latent_heads.py on a TPU."""
        return (s is not None and rows <= LATENT_KERNEL_MAX_ROWS
                and latent_heads.supports(w.shape, s.shape))

    def dequantised_whole(self, cfg: ModelConfig, name: str, w_shape: tuple[int, ...],
                          s_shape: tuple[int, ...], rows: int) -> bool:
        """Whether a step of `rows` rows on a TPU has XLA dequantise the block-scaled
        head-split weight `name`, whole (w_shape, s_shape), in the passes of the model's
        `weight()` (its scales broadcast to f32, then cast) rather than a kernel read its fp8
        blocks: kv_b where the per-head kernels (kernels/latent_heads.py, kernels/
        whole_heads.py) do not take it, a linear's weight where `linear`'s kernel does not."""
        if name.endswith("self_attn.kv_b_proj.weight"):
            nope = cfg.qk_nope_head_dim
            heads = w_shape[0] // (nope + cfg.v_head_dim)
            if rows <= LATENT_KERNEL_MAX_ROWS:
                return not latent_heads.supports(w_shape, s_shape)
            return not whole_heads.supports_absorb(rows, heads, nope, cfg.qk_head_dim,
                                                   w_shape, s_shape)
        return not self.linear_takes(w_shape, s_shape, rows)

    def linear(self, x: jax.Array, w: jax.Array, s: jax.Array | None,
               xla: Callable) -> jax.Array:
        """x[..., in] through w [out, in] (block scales s, or None) -> f32[..., out]. On a
        TPU, a step of few tokens (LINEAR_KERNEL_MAX_ROWS), or a large weight
        (LINEAR_KERNEL_MIN_ELEMENTS), takes a block-scaled weight whose scale runs are whole
        lane tiles through kernels/scaled_linear.py, which dequantises each block in VMEM:
        XLA's fused dequantisation wrote the scales, broadcast to the weight's shape in f32,
        to HBM whenever they did not fit VMEM beside the layer's other buffers (o_proj in
        GLM-5.2's MoE layers: 6 GB of a decode step's HBM traffic). Elsewhere, and for other
        weights, xla(x, w, s); the kernel's output is the same sum kept in f32 rather than
        rounded to bf16."""
        if s is None or not self.linear_takes(w.shape, s.shape, _rows(x)):
            return xla(x, w, s)
        return jax.lax.platform_dependent(x, w, s, tpu=scaled_linear.scaled_linear,
                                          default=xla)

    def query_rows(self, cfg: ModelConfig, q: jax.Array, w: jax.Array, s: jax.Array | None,
                   pos: jax.Array, *, angles: Callable, without_kernel: Callable) -> jax.Array:
        """q f32[..., H', nope + rope] at positions pos i32[...] (q's leading shape) -> the
        attention's query rows f32[..., H', D_lat] (without_kernel(q): [q_nope . W_uk,
        padded | rope(q_pe), padded]; w, s: kv_b and its scales). angles(pos i32[R]): the
        rope's (cos, sin) f32[R, rope / 2].

        On a TPU, where every head of a device's rows goes through kernels/whole_heads.py, its
        absorb kernel writes the rows whole, each head's rope part rotated in VMEM from its
        own q block and written beside its product (XLA:TPU laid the heads out again and
        joined the rope part in passes of its own, and sliced, rotated and padded the rope
        part in more, which at 1,024 rows a device also wrote two copies); the rope part is
        then rounded to bf16 there, as the attention kernels' bf16 queries take it anyway. It
        writes them as the sparse kernel reads them, heads in sublanes, so [..., H', D_lat] is
        a view of its output (docs/notes/2026-12-06-32k-chunks.md, "Query rows in the
        attention's layout"). It takes every head of a device's rows (whole groups of 16),
        in steps of more rows than the latent kernels take; a device's own heads of every
        row, where q_b is split, take `without_kernel`."""
        nope = cfg.qk_nope_head_dim
        rows, heads, dq = int(np.prod(q.shape[:-2])), *q.shape[-2:]
        fused = (s is not None and rows > LATENT_KERNEL_MAX_ROWS
                 and cfg.kv_lora_rank == cfg.latent_nope_pad and cfg.latent_rope_pad == LANES
                 and whole_heads.supports_absorb(rows, heads, nope, dq, w.shape, s.shape, True))
        if not fused:
            return without_kernel(q)

        def kernel(q, w, s, pos):
            factors = whole_heads.rope_factors(*angles(pos.reshape(rows)), nope=nope,
                                               interleaved=cfg.mla_rope_interleaved)
            out = whole_heads.absorb_queries(q, w, s, heads=heads, nope=nope, rope=factors,
                                             interleaved=cfg.mla_rope_interleaved)
            return out.reshape(*pos.shape, heads, -1).astype(jnp.float32)

        def xla(q, w, s, pos):
            return without_kernel(q.reshape(*pos.shape, heads, dq))

        return jax.lax.platform_dependent(q.reshape(rows, heads * dq), w, s, pos, tpu=kernel,
                                          default=xla)

    def absorbed_queries(self, cfg: ModelConfig, q: jax.Array, w: jax.Array,
                         s: jax.Array | None, *, xla: Callable,
                         without_kernel: Callable) -> jax.Array:
        """q f32[..., H', nope + rope] -> q_nope . W_uk f32[..., H', kv_lora] (bf16-rounded;
        w, s: kv_b and its scales). xla(q f32[R, H' (nope + rope)], w, s) -> bf16[H', R,
        kv_lora] is the kernels' product in XLA; without_kernel() the model's own. On a TPU, a
        step of few rows takes kernels/latent_heads.py, which dequantises kv_b in VMEM (XLA
        wrote a bf16 copy of it and broadcast its scales first), and one of more rows, every
        head of a device's own rows, kernels/whole_heads.py, which dequantises it a head at a
        time."""
        nope = cfg.qk_nope_head_dim
        rows, heads, dq = int(np.prod(q.shape[:-2])), *q.shape[-2:]

        def few_rows(q, w, s):
            heads_first = jnp.moveaxis(q.reshape(rows, heads, dq), 0, 1)     # [H', R, Dq]
            return latent_heads.absorb_queries(heads_first, w, s, nope=nope)

        if self.latent_heads_take(w, s, rows):
            tpu = few_rows
        elif s is not None and whole_heads.supports_absorb(rows, heads, nope, dq, w.shape,
                                                           s.shape):
            tpu = functools.partial(whole_heads.absorb_queries, heads=heads, nope=nope)
        else:
            return without_kernel()
        out = jax.lax.platform_dependent(q.reshape(rows, heads * dq), w, s, tpu=tpu,
                                         default=xla)                     # bf16[H', R, Dv]
        return jnp.moveaxis(out, 0, 1).reshape(*q.shape[:-1], -1).astype(jnp.float32)

    def mla_output(self, cfg: ModelConfig, o_lat: jax.Array, blocks: list,
                   without_kernel: Callable) -> jax.Array:
        """o_lat f[..., H, kv_lora] -> f[..., hidden] through W_uv and o_proj (blocks: kv_b,
        its scales, o_proj, its scales; a scale None where the weight is not block-scaled).
        On a TPU, a step of more rows than the latent kernels take (LATENT_KERNEL_MAX_ROWS)
        with block-scaled kv_b and o_proj runs both products in one kernel where it fits
        (kernels/whole_heads.py): a device's own rows of a prefill chunk, every head.
        Elsewhere without_kernel(o_lat)."""
        flat = o_lat.reshape(-1, *o_lat.shape[-2:])
        if (any(x is None for x in blocks) or flat.shape[0] <= LATENT_KERNEL_MAX_ROWS
                or not whole_heads.supports_output(flat.shape[0], flat.shape[1],
                                                   cfg.qk_nope_head_dim,
                                                   *(x.shape for x in blocks))):
            return without_kernel(o_lat)
        out = jax.lax.platform_dependent(
            flat, *blocks,
            tpu=functools.partial(whole_heads.project_output, nope=cfg.qk_nope_head_dim),
            default=lambda o, *_: without_kernel(o))
        return out.reshape(*o_lat.shape[:-2], -1)

    def exchanged_output(self, cfg: ModelConfig, received: jax.Array, w: jax.Array,
                         s: jax.Array | None, *, xla: Callable, o_proj: Callable,
                         without_kernel: Callable) -> jax.Array:
        """The partials a `head_exchange` merge received, f32[S, H', ..., Dv + 1], merged and
        through W_uv (w, s: kv_b and its scales) and o_proj -> f[..., hidden]. On a TPU, a step
        of few rows with block-scaled weights merges them and runs W_uv in one kernel
        (kernels/latent_heads.py: ~15 XLA passes a layer otherwise), then o_proj(values
        bf16[..., H' v]); xla(received f32[S, H', R, Dv + 1], w, s) -> bf16[R, H' v] is that
        kernel in XLA. Elsewhere without_kernel()."""
        lead = received.shape[2:-1]
        rows = int(np.prod(lead))
        if not self.latent_heads_take(w, s, rows):
            return without_kernel()
        flat = received.reshape(*received.shape[:2], rows, received.shape[-1])
        o = jax.lax.platform_dependent(
            flat, w, s,
            tpu=functools.partial(latent_heads.merge_values, nope=cfg.qk_nope_head_dim),
            default=xla)
        return o_proj(o.reshape(*lead, -1))

    def route(self, x: jax.Array, gate: jax.Array, bias: jax.Array, *, k: int,
              keywords: dict, xla: Callable, without_kernel: Callable
              ) -> tuple[jax.Array, jax.Array, bool]:
        """x f[T, hidden] through the router (gate, correction bias) -> (chosen i32[T, k],
        weights f32[T, k], by_expert). On a TPU a step of few tokens with a bf16 gate takes
        kernels/router.py (keywords: its routing keywords), one call where XLA ran a dozen
        small ops; such a step's choices come in ascending expert order on every platform
        (xla(x, gate, bias) sorts them so; by_expert True). Elsewhere without_kernel()
        -> (chosen, weights), by_expert False."""
        if x.shape[0] > ROUTER_KERNEL_MAX_ROWS or not router.supports(x.shape[0], gate.shape,
                                                                      gate.dtype, k):
            return *without_kernel(), False
        chosen, weights = jax.lax.platform_dependent(
            x, gate, bias, tpu=functools.partial(router.route, **keywords), default=xla)
        return chosen, weights, True

    def routed_experts(self, rows: int, *, block_scaled: bool,
                       expert_matmul: Callable | None, grouped: Callable,
                       every_expert: Callable):
        """How `rows` tokens run their routed experts: grouped by expert through
        `expert_matmul` (the kernel set's, kernels/expert_matmul.py) where the experts are
        block-scaled and there is one (grouped(expert_matmul)); without one, a step of few
        tokens runs every expert on every token from its fp8 blocks (every_expert(),
        EVERY_EXPERT_MAX_ROWS); else grouped by expert in XLA (grouped(None))."""
        if block_scaled and expert_matmul is not None:
            return grouped(expert_matmul)
        if block_scaled and rows <= EVERY_EXPERT_MAX_ROWS:
            return every_expert()
        return grouped(None)

    def routed_sum_whole(self, routed: jax.Array) -> jax.Array:
        """The routed experts' sum f[..., hidden], held whole (`lax.optimization_barrier`)
        before the shared experts' is added, in a step of more rows than
        LINEAR_KERNEL_MAX_ROWS: in XLA's form, XLA:TPU else began the routed rows'
        scatter-add from the shared experts' output and cast the sum to the wire's bf16 in a
        pass of its own; so the add and the cast fuse into the shared down projection
        (docs/notes/2026-12-03-experts.md, "The routed experts' sum whole before the shared
        experts' is added"). The kernel (`shared_experts`) takes the sum whole anyway."""
        if _rows(routed) > LINEAR_KERNEL_MAX_ROWS:
            return jax.lax.optimization_barrier(routed)
        return routed

    def shared_experts(self, routed: jax.Array, rows, blocks: list,
                       xla: Callable) -> jax.Array:
        """routed f[..., hidden] plus the shared experts' SwiGLU of rows (f[..., hidden], or
        `Fp8Rows`) -> f32; blocks: gate, its scales, up, its scales, down, its scales (scales
        None where not block-scaled); xla(routed, rows) the model's sum, in f32. On a TPU, a
        prefill's many fp8 rows (more than LINEAR_KERNEL_MAX_ROWS), a bf16 routed sum and
        block-scaled weights the kernel tiles take kernels/shared_expert.py, which adds them
        to the routed sum and writes it once, in bf16 (XLA:TPU fused the down projection, the
        add and the wire's cast into one pass priced at about three times the kernel's
        roofline; docs/notes/2026-12-03-experts.md, "The shared experts in one kernel")."""
        if not isinstance(rows, Fp8Rows) or routed.dtype != jnp.bfloat16:
            return xla(routed, rows)
        t = _rows(routed)
        gate, gate_s, _, _, down, down_s = blocks
        if (t <= LINEAR_KERNEL_MAX_ROWS or gate_s is None
                or not shared_expert.supports(t, gate.shape, gate_s.shape, down.shape,
                                              down_s.shape)):
            return xla(routed, rows)
        hidden = routed.shape[-1]

        def kernel(routed, rows):
            out = shared_expert.shared_expert(rows.values.reshape(-1, rows.values.shape[-1]),
                                              rows.scales.reshape(-1, 1),
                                              routed.reshape(-1, hidden), *blocks)
            return out.reshape(routed.shape).astype(jnp.float32)

        return jax.lax.platform_dependent(routed, rows, tpu=kernel, default=xla)


MODEL_KERNELS = ModelKernels()
