"""All k routed expert pairs of one decode row through the CPU kernel (layers/cpu_kernels.py pairs_q4: gate, up,
SwiGLU, down of q4 records read in place) against torch's int4 kernel matrix by matrix, and the kernel at 1 and 2
numba threads (docs/LEARNED.md §10). Random q4 experts of the given widths, 16 of them, k = 8 unless given.

    python benchmarks/q4_pairs.py HIDDEN INTER [TREE] [K]      # e.g. 2048 768 (Qwen3-30B-A3B), 320 96 (bundled)
"""
import sys
import time

import numba
import numpy as np
import torch

sys.path.insert(0, sys.argv[3] if len(sys.argv) > 3 else ".")
from waste.layers import moe_cpu
from waste.quant.intq import Q4 as _Q4
Q4 = _Q4("q4", 64)
torch.set_num_threads(1)
h, inter, E, k = int(sys.argv[1]), int(sys.argv[2]), 16, int(sys.argv[4]) if len(sys.argv) > 4 else 8
ks = moe_cpu._kernels()
torch.manual_seed(0)
parts = {}
for m, shp in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
    P = [Q4.pack(torch.randn(shp) * 0.02) for _ in range(E)]
    parts[m] = (torch.stack([p["q"] for p in P]), torch.stack([p["sz"] for p in P]))
flats, os = [], []
for m in ("gate", "up", "down"):
    q, sz = parts[m]
    fq = q.reshape(E, -1).numpy(); fz = sz.reshape(E, -1).view(torch.int16).numpy().view(np.uint16)
    flats += [fq.reshape(-1), fz.reshape(-1)]; os += [(0, fq.shape[1]), (0, fz.shape[1])]
os = np.array(os, np.int64)
groups = np.array([parts[m][1].shape[1] for m in ("gate", "up", "down")], np.int64)
x = torch.randn(1, h); slots = torch.arange(k, dtype=torch.int64)[None] * 2
out = np.zeros((k, h), np.float32)
f = ks["q4"]
args = (x.data_ptr(), h, slots.data_ptr(), k, *flats, os, groups, inter, np.float32(-1), out)
f(*args)
ts = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(10): f(*args)
    ts.append((time.perf_counter() - t) / 10)
med = sorted(ts)[3]
nbytes = k * 3 * h * inter / 2
print(f"numba pairs q4 h={h} inter={inter} k={k}: {med*1e6:.0f} us per row-call, {nbytes/med/1e9:.1f} GB/s, {med/k/3*1e6:.1f} us/matrix")
# torch int4 kernel per matrix for comparison
from waste.quant import int4pack
q, sz = parts["gate"]
xd = torch.randn(1, inter)
ts = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(10):
        for e in range(k):
            for m in ("gate", "up", "down"):
                xin = x if m != "down" else xd                       # torch's int4 kernel (x as bf16), per matrix
                int4pack.int4_mm(xin, parts[m][0][e], xin.shape[1] // parts[m][1][e].shape[0], parts[m][1][e])
    ts.append((time.perf_counter() - t) / 10)
med2 = sorted(ts)[3]
print(f"torch int4 kernel, matrix by matrix: {med2*1e6:.0f} us per row ({nbytes/med2/1e9:.1f} GB/s)")
# reference check vs unpack
ref = []
for j in range(k):
    e = int(slots[0, j])
    W = {m: Q4.unpack({"q": parts[m][0][e], "sz": parts[m][1][e]}, (inter, h) if m != "down" else (h, inter), torch.float32) for m in parts}
    g = x @ W["gate"].T; u = x @ W["up"].T
    ref.append((torch.nn.functional.silu(g) * u) @ W["down"].T)
ref = torch.cat(ref)
print("max rel err", float((torch.from_numpy(out) - ref).norm() / ref.norm()))
for th in (1, 2):
    numba.set_num_threads(th)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(10): f(*args)
        ts.append((time.perf_counter() - t) / 10)
    print(f"threads {th}: {sorted(ts)[3]*1e6:.0f} us per row-call")
