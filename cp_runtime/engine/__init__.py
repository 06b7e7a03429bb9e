"""The engine: sessions, admission and prefix reuse (`core`, `direct`, `prefix_cache`), the
scheduler and step plans (`scheduler`, `plans`), requests and their events (`requests`), what
durable sessions tell a store (`journal`), the executors that run plans on devices
(`executor`) and the jitted SPMD step they compile (`step`).

May import cp_runtime.model, parallel, cache and weights, config, dtypes and the kernels; never
the server, the cluster code or the command line.
"""

from cp_runtime.engine.core import Engine, Session
from cp_runtime.engine.executor import Executor, LocalExecutor, pool_spec_for

__all__ = ["Engine", "Executor", "LocalExecutor", "Session", "pool_spec_for"]
