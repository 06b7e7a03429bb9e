"""The paged KV cache: the per-shard device pool (`pool`), the page allocator with its reference
counts (`pages`), where a session's logical pages lie on the shards (`layout`), and the
bytes-per-token arithmetic that says what fits (`capacity`).

May import cp_runtime.weights (capacity counts the weights' bytes), config, dtypes and the
kernels.
"""
