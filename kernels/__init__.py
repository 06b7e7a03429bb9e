"""Per-shard hot paths: XLA references (the CPU path and the oracle) and Pallas TPU kernels.

Kernels know nothing of sessions or shards beyond the page arrays they are handed, and import
nothing of cp_runtime but each other: they are the ground the rest stands on.
"""
