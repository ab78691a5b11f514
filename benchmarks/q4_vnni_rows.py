"""One q4 matrix times R rows (docs/LEARNED.md §10f): the VNNI rows (quant/q4_vnni.py, one thread) against the
decode row called R times (one thread) and torch's int4 kernel (x in bf16, torch's thread count), us a call and
GMAC/s, median of 7 x 20 calls; also checks that each block's rows are bit-equal to the decode row's `block_out`.

    OPENBLAS_NUM_THREADS=1 python benchmarks/q4_vnni_rows.py N K R      # e.g. 768 2048 8, 5120 2048 128
"""
import sys
import time

import numba
import numpy as np
import torch

from waste.quant.formats import get_format
from waste.quant.q4_int8 import block_out, quantize_row
from waste.quant.q4_vnni import block_rows_i8

N, K, R = (int(a) for a in sys.argv[1:4])
fmt = get_format("q4")
torch.manual_seed(0)
parts = fmt.pack(torch.randn(N, K) * 0.02)
q, sz = parts["q"].contiguous(), parts["sz"].contiguous()
G = sz.shape[0]
X = torch.randn(R, K).numpy()
Xb = torch.from_numpy(X).bfloat16()


@numba.njit(fastmath=True)
def quant(X, G, XQ, D, D8, SX):
    for r in range(X.shape[0]):
        quantize_row(X[r], G, XQ[r], D[r], D8[r], SX[r])


@numba.njit
def vnni(qa, sa, N, XQ, D, D8, SX, xi, nr, tile, acc, Y):
    for b in range(N // 64):
        block_rows_i8(qa + b * 32 * XQ.shape[1], sa + b * 64 * 4, N, XQ, D, D8, SX, xi, nr, tile, acc)
        for r in range(nr):
            Y[r, b * 64:b * 64 + 64] = acc[r]


@numba.njit
def decode(qa, sa, N, xq, d, d8, sx, y):
    for b in range(N // 64):
        block_out(qa + b * 32 * xq.shape[0], sa + b * 64 * 4, N, xq, d, d8, sx, y, b * 64)


XQ = np.empty((R, K), np.int8)
D, D8, SX = (np.empty((R, G), np.float32) for _ in range(3))
quant(X, G, XQ, D, D8, SX)
XQ16 = XQ.astype(np.int16)
xi, tile, acc = np.arange(R, dtype=np.int64), np.empty(K // G // 4 * 256, np.uint8), np.empty((R, 64), np.float32)
Y, Yd = np.zeros((R, N), np.float32), np.zeros((R, N), np.float32)
qa, sa = q.data_ptr(), sz.data_ptr()
vnni(qa, sa, N, XQ, D, D8, SX, xi, R, tile, acc, Y)
for r in range(R):
    decode(qa, sa, N, XQ16[r], D[r], D8[r], SX[r], Yd[r])
print(f"{N} x {K}, {R} rows: bit-equal to the decode row: {bool((Y == Yd).all())}")
arms = {"VNNI rows, 1 thread": lambda: vnni(qa, sa, N, XQ, D, D8, SX, xi, R, tile, acc, Y),
        "decode row x R, 1 thread": lambda: [decode(qa, sa, N, XQ16[r], D[r], D8[r], SX[r], Yd[r]) for r in range(R)],
        f"torch int4, {torch.get_num_threads()} threads": lambda: torch._weight_int4pack_mm_for_cpu(Xb, q, K // G, sz)}
for name, f in arms.items():
    f()
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(20):
            f()
        ts.append((time.perf_counter() - t) / 20 * 1e6)
    us = sorted(ts)[3]
    print(f"  {name:<26} {us:9.1f} us  {N * K * R / us / 1e3:6.1f} GMAC/s")
