"""The engine worker: one thread owns the model and serves every request through a bounded FIFO queue.

Requests wait in arrival order (at most `max_queue` of them; past that `submit` raises QueueFull, which the
server answers with 503 + Retry-After). Up to `max_batch` run at once, and every step advances each of them by
one forward: a newcomer's whole prompt (prefill) or a running request's last token (decode). The step is one
`DecoderModel.step`, the same call Engine.generate makes for a request alone: it runs attention and the dense parts
per sequence and asks the expert store once per MoE layer for the union of the experts all sequences route to
(`ExpertCache.resident`): one read serves every request routed to an expert, and no request's rows share a matmul
with another's, so its tokens and logits are bit-identical to serving it alone. Every family is batched so (GLM-5.3's
mHC streams plug into the shared step through its block hooks).

A request's text comes back as events through its own `post` callable (the server wraps
`loop.call_soon_threadsafe` around an asyncio queue): Delta(text, logprobs) as tokens are decided, then one
Done or Failed. `cancel()` is seen at the next step: a cancelled request stops within one decode step.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine import Decoding


class QueueFull(Exception):
    """The waiting queue is at its bound."""


@dataclass
class Delta:
    text: str
    logprobs: list = field(default_factory=list)   # (token id, logprob, [(id, logprob), ...]) per token


@dataclass
class Done:
    finish_reason: str           # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    error: BaseException


class Job:
    """One request in the scheduler: its prompt ids, its Decoding (sampling, stop strings, end ids, max tokens)
    and where its events go. `logits`: set to [] to keep every step's logits (tests of determinism)."""

    def __init__(self, prompt_ids: list[int], decoding: Decoding, post: Callable[[object], None]):
        self.prompt_ids, self.decoding, self.post = list(prompt_ids), decoding, post
        self.cancelled = False
        self.logits: list | None = None
        self.state = None            # the model's per-layer state, made when the request starts
        self.pos = 0                 # tokens the state holds
        self.next_ids: list[int] = self.prompt_ids
        self.leader: Job | None = None  # n > 1: the request's first choice, whose prefill this one shares
        self.group: list | None = None   # [choices still running, the leader's state] (set by share_prefill)
        self.submitted = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def completion_tokens(self) -> int:
        return len(self.decoding.token_ids)


def share_prefill(jobs: list[Job]) -> None:
    """Choices of one request (n > 1): the first one's prefill serves them all when they start in the same step.
    The others branch its state (the layers' caches copy on their first divergent append, layers/rows.py), and it
    goes back to the model's pool only once every choice has ended (a branch may still read its rows)."""
    group = [len(jobs), None]
    for j in jobs:
        j.group = group
        j.leader = jobs[0] if j is not jobs[0] else None


def batch_limit(engine, wanted: int) -> int:
    """At most `wanted` requests at once, and no more than the expert cache holds working sets of: a batch whose
    experts do not fit evicts, every step, what the next step needs (docs/LEARNED.md §6 measured it reading
    three times the bytes per token of one request alone)."""
    slots = getattr(engine.experts, "n_slots", 0)
    per_token = (engine.model.top_k or 0) * len(getattr(engine.experts, "banks", ()))
    if slots and per_token and getattr(engine.experts, "n_records", 0) > slots:
        return max(1, min(wanted, slots // per_token))
    return max(1, wanted)


class Scheduler:
    def __init__(self, engine, max_queue: int = 64, max_batch: int = 8, metrics=None):
        self.engine, self.model = engine, engine.model
        self.max_queue, self.max_batch, self.metrics = max_queue, batch_limit(engine, max_batch), metrics
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.cv = threading.Condition()
        self.steps = 0
        self.batch_sizes: dict[int, int] = {}     # step batch size -> steps (how much batching happened)
        self._stop = False
        self._threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self._loop, name="waste-engine", daemon=True)
        self.thread.start()

    # -- the server's side -------------------------------------------------------------------------
    def submit(self, *jobs: Job) -> None:
        """Queue jobs (several at once: they are admitted together). QueueFull when they do not fit."""
        with self.cv:
            if self._stop:
                raise QueueFull("the server is shutting down")
            slots = self.max_batch - len(self.running)          # requests that start at the next step
            if len(self.waiting) + len(jobs) - max(slots, 0) > self.max_queue:
                raise QueueFull(f"{len(self.running)} requests are running and {len(self.waiting)} waiting "
                                f"(the bound is {self.max_queue})")
            self.waiting.extend(jobs)
            self.cv.notify()

    @property
    def depth(self) -> int:
        return len(self.waiting)

    @property
    def active(self) -> int:
        return len(self.running)

    def close(self, timeout: float | None = None) -> bool:
        """Stop taking work, cancel what is queued or running (after the step in progress); False when the
        worker is still inside that step after `timeout` seconds."""
        with self.cv:
            self._stop = True
            self.cv.notify()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    # -- the worker --------------------------------------------------------------------------------
    def _loop(self) -> None:
        # the creating thread's torch thread count: a new thread would otherwise start from OpenMP's default
        torch.set_num_threads(self._threads)
        while True:
            with self.cv:
                while not self._stop and not self.waiting and not self.running:
                    self.cv.wait()
                if self._stop:
                    jobs = list(self.waiting) + self.running
                    self.waiting.clear()
                    self.running = []
                    break
                while self.waiting and len(self.running) < self.max_batch:
                    self.running.append(self.waiting.popleft())
            self._step()
        for job in jobs:
            self._end(job, "cancelled")

    def _step(self) -> None:
        for job in [j for j in self.running if j.cancelled]:
            self._end(job, "cancelled")
        jobs = list(self.running)
        if not jobs:
            return
        items, branches = [], {}
        for job in jobs:
            if job.state is None and job.leader in jobs and job.leader.pos == 0:
                branches.setdefault(job.leader, []).append(job)      # starts from its leader's prefill
                continue
            if job.state is None:
                job.state = self.model.take_state()
            rows = job.decoding.images if job.pos == 0 else None     # a prompt's image rows (prefill only)
            items.append((torch.tensor(job.next_ids), job.state, job.pos, rows))
        jobs = [j for j in jobs if not any(j in b for b in branches.values())]
        t0 = time.perf_counter()
        try:
            logits = self.model.step(items)
        except BaseException as e:     # a damaged record, out of memory...: every request in the step fails
            for job in jobs:
                self._end(job, None, e)
            return
        dt = time.perf_counter() - t0
        self.steps += 1
        self.batch_sizes[len(jobs)] = self.batch_sizes.get(len(jobs), 0) + 1
        prefill = sum(len(j.next_ids) for j in jobs if j.pos == 0)
        for job, lg in zip(jobs, logits):
            for b in branches.get(job, ()):
                b.state = list(job.state)
            for b in [job, *branches.get(job, ())]:
                self._advance(b, lg[-1])
        if self.metrics is not None:
            self.metrics.step(len(jobs), prefill, dt)

    def _advance(self, job: Job, logits: torch.Tensor) -> None:
        d = job.decoding
        if job.logits is not None:
            job.logits.append(logits.clone())
        job.pos += len(job.next_ids)
        n_lp = len(d.token_logprobs)
        tok = d.sample(logits)
        if job.first_token_at is None:
            job.first_token_at = time.monotonic()
        piece = d.feed(tok)
        lps = [lp for lp in d.token_logprobs[n_lp:] if lp[0] not in d.stop_ids]
        if d.finish_reason is not None:
            piece += d.finish()
        if piece or lps:
            self._post(job, Delta(piece, lps))
        if self.metrics is not None:
            self.metrics.token(job)
        if d.finish_reason is not None:
            self._end(job, d.finish_reason)
        else:
            job.next_ids = [tok]

    def _end(self, job: Job, reason: str | None, error: BaseException | None = None) -> None:
        if job in self.running:
            self.running.remove(job)
        if job.group is not None:   # a choice of n: the leader's state waits for every branch of it to end
            if job.leader is None and job.state is not None:
                job.group[1] = job.state
            job.group[0] -= 1
            if job.group[0] == 0 and job.group[1] is not None:
                self.model.give_state(job.group[1])
        elif job.state is not None:  # the KV / recurrent state goes back to the model's pool for the next request
            self.model.give_state(job.state)
        job.state = None
        job.finished_at = time.monotonic()
        if error is not None:
            self._post(job, Failed(error))
        else:
            self._post(job, Done(reason, len(job.prompt_ids), job.completion_tokens))
        if self.metrics is not None:
            self.metrics.finished(job, reason if error is None else "error")

    @staticmethod
    def _post(job: Job, event) -> None:
        try:
            job.post(event)
        except RuntimeError:       # the server's event loop is gone (shutdown): nobody is listening
            pass
