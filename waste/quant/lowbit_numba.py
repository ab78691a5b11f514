"""The numba kernels of quant/lowbit.py (vq3's lookup rows and unpacking, mxfp4's rows and unpacking), at module
level so numba's on-disk cache finds them again in the next process (kernels defined inside a function were
compiled again in every process: docs/LEARNED.md §10a). Imported on first use: importing it imports numba."""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

VQ_DIM = 8               # lowbit.VQ_DIM (not imported: lowbit imports this module)
u32 = np.uint32          # numba widens integer arithmetic to 64 bits; casting back keeps the vectors 32-bit


@intrinsic
def f32bits(typingctx, b):
    return types.float32(types.uint32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())


@numba.njit(inline="always")
def e2m1(c):             # nibble -> E2M1 value from its bits, no table (a lookup vectorises into slow gathers)
    mag = u32(u32(u32(c & u32(7)) << u32(22)) + u32(126 << 23))            # 1, 1.5, 2, 3, 4, 6: exponent, mantissa
    mag = mag if u32(c & u32(6)) != u32(0) else u32(u32(c & u32(1)) * u32(126 << 23))    # 0, .5
    return f32bits(u32(mag | u32(u32(c & u32(8)) << u32(28))))


@numba.njit(parallel=True, cache=True)
def vq_rows(lut, codes, scale, out):          # lut [T, J, 3, 256] f32, codes [N, J, 3] u8, out [T, N] f32
    T, J, _, _ = lut.shape
    for n in numba.prange(codes.shape[0]):
        for t in range(T):
            # one partial sum per stage, added in a fixed order: three independent add chains instead of one,
            # and the same result whatever the thread count
            a0 = a1 = a2 = np.float32(0.0)
            for j in range(J):
                a0 += lut[t, j, 0, codes[n, j, 0]]
                a1 += lut[t, j, 1, codes[n, j, 1]]
                a2 += lut[t, j, 2, codes[n, j, 2]]
            out[t, n] = ((a0 + a1) + a2) * scale[n]


@numba.njit(parallel=True, cache=True)
def vq_unpack(codes, books, scale, out):      # books [3, 256, 8] f32 -> out [N, J*8] f32, as sum_s then * scale
    N, J, _ = codes.shape
    for n in numba.prange(N):
        for j in range(J):
            c0, c1, c2 = codes[n, j, 0], codes[n, j, 1], codes[n, j, 2]
            for i in range(VQ_DIM):
                out[n, j * VQ_DIM + i] = ((books[0, c0, i] + books[1, c1, i]) + books[2, c2, i]) * scale[n]


@numba.njit(parallel=True, fastmath=True, cache=True)
def mx_rows(x, blocks, scales, pow2, out):    # x [T, K] f32 with each group's even columns first, then its odd
    T, K = x.shape                            # ones (MXFP4.linear); blocks [N, K/2] u8, scales [N, K/32] u8
    N, G = scales.shape
    CH = 32
    for ch in numba.prange((N + CH - 1) // CH):
        w = np.empty(K, np.float32)           # one row decoded into L1, then T dot products over it
        for n in range(ch * CH, min(N, ch * CH + CH)):
            for b in range(G):
                s = pow2[scales[n, b]]
                for i in range(16):
                    c = u32(blocks[n, b * 16 + i])
                    w[b * 32 + i] = e2m1(u32(c & u32(15))) * s
                    w[b * 32 + 16 + i] = e2m1(u32(c >> u32(4))) * s
            for t in range(T):
                acc = np.float32(0.0)
                for k in range(K):
                    acc += w[k] * x[t, k]
                out[t, n] = acc


@numba.njit(parallel=True, cache=True)
def mx_unpack(blocks, scales, pow2, out):     # out [N, K] f32, the same values as mx_dequantize
    N, G = scales.shape
    for n in numba.prange(N):
        for b in range(G):
            s = pow2[scales[n, b]]
            for i in range(16):
                c = u32(blocks[n, b * 16 + i])
                out[n, b * 32 + 2 * i] = e2m1(u32(c & u32(15))) * s
                out[n, b * 32 + 2 * i + 1] = e2m1(u32(c >> u32(4))) * s
