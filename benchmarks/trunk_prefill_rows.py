"""One trunk matrix times 128 prefill rows at 2 threads, ms, median of 20 after one (docs/LEARNED.md §10f): q4 as
the unpacked sgemm (quant/q4_rows.py) against the VNNI rows (quant/q4_vnni.py); q8 as torch's float32 path
(Q8.linear) against the VNNI rows (quant/q8_rows.py). Shapes as N x K.

    python benchmarks/trunk_prefill_rows.py [N K ...]       # default: 320 320 512 512 1024 1024 5120 2048
"""
import statistics
import sys
import time

import torch

from waste.quant import q4_rows, q4_vnni, q8_rows
from waste.quant.formats import get_format

torch.set_num_threads(2)
nums = [int(a) for a in sys.argv[1:]] or [320, 320, 512, 512, 1024, 1024, 5120, 2048]
for shape in zip(nums[::2], nums[1::2]):
    x = torch.randn(128, shape[1])
    arms = {}
    for name, fmt, fn in (("q4 unpack+sgemm", "q4", q4_rows.linear_rows), ("q4 VNNI", "q4", q4_vnni.linear),
                          ("q8 torch float32", "q8", None), ("q8 VNNI", "q8", q8_rows.linear)):
        f = get_format(fmt)
        parts = f.pack(torch.randn(shape) / shape[1] ** 0.5)
        arms[name] = (lambda f=f, p=parts, fn=fn: fn(x, p, shape) if fn else f.linear(x, p, shape))
    out = []
    for name, call in arms.items():
        call()
        v = []
        for _ in range(20):
            t = time.perf_counter()
            call()
            v.append((time.perf_counter() - t) * 1e3)
        out.append(f"{name} {statistics.median(v):.3f}")
    print(f"{shape[0]} x {shape[1]}: " + ", ".join(out) + " ms")
