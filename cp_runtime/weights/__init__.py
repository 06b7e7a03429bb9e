"""Model weights, from the numbers to the devices: random init and safetensors I/O (`params`),
reading a checkpoint folder (`checkpoint`), how each tensor is split over the `cp` mesh
(`layout`) and stored in its serving dtype (`format`, with `fp8_blocks` for block-scaled fp8),
putting them on the devices (`placement`), and the collectives a split weight needs (`shards`).

The ground floor of the runtime: imports only cp_runtime.config, cp_runtime.dtypes and the
kernels.
"""
