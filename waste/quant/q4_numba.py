"""q4 matrix-vector products in numba, reading the stored nibbles (int4pack.py's layout) and bf16 scale/zero
pairs in place: the decode-row kernels of layers/moe_cpu.py (routed experts) and of intq.Q4.linear (one trunk row).

Module-level functions, so numba's on-disk cache keeps them across processes (kernels defined in a closure were
compiled again in every process: 7 s of every CPU engine load, docs/LEARNED.md §10). Import lazily: importing this
module imports numba.
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ..numba_ptr import BoundRow, at
from .int4pack import BLOCK
from .q4_int8 import KSTEP, block_out, quantize_row


@intrinsic
def _f32_of(typingctx, b):             # the float32 whose bits are b
    return types.float32(types.uint32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())


@numba.njit(inline="always")
def bf16(bits):                        # bf16 bits (uint16) -> float32
    return _f32_of(np.uint32(bits) << np.uint32(16))


@numba.njit(fastmath=True, inline="always")
def q4_block4(blk, k4a, k4b, x, lo, hi):   # a full block's 64 rows over k in [4 k4a, 4 k4b) -> lo, hi; sum of x
    m15, s4 = np.uint8(15), np.uint8(4)
    sx = np.float32(0.0)
    for j in range(32):
        lo[j] = 0.0
        hi[j] = 0.0
    for k4 in range(k4a, k4b):
        # four k per pass over the accumulators, and the nibbles kept in 8/32-bit lanes: a uint8 & int literal
        # types as int64, which vectorised 8 lanes wide (LEARNED §10: 4.5 -> 7.2 GB/s on a 768 x 2048 matrix)
        x0, x1, x2, x3 = x[4 * k4], x[4 * k4 + 1], x[4 * k4 + 2], x[4 * k4 + 3]
        sx += (x0 + x1) + (x2 + x3)
        row = blk[k4]
        for j in range(32):
            c0, c1, c2, c3 = row[j], row[32 + j], row[64 + j], row[96 + j]
            lo[j] += ((np.float32(np.int32(c0 & m15)) * x0 + np.float32(np.int32(c1 & m15)) * x1)
                      + (np.float32(np.int32(c2 & m15)) * x2 + np.float32(np.int32(c3 & m15)) * x3))
            hi[j] += ((np.float32(np.int32(c0 >> s4)) * x0 + np.float32(np.int32(c1 >> s4)) * x1)
                      + (np.float32(np.int32(c2 >> s4)) * x2 + np.float32(np.int32(c3 >> s4)) * x3))
    return sx


@numba.njit(fastmath=True, inline="always")
def q4_block(q, o, szs, G, N, K, b, x, y, acc):  # rows of block b of W x into y in float32 (a tail block, odd groups)
    nfull = N // BLOCK
    gs = K // G
    rows = BLOCK if b < nfull else N - nfull * BLOCK
    hb = rows // 2
    base = o + b * BLOCK * K // 2
    for j in range(rows):
        n = b * BLOCK + (j if b < nfull else (2 * j if j < hb else 2 * (j - hb) + 1))
        y[n] = 0.0
    for g in range(G):
        if gs % 4 == 0 and b < nfull:
            blk = q[base:base + BLOCK * K // 2].reshape((K // 4, 2 * BLOCK))
            sx = q4_block4(blk, g * gs // 4, (g * gs + gs) // 4, x, acc[:hb], acc[hb:2 * hb])
        else:
            for j in range(rows):
                acc[j] = 0.0
            sx = np.float32(0.0)
            for k in range(g * gs, g * gs + gs):
                xk = x[k]
                sx += xk
                col = q[base + k * hb:base + k * hb + hb]
                for j in range(hb):
                    c = col[j]
                    acc[j] += np.float32(c & 15) * xk
                    acc[hb + j] += np.float32(c >> 4) * xk
        for j in range(rows):
            # a full block holds rows j and j + 32 in a byte, the tail rows 2j and 2j + 1
            n = b * BLOCK + (j if b < nfull else (2 * j if j < hb else 2 * (j - hb) + 1))
            z = (g * N + n) * 2
            y[n] += bf16(szs[z]) * (acc[j] - np.float32(8.0) * sx) + bf16(szs[z + 1]) * sx


@numba.njit(fastmath=True, inline="always")
def i8_blocks(N, K, G):                # full blocks the int8 path takes (the rest: the float loop)
    return N // BLOCK if (K // G) % KSTEP == 0 else 0


@numba.njit(fastmath=True, inline="always")
def mv_q4_i8(q, o, sz, zo, G, x, xq, d, d8sq, sx, y, acc):
    """W x for one matrix in the slab (quant/intq.py Q4: nibbles in int4pack's layout, sz bf16 [G, N, 2]) with x's
    int8 rounding (xq, d, d8sq, sx from quantize_row) for the full blocks: their integer dot is
    2-2.5x the float loop's speed (q4_int8.py); a tail block and groups not a multiple of 16 keep the float loop
    (acc float32 [64]: its scratch)."""
    N, K = y.shape[0], x.shape[0]
    szs = sz[zo:zo + G * N * 2]
    nfull = i8_blocks(N, K, G)
    # addresses as int64: numba's uint64 (ctypes.data) plus int64 is a float64
    qa, sa = np.int64(q.ctypes.data) + o, np.int64(szs.ctypes.data)
    for b in range(nfull):
        block_out(qa + b * 32 * K, sa + b * BLOCK * 4, N, xq, d, d8sq, sx, y, b * BLOCK)
    for b in range(nfull, (N + BLOCK - 1) // BLOCK):
        q4_block(q, o, szs, G, N, K, b, x, y, acc)


@numba.njit(fastmath=True, inline="always")
def mv_q4_block(q, o, sz, zo, G, x, xq, d, d8sq, sx, y, acc, b):
    """Block b (its 64 rows, or a tail block's) of mv_q4_i8's W x into y [N]: the same block_out or float loop on the
    same operands, so a matrix computed block by block on any threads has mv_q4_i8's bits (layers/cpu_kernels.py
    pair_q4_shared; tests/test_cpu_kernels.py holds them equal)."""
    N, K = y.shape[0], x.shape[0]
    szs = sz[zo:zo + G * N * 2]
    if b < i8_blocks(N, K, G):
        qa, sa = np.int64(q.ctypes.data) + o, np.int64(szs.ctypes.data)
        block_out(qa + b * 32 * K, sa + b * BLOCK * 4, N, xq, d, d8sq, sx, y, b * BLOCK)
    else:
        q4_block(q, o, szs, G, N, K, b, x, y, acc)


CHUNK = 8                               # blocks per parallel task of a trunk row: its scratch is made once a task


@numba.njit(fastmath=True)
def row_chunk(c, x, q, szs, q_p, sz_p, N, K, G, xq, d, d8sq, sx, y):   # blocks [CHUNK c, CHUNK c + CHUNK) of a row
    # its own function (its scratch its own), not the prange body
    nfull, nb = i8_blocks(N, K, G), (N + BLOCK - 1) // BLOCK
    acc = np.empty(BLOCK, np.float32)
    for b in range(c * CHUNK, min(nb, c * CHUNK + CHUNK)):
        if b < nfull:
            block_out(q_p + b * 32 * K, sz_p + b * BLOCK * 4, N, xq, d, d8sq, sx, y, b * BLOCK)
        else:
            q4_block(q, 0, szs, G, N, K, b, x, y, acc)


@numba.njit(fastmath=True, inline="always")
def q4_row_body(x_p, q_p, sz_p, N, K, G, y):     # y [N] = W x for one row x [K], block by block
    x = at(x_p, (K,), np.float32)
    q, szs = at(q_p, (N * K // 2,), np.uint8), at(sz_p, (G * N * 2,), np.uint16)
    xq, d, d8sq, sx = np.empty(K, np.int16), np.empty(G, np.float32), np.empty(G, np.float32), np.empty(G, np.float32)
    if i8_blocks(N, K, G):
        quantize_row(x, G, xq, d, d8sq, sx)
    nb = (N + BLOCK - 1) // BLOCK
    for c in numba.prange((nb + CHUNK - 1) // CHUNK):
        row_chunk(c, x, q, szs, q_p, sz_p, N, K, G, xq, d, d8sq, sx, y)


@numba.njit(fastmath=True, cache=True, parallel=True)
def q4_row(x_p, q_p, sz_p, N, K, G, y):          # blocks spread over the threads
    q4_row_body(x_p, q_p, sz_p, N, K, G, y)


@numba.njit(fastmath=True, cache=True)
def q4_row_serial(x_p, q_p, sz_p, N, K, G, y):   # the same blocks in order: below PARALLEL_MIN a launch costs more
    q4_row_body(x_p, q_p, sz_p, N, K, G, y)


def RowKernel(parts: dict, shape) -> BoundRow:
    """One q4 matrix (stored layout) times a float32 row: x rounded to int8 for the full blocks (q4_int8.py)."""
    N, K = shape
    args = (parts["q"].data_ptr(), parts["sz"].data_ptr(), N, K, parts["sz"].shape[0])
    return BoundRow(q4_row, q4_row_serial, parts, args, shape)


def row(x: torch.Tensor, parts: dict, shape) -> torch.Tensor:
    """RowKernel made and called once (tests, warm-up)."""
    return RowKernel(parts, shape)(x)
