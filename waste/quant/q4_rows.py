"""q4 matrices times many rows in numba (prefill): a block of 64 weight rows is dequantized once into a small float32
tile and applied to every row that needs it, instead of torch's int4 kernel called matrix by matrix (expert by
expert at prefill: 296 calls of ~26 us in a 128-token prefill of the bundled model, docs/LEARNED.md §10c).

Bits: no fast-math anywhere; the multiply-adds are explicit fused ones (`fma`), so each output element is the one
IEEE result of one written order (k ascending over the whole row) whatever LLVM vectorises, whichever thread runs
it and whatever other rows share the call. A row's result therefore does not depend on the thread count, on the
rows beside it (batch, chunk, budget group) or on how tasks are split. The dequantized tile is exactly the format's
own unpack ((q - 8) * scale + zero, two roundings), so the product is the float32 product with the unpacked matrix
up to the order of its sums.

Module-level functions (numba's on-disk cache keeps them); importing this module imports numba: import it lazily.
"""
from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ..numba_ptr import at, follow_torch_threads
from .int4pack import BLOCK
from .q4_numba import bf16

f32 = np.float32


@intrinsic
def fma(typingctx, a, b, c):           # a * b + c rounded once (llvm.fma: vectorises; never contracted otherwise)
    def codegen(context, builder, sig, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def wide(typingctx):
    """Lets LLVM vectorise the calling function 512 bits wide: its cost model for this CPU family prefers 256-bit
    vectors (ymm: half the multiply-adds per instruction); the function attribute overrides that preference."""
    def codegen(context, builder, sig, args):
        for a in ('"prefer-vector-width"="512"',):
            set.add(builder.function.attributes, a)     # (not in llvmlite's known list)
        return context.get_constant(types.int64, 0)
    return types.int64(), codegen


@numba.njit(inline="always")
def scales(szs, N, n0, hb, full, g, s, z):
    """s[jj], z[jj]: the scale and zero of group g for tile column jj (byte j's low nibble -> jj = j, its high one
    -> jj = hb + j; a full block's rows are n0 + jj, a tail block's n0 + 2j and n0 + 2j + 1)."""
    for jj in range(2 * hb):
        n = n0 + (jj if full else (2 * jj if jj < hb else 2 * (jj - hb) + 1))
        zi = (g * N + n) * 2
        s[jj] = bf16(szs[zi])
        z[jj] = bf16(szs[zi + 1])


@numba.njit(inline="always")
def tile(q, base, hb, gs, g, s, z, w):
    """w[kk, jj] = (q - 8) * s[jj] + z[jj] (the format's unpack, bit for bit) for column g * gs + kk."""
    for kk in range(gs):
        k = g * gs + kk
        col = q[base + k * hb:base + k * hb + hb]
        wk = w[kk]
        for j in range(hb):
            c = col[j]
            wk[j] = (f32(np.int32(c & np.uint8(15))) - f32(8.0)) * s[j] + z[j]
            wk[hb + j] = (f32(np.int32(c >> np.uint8(4))) - f32(8.0)) * s[hb + j] + z[hb + j]


@numba.njit(inline="always")
def acc_rows(w, gs, nb, X, xi, nr, g, accs):
    """accs[r, jj] += sum over this group's columns (ascending) of w[kk, jj] * X[xi[r], g * gs + kk], four rows at
    a time sharing the tile's loads (each row's sums its own, in one written order; nr % 4 == 0)."""
    k0 = g * gs
    n4 = gs // 4 * 4
    for r in range(0, nr, 4):
        xa, xb, xc, xd = X[xi[r]], X[xi[r + 1]], X[xi[r + 2]], X[xi[r + 3]]
        for kk in range(0, n4, 4):
            k = k0 + kk
            a0, a1, a2, a3 = xa[k], xa[k + 1], xa[k + 2], xa[k + 3]
            b0, b1, b2, b3 = xb[k], xb[k + 1], xb[k + 2], xb[k + 3]
            c0, c1, c2, c3 = xc[k], xc[k + 1], xc[k + 2], xc[k + 3]
            d0, d1, d2, d3 = xd[k], xd[k + 1], xd[k + 2], xd[k + 3]
            for jj in range(nb):
                v0, v1, v2, v3 = w[kk, jj], w[kk + 1, jj], w[kk + 2, jj], w[kk + 3, jj]
                accs[r, jj] = fma(v3, a3, fma(v2, a2, fma(v1, a1, fma(v0, a0, accs[r, jj]))))
                accs[r + 1, jj] = fma(v3, b3, fma(v2, b2, fma(v1, b1, fma(v0, b0, accs[r + 1, jj]))))
                accs[r + 2, jj] = fma(v3, c3, fma(v2, c2, fma(v1, c1, fma(v0, c0, accs[r + 2, jj]))))
                accs[r + 3, jj] = fma(v3, d3, fma(v2, d2, fma(v1, d1, fma(v0, d0, accs[r + 3, jj]))))
        for kk in range(n4, gs):
            for i in range(4):
                xk = X[xi[r + i], k0 + kk]
                for jj in range(nb):
                    accs[r + i, jj] = fma(w[kk, jj], xk, accs[r + i, jj])


@numba.njit(fastmath=False)
def block_rows(q, o, szs, G, N, K, b, X, xi, nr, Y, yi, w, s, z, accs):
    """Y[yi[r], block b's rows] = W[block b] @ X[xi[r]] for r < nr of one q4 matrix W [N, K] (nibbles from q[o],
    bf16 scale/zero pairs szs [G, N, 2]); xi holds nr rounded up to 4 entries (the extra rows computed, not kept).
    Scratch: w [K / G, 64], s and z [64], accs [len(xi), 64]."""
    wide()
    nfull = N // BLOCK
    nb = BLOCK if b < nfull else N - nfull * BLOCK
    hb = nb // 2
    n0 = b * BLOCK
    gs = K // G
    base = o + n0 * K // 2
    nr4 = (nr + 3) // 4 * 4
    for r in range(nr4):
        for jj in range(nb):
            accs[r, jj] = 0.0
    for g in range(G):
        scales(szs, N, n0, hb, nb == BLOCK, g, s, z)
        # constant trip counts: LLVM vectorises them 16 wide (a bounded unknown one 8 wide, and its tile 3x slower)
        if nb == BLOCK:
            tile(q, base, BLOCK // 2, gs, g, s, z, w)
            acc_rows(w, gs, BLOCK, X, xi, nr4, g, accs)
        elif nb == BLOCK // 2:   # the tail of 96 rows (the bundled model's experts), of 160, ...
            tile(q, base, BLOCK // 4, gs, g, s, z, w)
            acc_rows(w, gs, BLOCK // 2, X, xi, nr4, g, accs)
        else:
            tile(q, base, hb, gs, g, s, z, w)
            acc_rows(w, gs, nb, X, xi, nr4, g, accs)
    for r in range(nr):
        y = Y[yi[r]]
        for jj in range(nb):
            y[n0 + (jj if nb == BLOCK else (2 * jj if jj < hb else 2 * (jj - hb) + 1))] = accs[r, jj]


@numba.njit(cache=True, parallel=True)
def matmul_rows(x_p, R, q_p, sz_p, N, K, G, RB, y):
    """y [R, N] = X [R, K] @ W.T for one q4 matrix: tasks of (block, RB rows) spread over the threads."""
    X = at(x_p, (R, K), np.float32)
    q, szs = at(q_p, (N * K // 2,), np.uint8), at(sz_p, (G * N * 2,), np.uint16)
    nblk = (N + BLOCK - 1) // BLOCK
    nrb = (R + RB - 1) // RB
    for t in numba.prange(nblk * nrb):
        b, rb = t // nrb, t % nrb
        r0, r1 = rb * RB, min(R, rb * RB + RB)
        nr = r1 - r0
        xi = np.empty((nr + 3) // 4 * 4, np.int64)
        for i in range(xi.shape[0]):
            xi[i] = min(r0 + i, r1 - 1)
        gs = K // G
        w = np.empty((gs, BLOCK), np.float32)
        s, z = np.empty(BLOCK, np.float32), np.empty(BLOCK, np.float32)
        accs = np.empty((xi.shape[0], BLOCK), np.float32)
        block_rows(q, 0, szs, G, N, K, b, X, xi, nr, y, xi, w, s, z, accs)


@numba.njit(inline="always")
def untile(q, base, hb, full, K, n0, szs, N, G, wt, c0):
    """wt[k, (rows of the block at n0) - c0] = the unpacked weights ((q - 8) * scale + zero, bit for bit), k < K."""
    gs = K // G
    s, z = np.empty(2 * hb, np.float32), np.empty(2 * hb, np.float32)
    for g in range(G):
        scales(szs, N, n0, hb, full, g, s, z)
        for kk in range(gs):
            k = g * gs + kk
            col = q[base + k * hb:base + k * hb + hb]
            row = wt[k, n0 - c0:]
            if full:
                lo, hi = row[:hb], row[hb:2 * hb]
                for j in range(hb):
                    c = col[j]
                    lo[j] = (f32(np.int32(c & np.uint8(15))) - f32(8.0)) * s[j] + z[j]
                    hi[j] = (f32(np.int32(c >> np.uint8(4))) - f32(8.0)) * s[hb + j] + z[hb + j]
            else:
                for j in range(hb):
                    c = col[j]
                    row[2 * j] = (f32(np.int32(c & np.uint8(15))) - f32(8.0)) * s[j] + z[j]
                    row[2 * j + 1] = (f32(np.int32(c >> np.uint8(4))) - f32(8.0)) * s[hb + j] + z[hb + j]


# a prefill chunk's q4 matrix is unpacked this many weights at a time (whole 64-row blocks), each part multiplied
# by one sgemm: a float32 scratch of 4 MB at most, one per thread (docs/LEARNED.md §10c)
UNPACK_MAX = 1 << 20
_scratch = threading.local()


@numba.njit(cache=True, parallel=True)
def unpack_rows_t(q_p, sz_p, N, K, G, n0, n1, wt):
    """wt [K, n1 - n0] = rows n0..n1 (whole blocks) of one q4 matrix, transposed, unpacked exactly."""
    q, szs = at(q_p, (N * K // 2,), np.uint8), at(sz_p, (G * N * 2,), np.uint16)
    nfull = N // BLOCK
    for b in numba.prange(n0 // BLOCK, (n1 + BLOCK - 1) // BLOCK):
        wide()
        if b < nfull:            # a constant trip count (vectorised 16 wide)
            untile(q, b * BLOCK * K // 2, BLOCK // 2, True, K, b * BLOCK, szs, N, G, wt, n0)
        else:
            untile(q, b * BLOCK * K // 2, (N - nfull * BLOCK) // 2, False, K, b * BLOCK, szs, N, G, wt, n0)


def linear_rows(x: torch.Tensor, parts: dict, shape) -> torch.Tensor:
    """x [T, K] float32 @ W.T for one q4 matrix: W unpacked exactly into a reused float32 scratch, UNPACK_MAX
    weights at a time, each part one sgemm (at T = 128 and 320 x 320: 109 us + 23 to unpack, against 189 us
    through torch's int4 kernel)."""
    N, K = shape
    rows = max(BLOCK, UNPACK_MAX // K // BLOCK * BLOCK)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < min(N, rows) * K:
        buf = _scratch.buf = np.empty(max(min(N, rows) * K, 1 << 16), np.float32)
    x = x if x.is_contiguous() else x.contiguous()
    follow_torch_threads()
    q, sz, G = parts["q"].data_ptr(), parts["sz"].data_ptr(), parts["sz"].shape[0]
    if N <= rows:
        wt = buf[:N * K].reshape(K, N)
        unpack_rows_t(q, sz, N, K, G, 0, N, wt)
        return torch.mm(x, torch.from_numpy(wt))
    out = torch.empty(x.shape[0], N)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        wt = buf[:(n1 - n0) * K].reshape(K, n1 - n0)
        unpack_rows_t(q, sz, N, K, G, n0, n1, wt)
        out[:, n0:n1] = torch.mm(x, torch.from_numpy(wt))
    return out
