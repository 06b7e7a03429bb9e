"""The device loop: an `Engine` driven on a thread of its own, apart from the server's event
loop, so a slow step (seconds, for a long prefill chunk) never blocks accepting connections or
answering other clients.

The engine is not thread-safe: everything touching it runs on this thread. Other threads hand
it work with `call(fn)`, which runs `fn(engine)` between two steps and returns a
`concurrent.futures.Future`; events from steps go to `on_events`, called on this thread.
`restoring`, the number of sessions whose cache is being rebuilt, is published after every
step for readers on other threads that must not wait for one (a health probe).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from typing import Callable

from cp_runtime.engine.core import Engine

__all__ = ["EngineLoop"]

log = logging.getLogger(__name__)


class EngineLoop:
    """Runs calls, then a step whenever the engine has work, until stopped."""

    def __init__(self, engine: Engine, on_events: Callable[[list], None]):
        self.engine = engine
        self._on_events = on_events
        self._calls: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="cp-runtime-device", daemon=True)
        self.restoring = engine.restoring_sessions

    def start(self) -> None:
        self.restoring = self.engine.restoring_sessions
        self._thread.start()

    def call(self, fn: Callable[[Engine], object]) -> concurrent.futures.Future:
        """Run fn(engine) on the device thread before its next step."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._stopping:
                future.set_exception(RuntimeError("the engine loop has stopped"))
                return future
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Finish the step in progress, fail what is queued (`unavailable`), and end."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    def _next_calls(self) -> list:
        with self._wake:
            while not (self._calls or self._stopping or self.engine.has_work):
                self._wake.wait()
            calls = list(self._calls)
            self._calls.clear()
            return calls

    def _run(self) -> None:
        while True:
            for fn, future in self._next_calls():
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as e:          # noqa: BLE001 - the caller gets it
                        future.set_exception(e)
            if self._stopping:
                self._emit(self.engine.fail_all("unavailable", "the server is shutting down"))
                return
            if self.engine.has_work:
                self._step()
            self.restoring = self.engine.restoring_sessions

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:                       # noqa: BLE001 - a bug, not a bad request
            log.exception("engine step raised")
            events = self.engine.fail_all("internal", f"engine step failed: {e}")
        self._emit(events)

    def _emit(self, events: list) -> None:
        if events:
            self._on_events(events)
