"""streaming_timeline with marks in the tail: ms after a layer's last read lands (means / medians)."""
import sys, time, threading, statistics, bisect
sys.path.insert(0, "/work/s15c/benchmarks")
import streaming_timeline as T
from waste.runtime import cache
from waste.layers import moe
marks = {"wait returned": [], "spread returned": [], "weighted_sum returned": []}
w0 = cache.wait
def wait(*a, **k):
    r = w0(*a, **k); marks["wait returned"].append(time.perf_counter()); return r
cache.wait = wait
s0 = moe._spread_numba
def sp(*a, **k):
    r = s0(*a, **k); marks["spread returned"].append(time.perf_counter()); return r
moe._spread_numba = sp
ws0 = moe.weighted_sum
def ws(*a, **k):
    r = ws0(*a, **k); marks["weighted_sum returned"].append(time.perf_counter()); return r
moe.weighted_sum = ws
reads = []
from waste.layers import moe_cpu
import numpy as np
intos = []
i0 = moe_cpu.NumbaPairs.into
def into(self, x, slots, out):
    t = time.perf_counter(); i0(self, x, slots, out)
    intos.append((threading.current_thread() is threading.main_thread(), t, time.perf_counter(), int((slots >= 0).sum())))
moe_cpu.NumbaPairs.into = into
r0 = cache.ExpertCache._read
# capture the timeline's reads list by wrapping main's internals: re-implement the tail search here
import torch
from waste.engine import Engine
from waste.runtime.bench import _uniform_router
def timed_read(self, key, slot):
    t0 = time.perf_counter()
    try: return r0(self, key, slot)
    finally: reads.append((t0, time.perf_counter()))
cache.ExpertCache._read = timed_read
eng = Engine.load(sys.argv[1], budget=sys.argv[2])
m = eng.model; m.router = _uniform_router(m)
st = m.new_state(); m.forward(torch.arange(16), st, 0, last_only=True)
fed = torch.randint(0, m.embed.shape[0], (12,), generator=torch.Generator().manual_seed(0)).tolist()
for v in marks.values(): v.clear()
t0 = time.perf_counter()
for i in range(12): m.forward(torch.tensor([fed[i]]), st, 16 + i, last_only=True)
t1 = time.perf_counter(); eng.close()
# per spread return: the last read end before it, and the marks after that end and before the spread return
ends = sorted(e for _, e in reads if e > t0)
out = {k: [] for k in marks}
for sr in marks["spread returned"]:
    i = bisect.bisect_left(ends, sr) - 1
    if i < 0: continue
    le = ends[i]
    out["spread returned"].append(sr - le)
    wr = [w for w in marks["wait returned"] if le <= w <= sr]
    if wr: out["wait returned"].append(wr[-1] - le)
    j = bisect.bisect_left(marks["weighted_sum returned"], sr)
    if j < len(marks["weighted_sum returned"]): out["weighted_sum returned"].append(marks["weighted_sum returned"][j] - le)
mi = [(b - a, n) for mm, a, b, n in intos if a > t0]
import collections
byn = collections.defaultdict(list)
for d, n in mi: byn[n].append(d)
print("into calls by pairs (ms mean):", {n: (len(v), round(1e3*statistics.fmean(v), 3)) for n, v in sorted(byn.items())})
# the last into calls of each layer: those starting after the layer's last read end and before spread returned
lastn = []
for sr in marks["spread returned"]:
    i = bisect.bisect_left(ends, sr) - 1
    if i < 0: continue
    le = ends[i]
    c = [(mm, a - le, b - le, n) for mm, a, b, n in intos if le <= a <= sr]
    lastn.append(c)
mainp = [sum(n for mm, a, b, n in c if mm) for c in lastn]; poolp = [sum(n for mm, a, b, n in c if not mm) for c in lastn]
print("after the last landing: pairs on main mean", statistics.fmean(mainp), "on pool", statistics.fmean(poolp),
      "main into start mean", statistics.fmean([a for c in lastn for mm, a, b, n in c if mm] or [0]),
      "pool into start mean", statistics.fmean([a for c in lastn for mm, a, b, n in c if not mm] or [0]),
      "pool into end mean", statistics.fmean([b for c in lastn for mm, a, b, n in c if not mm] or [0]))
print(f"{12/(t1-t0):.2f} tok/s; ms after the layer's last read lands: " + ", ".join(
    f"{k} mean {1e3*statistics.fmean(v):.3f} median {1e3*statistics.median(v):.3f}" for k, v in out.items() if v))
