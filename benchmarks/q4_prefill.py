"""One q4 matrix times T rows (prefill): torch's int4 kernel (x as bf16), quant/q4_rows.py's numba kernel, and the
matrix dequantized to float32 then MKL's sgemm (F.linear; the dequantization timed apart). Median (min) us of
`--rounds` rounds of `--calls` calls each, arms interleaved in every round, at the thread count given. Also the
relative error of each arm against the float64 product with the unpacked matrix. (docs/LEARNED.md §10c)

    python benchmarks/q4_prefill.py N K T [--threads 2] [--rounds 7] [--calls 50]
"""
import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from waste.numba_ptr import follow_torch_threads
from waste.quant import int4pack, q4_rows
from waste.quant.formats import get_format

ap = argparse.ArgumentParser()
ap.add_argument("N", type=int)
ap.add_argument("K", type=int)
ap.add_argument("T", type=int)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--rounds", type=int, default=7)
ap.add_argument("--calls", type=int, default=50)
ap.add_argument("--rb", type=int, default=32)
a = ap.parse_args()
torch.set_num_threads(a.threads)
N, K, T = a.N, a.K, a.T
fmt, g = get_format("q4"), torch.Generator().manual_seed(0)
w = torch.randn(N, K, generator=g) / K ** 0.5
parts = fmt.pack(w)
x = torch.randn(T, K, generator=g)
d = fmt.unpack(parts, (N, K), torch.float32)
G = parts["sz"].shape[0]


def numba_rows():
    out = np.empty((T, N), np.float32)
    follow_torch_threads()
    q4_rows.matmul_rows(x.data_ptr(), T, parts["q"].data_ptr(), parts["sz"].data_ptr(), N, K, G, a.rb, out)
    return torch.from_numpy(out)


arms = {
    "torch int4": lambda: fmt.linear(x, parts, (N, K)),
    "numba rows": numba_rows,
    "dequant": lambda: fmt.unpack(parts, (N, K), torch.float32),
    "sgemm (f32 W)": lambda: F.linear(x, d),
}
ref = x.double() @ d.double().T
for name, f in arms.items():
    if name != "dequant":
        y = f()
        print(f"{name:<14} rel err {((y.double() - ref).norm() / ref.norm()).item():.2e}")
times = {k: [] for k in arms}
for f in arms.values():
    f()
for _ in range(a.rounds):
    for name, f in arms.items():
        t = time.perf_counter()
        for _ in range(a.calls):
            f()
        times[name].append((time.perf_counter() - t) / a.calls * 1e6)
macs = N * K * T
print(f"{N} x {K}, T = {T}, {a.threads} threads: us per call, median (min); GMAC/s at the median")
for name, ts in times.items():
    m = statistics.median(ts)
    print(f"  {name:<14} {m:9.1f} ({min(ts):.1f})" + ("" if name == "dequant" else f"  {macs / m / 1e3:6.1f}"))
