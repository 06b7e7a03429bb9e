"""Ray deployment: one `HostWorker` actor per host (cluster.worker) owning that host's devices,
its shards of the pool and its own weights, and a `RayExecutor` (cluster.ray_executor) that plugs
into the engine through the `cp_runtime.engine.executor.Executor` interface, sending every step
plan to all hosts in lockstep (one SPMD program over jax.distributed).

May import cp_runtime.engine, model, parallel, cache and weights, config, dtypes and the
kernels. Nothing in cp_runtime imports this package (cp_runtime knows nothing of Ray):
`cp-runtime serve --executor ray` imports it by name when asked to.
"""
