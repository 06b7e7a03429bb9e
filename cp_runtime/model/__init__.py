"""The DSA model as functions of weights and arrays: the forward pass (`forward`), the sharded
sparse attention over the paged pool (`attention`), a device's experts where they lie in groups
(`expert_groups`), sampling (`sampler`), the dense
single-device oracle the sharded path is checked against (`oracle`), the recall-trained small
model the needle benchmarks serve (`recall`), and where a served model's weights come from
(`source`).

May import cp_runtime.parallel, cp_runtime.cache and cp_runtime.weights, config, dtypes and the
kernels.
"""
