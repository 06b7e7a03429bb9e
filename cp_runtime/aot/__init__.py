"""Ahead-of-time compilation for a TPU slice this machine does not have.

libtpu compiles for a compile-only topology (`jax.experimental.topologies`) on any machine, so
every program the executor runs on a slice can be lowered from shapes alone (no array is ever
allocated) and handed to XLA:TPU and Mosaic, which report per-device memory, flops, bytes and a
time estimate. `topology` finds the devices, `programs` builds each program with its
ShapeDtypeStruct arguments, `report` compiles them and tabulates what the compiler says.
Imports config, the pool, the step and the executor's programs; only the command line
(`cp-runtime compile`), `bench tpu_model --compiler` and tests import it.
"""
