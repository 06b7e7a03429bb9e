"""Ahead-of-time compilation for a TPU slice this machine does not have.

libtpu compiles for a compile-only topology (`jax.experimental.topologies`) on any machine, so
every program the executor runs on a slice can be lowered from shapes alone (no array is ever
allocated) and handed to XLA:TPU and Mosaic, which report per-device memory, flops, bytes and a
time estimate. `topology` finds the devices, `programs` builds each program with its
ShapeDtypeStruct arguments, `kernel_cases` each kernel alone, `report` compiles them and
tabulates what the compiler says, `phases` splits a compiled program's figures by step phase,
and `deploy` is the plan `cp-runtime compile` runs.

May import cp_runtime.engine, model, parallel, cache and weights, config, dtypes and the
kernels; never the server. Only the command line (`cp-runtime compile`), `bench tpu_model
--compiler` and tests import it.
"""
