"""Prometheus metrics, one registry per engine (two engines in a process must not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("meshlm_requests", "Requests by final status", ["status"], registry=r)
        self.prompt_tokens = Counter("meshlm_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter("meshlm_cached_prompt_tokens", "Prompt tokens served from cache", registry=r)
        self.generation_tokens = Counter("meshlm_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("meshlm_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("meshlm_inter_token_latency_seconds", "Time between tokens of a stream", buckets=_LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("meshlm_step_seconds", "Engine step duration", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("meshlm_queue_depth", "Sequences waiting to be admitted", registry=r)
        self.batch_size = Gauge("meshlm_batch_size", "Sequences running in the last step", registry=r)
        self.kv_bytes = Gauge("meshlm_kv_cache_bytes", "Bytes held by KV caches", registry=r)
        self.preemptions = Counter("meshlm_preemptions", "Sequences preempted for recompute", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
