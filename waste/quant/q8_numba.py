"""The q8 matrix-vector product of one float32 row in numba, reading the int8 codes and row scales in place: the
decode-row kernel of intq.Q8 (a trunk row). Without it a float32 row went through F.linear over the codes widened
to float32, the whole matrix converted at every call (a 33 ms layer on the 30B shape, docs/LEARNED.md §3k).

Each output row is one thread's dot product over K in a fixed order, so the bits do not depend on the thread count.
Import lazily: importing this module imports numba.
"""
from __future__ import annotations

import numba
import numpy as np
import torch

from ..numba_ptr import at, row_call

ROWS = 4        # output rows per pass over x: x is loaded once for four rows of codes


@numba.njit(fastmath=True, inline="always")
def q8_block(x, q, sc, N, K, b, y):              # output rows [ROWS b, ROWS b + ROWS) of W x into y
    n0 = b * ROWS
    if n0 + ROWS <= N:
        r0, r1, r2, r3 = q[n0], q[n0 + 1], q[n0 + 2], q[n0 + 3]
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for k in range(K):
            xk = x[k]
            a0 += np.float32(r0[k]) * xk
            a1 += np.float32(r1[k]) * xk
            a2 += np.float32(r2[k]) * xk
            a3 += np.float32(r3[k]) * xk
        y[n0], y[n0 + 1], y[n0 + 2], y[n0 + 3] = a0 * sc[n0], a1 * sc[n0 + 1], a2 * sc[n0 + 2], a3 * sc[n0 + 3]
    else:
        for n in range(n0, N):
            r, a = q[n], np.float32(0.0)
            for k in range(K):
                a += np.float32(r[k]) * x[k]
            y[n] = a * sc[n]


@numba.njit(fastmath=True, inline="always")
def q8_rows_body(x_p, q_p, s_p, N, K, y):
    x = at(x_p, (K,), np.float32)
    q, sc = at(q_p, (N, K), np.int8), at(s_p, (N,), np.float32)
    for b in numba.prange((N + ROWS - 1) // ROWS):
        q8_block(x, q, sc, N, K, b, y)


@numba.njit(fastmath=True, cache=True, parallel=True)
def q8_row(x_p, q_p, s_p, N, K, y):             # row blocks spread over the threads
    q8_rows_body(x_p, q_p, s_p, N, K, y)


@numba.njit(fastmath=True, cache=True)
def q8_row_serial(x_p, q_p, s_p, N, K, y):      # the same blocks in order: a small matrix is not worth a launch
    q8_rows_body(x_p, q_p, s_p, N, K, y)


PARALLEL_MIN = 1 << 16      # weights below which a matrix runs on one thread


class RowKernel:
    """x [1, K] float32 @ W.T -> [1, N] float32 for one q8 matrix, its arguments bound once."""

    def __init__(self, parts: dict, shape):
        N, K = shape
        self.parts, self.N = parts, N         # the parts stay referenced: the kernel reads their memory
        self.args = (parts["q"].data_ptr(), parts["scale"].data_ptr(), N, K)
        self.parallel = N * K >= PARALLEL_MIN

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return row_call(q8_row, q8_row_serial, self.parallel, x, self.N, self.args)
