"""The phases of a model step, as `jax.named_scope` names: each compiled instruction's op_name
then says which phase it belongs to, so the compiler's per-instruction figures can be summed
per phase (`cp-runtime compile --phases`, cp_runtime.aot.phases). Each layer's work also runs
under `layer_scope(i)` (`layer7`), so figures of a model cut to a few layers can be scaled to
the whole model layer kind by layer kind.

    cache_write       the step's latent and indexer rows into owned pages
    indexer           indexer page scores over owned pages
    selection         local candidates and the global top-K over the cp axis (its gather)
    attention_inputs  q, kv and indexer projections (with the indexer q heads' gather)
    q_gather          every head of q to every shard (attention "gather_q", split weights), or
                      to its rows' shard (gather_kv with the rows split), or the weights that
                      make every head of q (q_b, kv_b) gathered whole
    kv_gather         the rows' cached pages to every shard (attention "gather_kv")
    sparse_attention  selected pages' slots and the sparse MLA kernel
    merge             the shards' partials merged (or the outputs back to their heads' shard,
                      or o_proj gathered whole), and the output projection
    dense             embedding, norms, the dense MLP or MoE, the lm head
    sampling          sampling on the device
"""

from __future__ import annotations

import jax

__all__ = ["PHASES", "phase", "layer_scope"]

PHASES = ("cache_write", "indexer", "selection", "attention_inputs", "q_gather", "kv_gather",
          "sparse_attention", "merge", "dense", "sampling")


def phase(name: str):
    """`jax.named_scope(name)` for one of PHASES (a typo would silently make a new phase)."""
    if name not in PHASES:
        raise ValueError(f"{name!r} is not a step phase; phases: {', '.join(PHASES)}")
    return jax.named_scope(name)


def layer_scope(layer: int):
    """`jax.named_scope("layer{i}")` around layer i's work (outside its phases)."""
    return jax.named_scope(f"layer{layer}")
