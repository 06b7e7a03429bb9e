"""Every Pallas kernel's VMEM estimate (`cost()`), with the default blocks, fits one TPU v7x
TensorCore (64 MiB) for every model config, and the scoped-VMEM limit follows the estimate; the
attention kernels' SMEM, with token masks too, fits TPU7x's 1 MiB."""

import jax.numpy as jnp
import pytest
from jax import ShapeDtypeStruct as S

from cp_runtime.config import RuntimeConfig, load_model_config, model_names
from cp_runtime.kernels import cache_write, indexer, sparse_decode, sparse_prefill
from cp_runtime.kernels.reference import mask_words
from cp_runtime.kernels.vmem import (SMEM_BUDGET_BYTES, VMEM_BUDGET_BYTES, VMEM_BYTES_PER_CORE,
                                     fit_block, vmem_limit_bytes)

RT = RuntimeConfig()
CONTEXT = 1 << 20          # tokens of one sequence, spread over RT.num_shards shards
PREFILL = 2048             # queries of one prefill call: more than any query block


def kernel_costs(name: str) -> dict[str, dict]:
    """cost() of each kernel at the model's real shapes: bf16 queries, fp8 latent cache, bf16
    indexer cache, a 1M-token context, the runtime's default page size and blocks; the
    attention kernels also in token mode (index_topk entries a query, with their masks)."""
    m = load_model_config(name)
    ps = RT.page_size
    pages = CONTEXT // (ps * RT.num_shards)                     # local pages per shard
    n = m.index_topk // ps + 1                                  # selected pages + own page
    latent = S((pages + 1, ps, m.latent_dim), jnp.float8_e4m3fn)
    tokens = m.index_topk                                       # token mode's entries

    def q(nq):
        return S((1, nq, m.num_attention_heads, m.latent_dim), jnp.bfloat16)

    def masks(b, nq):
        return S((b, nq, tokens, mask_words(ps)), jnp.int32)
    return {
        "sparse_prefill masked": sparse_prefill.cost(
            q(PREFILL), latent, S((1, PREFILL, tokens), jnp.int32), None, None,
            value_dim=m.kv_lora_rank, query_block=RT.query_block,
            sel_masks=masks(1, PREFILL)),
        "sparse_decode masked": sparse_decode.cost(
            S((RT.max_batch, 1, m.num_attention_heads, m.latent_dim), jnp.bfloat16), latent,
            S((RT.max_batch, 1, tokens), jnp.int32), None, None, value_dim=m.kv_lora_rank,
            sel_masks=masks(RT.max_batch, 1)),
        "indexer": indexer.cost(
            S((1, PREFILL, m.index_n_heads, m.index_head_dim), jnp.bfloat16), None,
            S((pages + 1, ps, m.index_head_dim), jnp.bfloat16), S((1, pages), jnp.int32),
            None, num_shards=RT.num_shards, key_block_pages=RT.key_block_pages),
        "sparse_prefill": sparse_prefill.cost(
            q(PREFILL), latent, S((1, PREFILL, n), jnp.int32), None, None,
            value_dim=m.kv_lora_rank, query_block=RT.query_block),
        "sparse_decode": sparse_decode.cost(
            S((RT.max_batch, 1, m.num_attention_heads, m.latent_dim), jnp.bfloat16), latent,
            S((RT.max_batch, 1, n), jnp.int32), None, None, value_dim=m.kv_lora_rank),
        "cache_write": cache_write.cost(latent, S((PREFILL, m.latent_dim), jnp.bfloat16)),
    }


@pytest.mark.parametrize("name", model_names())
def test_default_blocks_fit_v7x_vmem(name):
    for kernel, c in kernel_costs(name).items():
        vmem = c["vmem_bytes"]
        assert vmem <= VMEM_BUDGET_BYTES < VMEM_BYTES_PER_CORE, (kernel, vmem)
        assert c.get("smem_bytes", 0) <= SMEM_BUDGET_BYTES, (kernel, c["smem_bytes"])
        limit = vmem_limit_bytes(vmem)
        assert vmem < limit <= VMEM_BYTES_PER_CORE, (kernel, limit)


def test_prefill_block_shrinks_to_fit():
    """Counted as Mosaic pads them ([R, 1] columns take 128 lanes), 64 queries x 64 heads need
    ~59 MiB (the TPU7x compiler asked for 50.95 MiB and refused). Over a cache of 32 pages,
    which caps every block's union alike, no smaller block prices below a larger one, so the
    block is the largest that fits: GLM-5.2's 32 queries, DeepSeek-V3.2's 128 heads 16. (Over
    a long context the kernel's bound takes smaller ones: tests/kernels/test_kernels.py.)"""
    for name, block in (("glm-5.2", 32), ("deepseek-v3.2", 16)):
        m = load_model_config(name)
        n = m.index_topk // RT.page_size + 1
        c = sparse_prefill.cost(
            S((1, PREFILL, m.num_attention_heads, m.latent_dim), jnp.bfloat16),
            S((33, RT.page_size, m.latent_dim), jnp.float8_e4m3fn),
            S((1, PREFILL, n), jnp.int32), None, None, value_dim=m.kv_lora_rank,
            query_block=RT.query_block)
        assert c["blocks"]["q"][0] == block, name


def test_limit_and_fit_rules():
    mib = 1 << 20
    assert vmem_limit_bytes(0) == 16 * mib
    assert vmem_limit_bytes(20 * mib) == 27 * mib
    assert vmem_limit_bytes(100 * mib) == VMEM_BYTES_PER_CORE
    assert fit_block(lambda b: b * mib // 2, 64) == 64
    assert fit_block(lambda b: b * 2 * mib, 64) == 16
    assert fit_block(lambda b: 10**12, 64) == 8 and fit_block(lambda b: 10**12, 4) == 4


def test_masked_prefill_block_fits_smem():
    """In token mode a block's union lists hold qb * N entries (4 * qb * N * 4 bytes of SMEM):
    at N = 2,048, qb = 32 needs 1 MiB, which the TPU7x compiler refused ("Used 1.00M of 1.00M
    smem. Exceeded smem capacity by 1.6K"), so over a small cache, where the bound prices
    larger blocks lower, GLM-5.2's block stops at 16 (compiled: tests/aot/test_tpu_compile.py)."""
    m = load_model_config("glm-5.2")
    c = sparse_prefill.cost(
        S((1, PREFILL, m.num_attention_heads, m.latent_dim), jnp.bfloat16),
        S((33, 64, m.latent_dim), jnp.float8_e4m3fn), S((1, PREFILL, m.index_topk), jnp.int32),
        None, None, value_dim=m.kv_lora_rank, query_block=RT.query_block,
        sel_masks=S((1, PREFILL, m.index_topk, 2), jnp.int32))
    assert c["blocks"]["q"][0] == 16 and c["smem_bytes"] == 512 << 10
