"""The engine wing: sessions and step plans (core), the executors that run plans on devices."""

from cp_runtime.engine.core import Engine, Session
from cp_runtime.engine.executor import Executor, LocalExecutor, pool_spec_for

__all__ = ["Engine", "Executor", "LocalExecutor", "Session", "pool_spec_for"]
