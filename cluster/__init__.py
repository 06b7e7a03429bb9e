"""Ray deployment: per-host worker actors and a `RayExecutor` that plugs into the engine through
the `cp_runtime.engine.executor.Executor` interface, sending every step plan to all hosts in lockstep.

Not built yet: the runtime runs on one host through `LocalExecutor`. Nothing in cp_runtime
imports this package (cp_runtime knows nothing of Ray).
"""
