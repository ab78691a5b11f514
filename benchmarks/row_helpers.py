"""The two exact helpers the int8 rows share (docs/LEARNED.md §10f), us a call, from a fast-math caller's loop:
q4_int8.quantize_row at K = 2048 and 768 (groups of 64), and cpu_kernels.act over a row of 768.

    python benchmarks/row_helpers.py
"""
import time

import numba
import numpy as np

from waste.layers.cpu_kernels import act
from waste.quant.q4_int8 import quantize_row


@numba.njit(fastmath=True)
def quantize_loop(x, G, n, xq, d, e, s):
    for _ in range(n):
        quantize_row(x, G, xq, d, e, s)


@numba.njit(fastmath=True)
def act_loop(g, u, n, limit):
    for _ in range(n):
        for i in range(g.shape[0]):
            g[i] = act(g[i], u[i], limit) * np.float32(1e-30) + g[i]


rng = np.random.default_rng(0)
for K in (2048, 768):
    G = K // 64
    x = rng.standard_normal(K).astype(np.float32)
    xq, d, e, s = np.empty(K, np.int16), *(np.empty(G, np.float32) for _ in range(3))
    quantize_loop(x, G, 10, xq, d, e, s)
    t = time.perf_counter()
    quantize_loop(x, G, 20000, xq, d, e, s)
    print(f"quantize_row K = {K}: {(time.perf_counter() - t) / 20000 * 1e6:.2f} us")
g, u = rng.standard_normal(768).astype(np.float32), rng.standard_normal(768).astype(np.float32)
act_loop(g, u, 1, np.float32(-1))
t = time.perf_counter()
act_loop(g, u, 2000, np.float32(-1))
print(f"act over 768: {(time.perf_counter() - t) / 2000 * 1e6:.2f} us")
