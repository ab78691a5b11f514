import sys, time, threading, statistics, runpy
sys.path.insert(0, "/work/s15c/benchmarks")
from collections import defaultdict
from waste.layers import moe_cpu
took = defaultdict(list)
def wrap(name, label_fn):
    f = getattr(moe_cpu.NumbaPairs, name)
    def w(self, *a):
        t = time.perf_counter(); f(self, *a)
        if threading.current_thread() is threading.main_thread():
            took[label_fn(a)].append(time.perf_counter() - t)
    setattr(moe_cpu.NumbaPairs, name, w)
wrap("into", lambda a: f"into {int((a[1] >= 0).sum())} pair(s)")
if hasattr(moe_cpu.NumbaPairs, "into_shared"):
    wrap("into_shared", lambda a: "into_shared (1 pair)")
sys.argv = ["tl"] + sys.argv[1:]
import streaming_timeline
streaming_timeline.main()
for k, v in sorted(took.items()):
    v = v[len(v)//3:]
    print(f"{k}: {len(v)} calls, median {1e3*statistics.median(v):.3f} mean {1e3*statistics.fmean(v):.3f} ms")
