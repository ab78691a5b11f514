"""Can numba beat torch's kernels at a decode row? One matrix-vector product per format, CPU time per call.

Measured for issue 13 (docs/LEARNED.md §10, "numba decode kernels, measured and not adopted"): a whole MoE pair
or attention block in one numba call would save torch's per-operator dispatch, but only if numba's loops are not
slower per byte than torch's kernels. Each numba arm repeats inside one jitted loop (no Python dispatch), and each
repetition feeds its output back into x so LLVM cannot hoist the work out of the loop (an earlier version without
that reported 1.9 us for a q4 block that really takes 9.5).

    OPENBLAS_NUM_THREADS=1 python benchmarks/numba_matvec.py
"""
from __future__ import annotations

import time

import numba
import numpy as np
import torch

from waste.quant.intq import Q4

torch.set_num_threads(1)


@numba.njit(fastmath=True)
def nb_f32(w, x, y, reps):                     # W [N, K] float32
    N, K = w.shape
    for _ in range(reps):
        for n in range(N):
            acc = np.float32(0.0)
            for k in range(K):
                acc += w[n, k] * x[k]
            y[n] = acc
        x[0] += y[0] * np.float32(1e-30)


@numba.njit(fastmath=True)
def nb_bf16(w, x, y, reps):                    # W [N, K] bf16 bits as uint16, widened in the dot's loop
    N, K = w.shape
    tmp = np.empty(K, np.uint32)
    tf = tmp.view(np.float32)
    for _ in range(reps):
        for n in range(N):
            for k in range(K):
                tmp[k] = np.uint32(w[n, k]) << np.uint32(16)
            acc = np.float32(0.0)
            for k in range(K):
                acc += tf[k] * x[k]
            y[n] = acc
        x[0] += y[0] * np.float32(1e-30)


@numba.njit(fastmath=True)
def nb_q4(q, x, y, reps):                      # one 64-row block of the stored q4 layout per 64 rows, no scales:
    N, K = y.shape[0], x.shape[0]              # the nibble loop alone (a lower bound on a real q4 kernel)
    acc = np.empty(64, np.float32)
    for _ in range(reps):
        for b in range(N // 64):
            for j in range(64):
                acc[j] = 0.0
            for k in range(K):
                xk, off = x[k], (b * K + k) * 32
                for j in range(32):
                    c = q[off + j]
                    acc[j] += np.float32(c & 15) * xk
                    acc[32 + j] += np.float32(c >> 4) * xk
            for j in range(64):
                y[b * 64 + j] = acc[j]
        x[0] += y[0] * np.float32(1e-30)


def cpu_us(fn, reps: int, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        fn(reps)
        best = min(best, (time.thread_time() - t0) / reps)
    return best * 1e6


def torch_loop(f):
    def run(reps):
        for _ in range(reps):
            f()
    return run


def main():
    print(f"{'N x K':>10} | {'f32 torch':>9} {'f32 numba':>9} | {'bf16 torch':>10} {'bf16 numba':>10} | "
          f"{'q4 torch int4':>13} {'q4 numba (no scales)':>20}   (us per call, 1 thread, min of 7)")
    for N, K in ((128, 320), (320, 128), (1024, 320), (768, 2048), (2048, 768)):
        w = torch.randn(N, K) * 0.05
        x = torch.randn(1, K)
        y = np.zeros(N, np.float32)
        xn = x.numpy()[0].copy()
        wb = w.to(torch.bfloat16)
        fmt = Q4("q4", 64)
        parts = fmt.pack(w)
        xb = x.to(torch.bfloat16)
        qn = parts["q"].numpy().reshape(-1)
        nb_f32(w.numpy(), xn, y, 1), nb_bf16(wb.view(torch.int16).numpy().view(np.uint16), xn, y, 1)
        nb_q4(qn, xn, y, 1)
        r = max(20, 2_000_000 // (N * K))
        row = [cpu_us(torch_loop(lambda: torch.nn.functional.linear(x, w)), r),
               cpu_us(lambda n: nb_f32(w.numpy(), xn, y, n), r),
               cpu_us(torch_loop(lambda: torch.nn.functional.linear(xb, wb)), r),
               cpu_us(lambda n: nb_bf16(wb.view(torch.int16).numpy().view(np.uint16), xn, y, n), r),
               cpu_us(torch_loop(lambda: fmt.linear(xb, parts, (N, K))), r),
               cpu_us(lambda n: nb_q4(qn, xn, y, n), r)]
        print(f"{N:>5} x {K:<4} | {row[0]:9.1f} {row[1]:9.1f} | {row[2]:10.1f} {row[3]:10.1f} | {row[4]:13.1f} "
              f"{row[5]:20.1f}")


if __name__ == "__main__":
    main()
