"""Prometheus metrics of one server (`GET /metrics`), in a registry of its own (no process-wide
state: two servers in one process keep separate figures).

Counted as requests go: HTTP requests by endpoint and status code, prompt, generated and
cached prompt tokens, time to first token and time between tokens. Read from the engine at each
scrape: step host and device seconds, steps, queued requests and prefill tokens, pages used per
shard, sessions, sessions restoring, prefix-cache entries and hits.
"""

from __future__ import annotations

import prometheus_client as prom

__all__ = ["Metrics"]

# Seconds: a first token comes after a prefill (up to minutes at 1M tokens); the gap between
# tokens is one decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
PREFIX = "cp_runtime_"


class Metrics:
    """The server's metrics; `render(stats)` gives the exposition text."""

    def __init__(self):
        self.registry = prom.CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = prom.Counter(PREFIX + "http_requests", "HTTP requests answered",
                                     ("endpoint", "code"), registry=r)
        self.prompt_tokens = prom.Counter(PREFIX + "prompt_tokens", "prompt tokens received",
                                          registry=r)
        self.generated_tokens = prom.Counter(PREFIX + "generation_tokens", "tokens generated",
                                             registry=r)
        self.cached_tokens = prom.Counter(PREFIX + "cached_prompt_tokens",
                                          "prompt tokens served from cached pages", registry=r)
        self.ttft = prom.Histogram(PREFIX + "time_to_first_token_seconds",
                                   "request received to first generated token",
                                   buckets=TTFT_BUCKETS, registry=r)
        self.itl = prom.Histogram(PREFIX + "inter_token_seconds", "between generated tokens",
                                  buckets=ITL_BUCKETS, registry=r)
        gauge = lambda name, doc, *labels: prom.Gauge(PREFIX + name, doc, labels,  # noqa: E731
                                                      registry=r)
        self.step_seconds = gauge("step_seconds", "engine step seconds since start, by part",
                                  "part")
        self.steps = gauge("steps", "engine steps since start")
        self.queued_requests = gauge("queued_requests", "requests queued or running")
        self.queued_prefill = gauge("queued_prefill_tokens", "prefill tokens still queued")
        self.pages_used = gauge("pages_used", "pool pages in use, by shard", "shard")
        self.pages_total = gauge("pages_per_shard", "pool pages of each shard")
        self.sessions = gauge("sessions", "sessions open")
        self.restoring = gauge("sessions_restoring", "sessions whose cache is being rebuilt")
        self.cache_entries = gauge("prefix_cache_entries",
                                   "sessions kept after stateless requests for prefix reuse")
        self.cache_hits = gauge("prefix_cache_hits", "requests that reused a cached prefix")

    def render(self, stats: dict) -> bytes:
        """Exposition text, the engine gauges set from `stats` (engine.stats() plus
        `restoring`)."""
        self.step_seconds.labels("host").set(stats.get("host_s_total", 0.0))
        self.step_seconds.labels("device").set(stats.get("device_s_total", 0.0))
        self.steps.set(stats.get("steps_total", 0))
        self.queued_requests.set(stats["requests"])
        self.queued_prefill.set(stats["queued_prefill_tokens"])
        for shard, used in enumerate(stats["pages_used_per_shard"]):
            self.pages_used.labels(str(shard)).set(used)
        self.pages_total.set(stats["pages_per_shard"])
        self.sessions.set(stats["sessions"])
        self.restoring.set(stats["restoring"])
        self.cache_entries.set(stats["prefix_cache"]["entries"])
        self.cache_hits.set(stats["prefix_cache"]["hits"])
        return prom.generate_latest(self.registry)
