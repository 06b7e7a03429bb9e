"""The tiny model through the Pallas kernels (TPU interpret mode) equals the reference path
within the kernels' bounds, on one shard and on 16.

At S = 16 every CPU device runs the interpreted kernels at once; TPU interpret mode then needs a
spare thread in XLA's CPU client pool (kernels/packing.py, "Interpret mode on a multi-device CPU
mesh"); tests/conftest.py sizes the pool before JAX creates its CPU client.
"""

import numpy as np
import pytest

from conftest import make_engine, random_tokens, rel_l2

# Kernel vs reference differ by f32 summation order and by the TPU path's bf16 rounding
# (kernels/dispatch.py): the indexer's and the attention kernels' queries, and the attention's
# probabilities before PV (tests/test_kernels.py bounds each kernel). Through 4 layers and the lm
# head the logits' rel-L2 measured 5.25e-3 at S = 1 and 5.22e-3 at S = 16 (3.9e-7 / 4.1e-7 with
# f32 attention); storing the same run's cache in fp8 rather than bf16 moves them 5.3e-2 on the
# reference path, ten times more. A misread page or a wrong mask moves whole positions' logits.
KERNEL_PATH_BOUND = 1e-2


# S = 1 runs with the slow tests: S = 16 runs the same kernels through the same step, sharded,
# and each kernel alone is checked against its reference in tests/test_kernels.py.
# The split layout: weights sharded (tiny's 4 heads padded to 16, one a device), gather_kv, so
# the 32-row chunk's rows split over the 16 shards and each attends every head of its 2 rows
# through the prefill kernel (the 8-token tail chunk keeps every row everywhere); measured
# 5.25e-3.
SPLIT = {"weights": "sharded", "attention": "gather_kv", "row_attention": "rows"}
# The same chunk as two halves of 16 rows (cp_runtime.model.halves), each device attending
# every head of its rows from the gathered weights: the second half writes into the pages
# the first gathered and read; measured 5.19e-3.
HALVES = {"weights": "sharded", "attention": "gather_kv", "row_attention": "weights",
          "chunk_halves": "on"}


@pytest.mark.parametrize("shards, layout", [pytest.param(1, {}, marks=pytest.mark.slow),
                                            (16, {}), (16, SPLIT), (16, HALVES)])
def test_kernel_path_matches_reference(tiny, tiny_params, shards, layout):
    # 40 tokens on 16-token pages in 32-token chunks: the first chunk spans pages 0-1 (shards 0
    # and 1 at S = 16), the second page 2 (shard 2); then one decode step.
    outs = {}
    for backend in ("reference", "pallas_interpret"):
        engine = make_engine(tiny, tiny_params, kv_cache_dtype="fp8_e4m3", num_shards=shards,
                             pages_per_shard=max(8 // shards, 1) * 2, page_size=16,
                             chunk_size=32, backend=backend, key_block_pages=2, **layout)
        s = engine.create_session()
        prefill = engine.extend(s.id, random_tokens(tiny, 40, 0), all_logits=True)
        decode = engine.decode([s.id], [3])
        outs[backend] = np.concatenate([prefill, decode])
    assert 0 < rel_l2(outs["pallas_interpret"], outs["reference"]) <= KERNEL_PATH_BOUND
