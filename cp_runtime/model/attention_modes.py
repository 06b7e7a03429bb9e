"""How a step's queries meet the position-sharded cache, each way priced: gather_q or
gather_kv (`attention_layout`, runtime field `attention`), and, where the step splits its rows,
which shard attends which heads of which rows (`row_attention_mode`, runtime field
`row_attention`). The ways themselves are cp_runtime.model.attention's.

Bytes each shard receives per layer, for R query rows of H heads and page tables of M pages:
gather_q ~ R H ((D_lat + kv_lora) w + 4) (q in, partials out, w bytes a value on the wire,
runtime field `wire_dtype`; the lse in f32), gather_kv ~ M ps D_lat c (the pages). A decode
step (R small) moves far less with gather_q; a prefill chunk of R = 8192 at a 1M-token context
far less with gather_kv (`cp-runtime compile --matrix` has the compiled figures: GLM-5.2's
last 8K chunk of a 1M prompt, 2.09 s with gather_q against 0.63 s with gather_kv). `auto` picks
the smaller, where the heads split evenly over the shards.
"""

from __future__ import annotations

import jax

from cp_runtime.kernels.adapters import QUERY_DTYPE
from cp_runtime.kernels.sparse_prefill import priced_bound

__all__ = ["HBM_BYTES_PER_ICI_BYTE", "RELAYOUT_BYTES_PER_TRADED_BYTE",
           "DEQUANT_BYTES_PER_FP8_WEIGHT", "attention_layout", "row_attention_mode"]

# A byte on the interconnect takes as long as this many of HBM on v7x, per device: 3.69 TB/s
# of HBM against 300 GB/s of ICI each way (cp_runtime/aot/roofline.py's TPU7X_DEVICE;
# tests/model/test_attention_layout.py holds the two equal).
HBM_BYTES_PER_ICI_BYTE = 12

# What XLA's passes around each way cost, in HBM bytes, as the compiler priced GLM-5.2's and
# DeepSeek-V3.2's chunks for TPU7x (docs/notes/2026-12-02-prefill-layout.md,
# "Every head of a device's rows"): the q heads and outputs traded by all-to-all are cast,
# laid out for the SparseCores and transposed on each side, about 10 bytes a byte traded for
# GLM-5.2 and 4 for DeepSeek-V3.2, 5 taken; a gathered fp8 weight that XLA dequantises whole
# (kernels/dispatch.py's `ModelKernels.dequantised_whole`: DeepSeek-V3.2's kv_b; its f32
# scales broadcast to its shape, written and read, then the matmul's reads) costs about 15
# bytes an element besides its own byte. Those kernels read as fp8 blocks cost their byte.
RELAYOUT_BYTES_PER_TRADED_BYTE = 5
DEQUANT_BYTES_PER_FP8_WEIGHT = 15


def attention_layout(choice: str, *, rows: int, heads: int, latent_dim: int, value_dim: int,
                     table_pages: int, page_size: int, cache_itemsize: int, num_shards: int,
                     split: bool, wire_itemsize: int = 4) -> str:
    """'gather_q' or 'gather_kv' for runtime field `attention` = `choice` (module docstring):
    auto takes gather_kv where the weights are split, the heads divide evenly over the
    shards, and the pages of the tables (table_pages in all) weigh less than the rows' q and
    partials (wire_itemsize bytes a value, the lse 4)."""
    if choice != "auto":
        return choice
    if not split or num_shards == 1 or heads % num_shards:
        return "gather_q"
    q_bytes = rows * heads * ((latent_dim + value_dim) * wire_itemsize + 4)
    kv_bytes = table_pages * page_size * latent_dim * cache_itemsize
    return "gather_kv" if kv_bytes < q_bytes else "gather_q"


def row_attention_mode(choice: str, *, rows: int, heads: int, latent_dim: int,
                       value_dim: int, hidden: int, q_lora_rank: int, entries: int,
                       every_pages: int, page_size: int, cache_dtype, num_shards: int,
                       wire_itemsize: int, query_block: int, head_weight_bytes: int,
                       dequantised_elements: int, mask_words: int = 0) -> str:
    """How a step whose rows are split attends (runtime field `row_attention` = `choice`):
    "heads", each shard its own heads of every row, their projections reduce-scattered into
    the rows' shards; "rows", every head of its own rows, the q heads and outputs traded by
    two all-to-alls, then the same reduce-scatter; "weights", every head of its own rows from
    the head-split weights (q_b, kv_b, o_proj; in a layer with its own indexer wq_b too)
    all-gathered whole, no all-to-all, no reduce-scatter, and no gather of every row's q_lora
    (each shard makes every q head of its own rows, the indexer's too, which are then gathered
    by row; wq_b, 8 MB of a GLM-5.2 layer, is left out of the price). auto prices the three:
    the prefill kernel at its bound (every query's pages distinct; its queries in the TPU
    kernels' bf16) over the gathered cache of `every_pages` pages, plus what each sends at the
    interconnect's pace. Attending its own rows reads S
    times fewer pages; late in a long prompt that wins by far, early, where the gathered cache
    caps every block's reads, it does not pay for what it sends. Each way also pays XLA's
    passes around it (RELAYOUT_BYTES_PER_TRADED_BYTE, DEQUANT_BYTES_PER_FP8_WEIGHT): so, for
    GLM-5.2, the weights come to the rows in steps of 8K rows and more (kernels read them as
    fp8 blocks), and in steps of 4K the rows trade their heads late in a long prompt.

    rows: R, the step's rows; heads: H, every shard's heads together (padded to S h);
    head_weight_bytes: this shard's part of the head-split weights, with their scales;
    dequantised_elements: how many of their values, gathered whole, XLA dequantises (fp8
    weights no kernel reads: kernels/dispatch.py's `ModelKernels.dequantised_whole`);
    mask_words: the words of each entry's token mask in token selection (0: whole pages)."""
    if choice != "auto":
        return choice
    s, h = num_shards, heads // num_shards
    cache = jax.ShapeDtypeStruct((every_pages, page_size, latent_dim), cache_dtype)

    def kernel(queries: int, q_heads: int) -> float:
        q = jax.ShapeDtypeStruct((1, queries, q_heads, latent_dim), QUERY_DTYPE)
        return priced_bound(q, cache, entries, value_dim, query_block, mask_words)

    one_way = (s - 1) / s
    sums = one_way * rows * hidden * wire_itemsize               # the heads' reduce-scatter
    sums += one_way * rows * q_lora_rank * wire_itemsize         # and q_lora's all-gather
    traded = one_way * rows * h * (latent_dim + value_dim) * wire_itemsize
    own_rows = kernel(rows // s, heads)
    whole = s * head_weight_bytes                     # read once gathered
    priced = {"heads": kernel(rows, h) + HBM_BYTES_PER_ICI_BYTE * sums,
              "rows": (own_rows + HBM_BYTES_PER_ICI_BYTE * (traded + sums)
                       + RELAYOUT_BYTES_PER_TRADED_BYTE * traded),
              "weights": (own_rows + HBM_BYTES_PER_ICI_BYTE * (s - 1) * head_weight_bytes
                          + whole + DEQUANT_BYTES_PER_FP8_WEIGHT * dequantised_elements)}
    return min(priced, key=priced.get)
