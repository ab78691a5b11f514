"""What the server measures, exposed through prometheus_client at GET /metrics (text format 0.0.4).

Kept as they happen: requests by endpoint and status, generations finished by reason, prompt and generated
tokens, engine steps, and three histograms (time to first token, inter-token latency, request duration), so that
p50 / p99 can be read with histogram_quantile(). Read at each scrape (a collector): whether the model is ready,
generated tokens per second over the last `window` seconds, the queue, and the expert cache's counters.
Every series carries the served model's id as `model`.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds; a first token waits for a queue and a prefill, a request for its whole generation
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                    960.0)


class Metrics:
    """One server's metrics in a registry of its own. `model()` names the served model (it is known only once
    the model is loaded); `live()` returns (ready, scheduler or None, expert store or None) at scrape time."""

    def __init__(self, model=lambda: "waste", live=lambda: (False, None, None), window: float = 10.0):
        self.model, self.live, self.window = model, live, window
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model"]
        self._requests = Counter("waste_requests", "HTTP requests by endpoint and status code",
                                 m + ["endpoint", "status"], registry=r)
        self._finished = Counter("waste_requests_finished", "generations finished, by reason", m + ["reason"],
                                 registry=r)
        self._prompt = Counter("waste_prompt_tokens", "prompt tokens prefilled", m, registry=r)
        self._generated = Counter("waste_generation_tokens", "tokens generated", m, registry=r)
        self._steps = Counter("waste_engine_steps", "batched forward steps", m, registry=r)
        self._step_seconds = Counter("waste_engine_step_seconds", "time spent in forward steps", m, registry=r)
        self._sequences = Counter("waste_engine_step_sequences", "sequences advanced, summed over steps (divided by "
                                  "steps: the mean batch)", m, registry=r)
        self._ttft = Histogram("waste_time_to_first_token_seconds", "time from queueing to the first token", m,
                               buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram("waste_inter_token_latency_seconds", "time between a request's successive tokens", m,
                              buckets=ITL_BUCKETS, registry=r)
        self._duration = Histogram("waste_request_duration_seconds", "time from queueing to the end of generation",
                                   m, buckets=DURATION_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()   # (time, tokens) of recent steps
        self._last_token: dict = {}                        # job -> when its latest token was decided
        r.register(_Live(self))

    # -- updates (the scheduler's thread and the event loop) --------------------------------------------------
    def request(self, endpoint: str, status: int) -> None:
        self._requests.labels(self.model(), endpoint, str(status)).inc()

    def step(self, batch: int, prefill_tokens: int, seconds: float) -> None:
        m = self.model()
        self._steps.labels(m).inc()
        self._step_seconds.labels(m).inc(seconds)
        self._sequences.labels(m).inc(batch)
        self._prompt.labels(m).inc(prefill_tokens)

    def token(self, job) -> None:
        """A token of `job` was decided."""
        now = time.monotonic()
        self._generated.labels(self.model()).inc()
        with self._lock:
            last = self._last_token.get(job)
            self._last_token[job] = now
            self._recent.append((now, 1))
            self._trim(now)
        if last is not None:
            self._itl.labels(self.model()).observe(now - last)

    def finished(self, job, reason: str) -> None:
        m = self.model()
        with self._lock:
            self._last_token.pop(job, None)
        self._finished.labels(m, reason).inc()
        if job.first_token_at is not None:
            self._ttft.labels(m).observe(job.first_token_at - job.submitted)
        if job.finished_at is not None:
            self._duration.labels(m).observe(job.finished_at - job.submitted)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()

    # -- reading -------------------------------------------------------------------------------------------
    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            n = sum(k for _, k in self._recent)
        return n / self.window

    def value(self, name: str, **labels) -> float:
        """The sum of the samples of `name` whose labels include these (0 when none): for tests and tools."""
        total = 0.0
        for family in self.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items()):
                    total += s.value
        return total

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """The values read at scrape time: readiness, recent speed, the queue, the expert cache."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def describe(self):
        return []          # nothing fixed to check against the registry's other names

    def collect(self):
        model = self.m.model()
        ready, scheduler, experts = self.m.live()

        def gauge(name, help_, value):
            g = GaugeMetricFamily(name, help_, labels=["model"])
            g.add_metric([model], value)
            return g

        def counter(name, help_, value):
            c = CounterMetricFamily(name, help_, labels=["model"])
            c.add_metric([model], value)
            return c

        yield gauge("waste_ready", "1 when the model is loaded and serving", int(ready))
        yield gauge("waste_generation_tokens_per_second",
                    f"tokens generated per second over the last {self.m.window:g} s", self.m.tokens_per_second())
        if scheduler is not None:
            yield gauge("waste_num_requests_waiting", "requests in the queue", scheduler.depth)
            yield gauge("waste_num_requests_running", "requests being generated", scheduler.active)
            yield gauge("waste_queue_capacity", "the queue's bound (--max-queue)", scheduler.max_queue)
        if experts is not None:
            s = experts.stats
            total = s.hits + s.misses
            yield counter("waste_expert_cache_hits", "expert lookups found resident", s.hits)
            yield counter("waste_expert_cache_misses", "expert lookups read from disk", s.misses)
            yield gauge("waste_expert_cache_hit_rate", "hits / (hits + misses) since start",
                        s.hits / total if total else 0.0)
            yield counter("waste_expert_bytes_read", "bytes of expert records read for misses", s.bytes_read)
            yield counter("waste_expert_fill_bytes", "bytes read by the background fill",
                          getattr(experts, "fill_bytes", 0))
            yield counter("waste_expert_read_seconds", "time spent reading expert records", s.read_seconds)
            yield counter("waste_expert_cache_evictions", "records evicted", s.evictions)
            yield gauge("waste_expert_cache_budget_bytes", "the expert cache's size", getattr(experts, "budget_bytes", 0))
