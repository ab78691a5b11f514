"""Where a streamed decode step leaves the disk idle: every record read, attention and router section timed in one
process (uniform routing, seeded random tokens), then per layer the idle pieces between one layer's last read and
the next layer's first: the tail (the last record's pair and the step's bookkeeping), attention, the router, and
router -> first read (the residency call and a reader thread's wake-up, or the io_submit of Linux AIO).

    ../shared/tools/laptop --drop-caches 1100M -- python benchmarks/streaming_timeline.py /tmp/peers/q30b6_q4.waste

Nothing here is a test.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import statistics
import threading
import time

import torch

from waste import timing
from waste.engine import Engine
from waste.runtime import cache
from waste.runtime.bench import _uniform_router


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--budget", help="expert budget (default: the memory plan's, e.g. under laptop)")
    ap.add_argument("--aio-depth", type=int, help="Linux AIO reads in flight at once (cache.AIO_DEPTH)")
    a = ap.parse_args()
    if a.aio_depth is not None:
        cache.AIO_DEPTH = a.aio_depth
    reads, sections = [], []          # (start, end); (name, start, end) on the decoding thread
    read = cache.ExpertCache._read

    def timed_read(self, key, slot):
        t0 = time.perf_counter()
        try:
            return read(self, key, slot)
        finally:
            reads.append((t0, time.perf_counter()))

    class Log(timing.Timer):
        @contextlib.contextmanager
        def section(self, name):
            t0 = time.perf_counter()
            with super().section(name):
                yield
            if threading.current_thread() is threading.main_thread():
                sections.append((name, t0, time.perf_counter()))

    landed = getattr(cache.ExpertCache, "_landed_direct", None)      # a tree without Linux AIO reads has none

    def timed_landed(self, key, slot, fut, t0, res):      # a Linux AIO read: from its io_submit to its landing
        try:
            return landed(self, key, slot, fut, t0, res)
        finally:
            reads.append((t0, time.perf_counter()))

    cache.ExpertCache._read = timed_read
    if landed is not None:
        cache.ExpertCache._landed_direct = timed_landed
    eng = Engine.load(a.model, dtype=a.dtype, budget=a.budget)
    try:
        m = eng.model
        m.router = _uniform_router(m)
        state = m.new_state()
        m.forward(torch.arange(16), state, 0, last_only=True)
        fed = torch.randint(0, m.embed.shape[0], (a.n,), generator=torch.Generator().manual_seed(0)).tolist()
        m.timer = Log()
        t0 = time.perf_counter()
        for i in range(a.n):
            m.forward(torch.tensor([fed[i]]), state, 16 + i, last_only=True)
        t1 = time.perf_counter()
    finally:
        eng.close()
    busy, cur = 0.0, None
    for s, e in sorted((max(s, t0), min(e, t1)) for s, e in reads if e > t0 and s < t1):
        if cur is None or s > cur[1]:
            busy += cur[1] - cur[0] if cur else 0.0
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    busy += cur[1] - cur[0] if cur else 0.0
    print(f"{eng.dtype}: decode {a.n / (t1 - t0):.2f} tok/s, {1e3 * (t1 - t0) / a.n:.1f} ms a token, the disk busy "
          f"{100 * busy / (t1 - t0):.0f}% of it")
    ends, starts = sorted(e for _, e in reads), sorted(s for s, _ in reads)
    att = [(s, e) for n, s, e in sections if n == "attention" and s > t0]
    rt = sorted((s, e) for n, s, e in sections if n == "router" and s > t0)
    pieces = {"tail": [], "attention": [], "router": [], "router -> first read": []}
    for s, e in att:
        i, j = bisect.bisect_left(ends, s) - 1, bisect.bisect_left(starts, e)
        r = rt[bisect.bisect_left(rt, (e, 0.0))] if bisect.bisect_left(rt, (e, 0.0)) < len(rt) else None
        if i < 0 or j >= len(starts) or r is None:
            continue
        for k, v in (("tail", s - ends[i]), ("attention", e - s), ("router", r[1] - r[0]),
                     ("router -> first read", starts[j] - r[1])):
            pieces[k].append(v)
    print("per layer, medians (ms): " + ", ".join(f"{k} {1e3 * statistics.median(v):.2f}" for k, v in pieces.items()
                                                   if v) + f" ({len(pieces['attention'])} layers)")
    # the means are what the step pays (a few slow layers, a reader or the pool taking the core, move them and not
    # the medians: docs/LEARNED.md §3n)
    print("per layer, means (ms): " + ", ".join(f"{k} {1e3 * statistics.fmean(v):.2f}" for k, v in pieces.items()
                                                 if v) + f"; idle {1e3 * (t1 - t0 - busy) / a.n:.1f} ms a token")


if __name__ == "__main__":
    main()
