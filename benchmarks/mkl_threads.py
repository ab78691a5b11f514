"""Does torch's float32 matmul give a row the same bits at one and two threads? 72 products x [M, 64] @ W[32, 64]
(M 1-24, three draws each) at torch's 2 and 1 threads, the count that differ; then ms per product of three shapes at
two threads. Run it with MKL_CBWR unset and set (waste sets AUTO,STRICT on import: docs/LEARNED.md §3l):

    MKL_CBWR= python benchmarks/mkl_threads.py; MKL_CBWR=AUTO,STRICT python benchmarks/mkl_threads.py
"""
import os
import time

import torch
import torch.nn.functional as F

g = torch.Generator().manual_seed(0)
bad = 0
for M in range(1, 25):
    for _ in range(3):
        x, w = torch.randn(M, 64, generator=g), torch.randn(32, 64, generator=g)
        torch.set_num_threads(2)
        a = F.linear(x, w)
        torch.set_num_threads(1)
        bad += not torch.equal(a, F.linear(x, w))
print(f"MKL_CBWR={os.environ.get('MKL_CBWR', '')!r}: {bad} of 72 products differ between 2 and 1 threads")
torch.set_num_threads(2)
for M, K, N in ((128, 2048, 5120), (16, 2048, 768), (512, 2048, 2048)):
    x, w = torch.randn(M, K), torch.randn(N, K)
    for _ in range(3):
        F.linear(x, w)
    t = time.perf_counter()
    for _ in range(20):
        F.linear(x, w)
    print(f"  [{M}, {K}] @ [{N}, {K}].T: {(time.perf_counter() - t) / 20 * 1e3:.3f} ms")
