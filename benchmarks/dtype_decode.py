"""Decode ms per token of one container at several compute dtypes, the engines loaded side by side and their runs
interleaved (a 128-token prompt, then 32 greedy tokens, 3 rounds; two threads; the background fill waited for).
docs/LEARNED.md §10d.

    python benchmarks/dtype_decode.py CONTAINER float32,bfloat16
"""
import statistics
import sys
import time

import torch

from waste.engine import Engine

path, dts = sys.argv[1], sys.argv[2].split(",")
torch.set_num_threads(2)
engs = {}
for dt in dts:
    e = Engine.load(path, dtype=dt)
    e.experts.wait_fill()
    engs[dt] = e
ids = torch.tensor(engs[dts[0]].encode("def fibonacci(n):\n" * 40)[:128])
res = {dt: [] for dt in dts}
for r in range(3):
    for dt in dts:
        m = engs[dt].model
        st = m.new_state()
        with torch.inference_mode():
            lg = m.forward(ids, st, 0, last_only=True)[-1]
            t = time.perf_counter()
            for i in range(32):
                lg = m.forward(torch.tensor([int(lg.argmax())]), st, 128 + i, last_only=True)[-1]
            res[dt].append((time.perf_counter() - t) / 32 * 1e3)
for dt in dts:
    print(dt, "ms/token", [round(v, 2) for v in res[dt]], "median", round(statistics.median(res[dt]), 2))
