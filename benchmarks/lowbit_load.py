"""What a fresh process pays before its first mxfp4 row: import, one mxfp4 row and one unpack of a 64 x 64 matrix
(numba loads its cached kernels, or compiles them the first time on a machine). docs/LEARNED.md §10d.

    python benchmarks/lowbit_load.py          # run it a few times: each run is a fresh process
"""
import time

import torch

t = time.perf_counter()
from waste.quant.formats import get_format  # noqa: E402

f, shape = get_format("mxfp4"), (64, 64)
p = f.pack(torch.randn(shape))
f.linear(torch.randn(1, 64), f.prepare(p, shape), shape)
f.unpack(p, shape, torch.float32)
print(f"{time.perf_counter() - t:.2f} s")
