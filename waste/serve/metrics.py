"""Counters the server keeps, rendered as Prometheus text (exposition format 0.0.4) at GET /metrics.

Requests by endpoint and status; prompt and generated tokens; generated tokens per second over the last
`window` seconds; requests waiting and running; time to first token and request duration (sum and count);
the expert cache's hits, misses, hit rate, bytes read and evictions.
"""
from __future__ import annotations

import threading
import time
from collections import deque


class Metrics:
    def __init__(self, window: float = 10.0):
        self.lock = threading.Lock()
        self.window = window
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_by_reason: dict[str, int] = {}
        self.ttft_sum, self.ttft_count = 0.0, 0
        self.e2e_sum, self.e2e_count = 0.0, 0
        self.steps = 0
        self.step_seconds = 0.0
        self.batched_sequences = 0
        self._recent: deque[tuple[float, int]] = deque()   # (time, tokens) of recent steps
        self.started = time.time()

    # -- updates -----------------------------------------------------------------------------------
    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def step(self, batch: int, prefill_tokens: int, seconds: float) -> None:
        with self.lock:
            self.steps += 1
            self.step_seconds += seconds
            self.batched_sequences += batch
            self.prompt_tokens += prefill_tokens

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.generation_tokens += n
            self._recent.append((now, n))
            self._trim(now)

    def finished(self, job, reason: str) -> None:
        with self.lock:
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
            if job.first_token_at is not None:
                self.ttft_sum += job.first_token_at - job.submitted
                self.ttft_count += 1
            if job.finished_at is not None:
                self.e2e_sum += job.finished_at - job.submitted
                self.e2e_count += 1

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self.lock:
            self._trim(now)
            n = sum(k for _, k in self._recent)
        return n / self.window

    # -- exposition --------------------------------------------------------------------------------
    def render(self, model: str, scheduler=None, experts=None, ready: bool = True) -> str:
        out: list[str] = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in {"model": model, **labels}.items())
                out.append(f"{name}{{{lab}}} {_num(value)}")

        def summary(name, help_, total, count):
            lab = f'model="{_escape(model)}"'
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} summary", f"{name}_sum{{{lab}}} {_num(total)}",
                        f"{name}_count{{{lab}}} {_num(count)}"])

        tps = self.tokens_per_second()
        with self.lock:
            metric("waste_ready", "gauge", "1 when the model is loaded and serving", [({}, int(ready))])
            metric("waste_requests_total", "counter", "HTTP requests by endpoint and status code",
                   [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
            metric("waste_requests_finished_total", "counter", "generations finished, by reason",
                   [({"reason": r}, n) for r, n in sorted(self.finished_by_reason.items())])
            metric("waste_prompt_tokens_total", "counter", "prompt tokens prefilled", [({}, self.prompt_tokens)])
            metric("waste_generation_tokens_total", "counter", "tokens generated", [({}, self.generation_tokens)])
            metric("waste_generation_tokens_per_second", "gauge",
                   f"tokens generated per second over the last {self.window:g} s", [({}, tps)])
            summary("waste_time_to_first_token_seconds", "time from queueing to the first token",
                    self.ttft_sum, self.ttft_count)
            summary("waste_request_duration_seconds", "time from queueing to the end of generation",
                    self.e2e_sum, self.e2e_count)
            metric("waste_engine_steps_total", "counter", "batched forward steps", [({}, self.steps)])
            metric("waste_engine_step_seconds_total", "counter", "time spent in forward steps",
                   [({}, self.step_seconds)])
            metric("waste_engine_step_sequences_total", "counter", "sequences advanced, summed over steps "
                   "(divided by steps: the mean batch)", [({}, self.batched_sequences)])
        if scheduler is not None:
            metric("waste_num_requests_waiting", "gauge", "requests in the queue", [({}, scheduler.depth)])
            metric("waste_num_requests_running", "gauge", "requests being generated", [({}, scheduler.active)])
            metric("waste_queue_capacity", "gauge", "the queue's bound (--max-queue)", [({}, scheduler.max_queue)])
        if experts is not None:
            s = experts.stats
            total = s.hits + s.misses
            metric("waste_expert_cache_hits_total", "counter", "expert lookups found resident", [({}, s.hits)])
            metric("waste_expert_cache_misses_total", "counter", "expert lookups read from disk", [({}, s.misses)])
            metric("waste_expert_cache_hit_rate", "gauge", "hits / (hits + misses) since start",
                   [({}, s.hits / total if total else 0.0)])
            metric("waste_expert_bytes_read_total", "counter", "bytes of expert records read for misses",
                   [({}, s.bytes_read)])
            metric("waste_expert_fill_bytes_total", "counter", "bytes read by the background fill",
                   [({}, getattr(experts, "fill_bytes", 0))])
            metric("waste_expert_read_seconds_total", "counter", "time spent reading expert records",
                   [({}, s.read_seconds)])
            metric("waste_expert_cache_evictions_total", "counter", "records evicted", [({}, s.evictions)])
            metric("waste_expert_cache_budget_bytes", "gauge", "the expert cache's size",
                   [({}, getattr(experts, "budget_bytes", 0))])
        return "\n".join(out) + "\n"


def _num(v) -> str:
    if isinstance(v, float):
        return repr(v) if v == v else "NaN"
    return str(v)


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
