"""What crosses the `cp` axis: the exact top-K over position-sharded candidates (`selection`), the
merge of partial attention results by log-sum-exp (`merge`), the gathers and sums themselves
(`collectives`), and the device list a mesh is built from (`devices`).

May import cp_runtime.cache and cp_runtime.weights, config, dtypes and the kernels.
"""
