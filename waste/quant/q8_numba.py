"""q8 decode rows in numba with int8 activations: one row x [K] times a q8 matrix (int8 codes [N, K] row-major, one
float32 scale a row) without widening the matrix.

Why: a float32 row met the codes through F.linear of the codes widened to float32 (quant/intq.py), which reads
the int8 matrix, writes it four times larger and reads that again at every decode row (+1.2 ms a token on the
bundled model's q8 trunk). Here x is rounded to int8 in blocks of 32 (one scale a block: quant/q4_int8.py's
quantize_row), each block of a row is 32-bit integer sums of int8 x int8 products (the pairwise sums LLVM lowers
to `vpmaddwd`), scaled into 16 float lanes, and the lanes are summed once a row. The inner block is LLVM IR written
with explicit vectors for the reason q4_int8.py gives (numba types small integers as int64). A row's bits depend
on neither the thread count nor the other rows. Import lazily: importing this module imports numba.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..numba_ptr import BoundRow, at
from .q4_int8 import _F32, _I16, _I32, _at, _data, _splat, quantize_row

XBLOCK = 32                    # x's rounding block and the integer pass's length (Q8_0's): K = 96 has no tail
_I8 = ir.IntType(8)
_EVEN = ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2)))
_ODD = ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2)))


@intrinsic
def row_dot(typingctx, w_a, xq, d, nb):
    """sum over blocks b < nb of d[b] * (the 32 products of the int8 codes at w_a + 32 b with xq[32 b:32 b + 32]):
    products summed pairwise into 16 int32 lanes, scaled into 16 float lanes, the lanes summed in a fixed tree."""
    def codegen(context, builder, sig, args):
        w_a, xq_v, d_v, nb = args
        i64 = ir.IntType(64)
        v32i8, v32i16, v32i32 = (ir.VectorType(t, 32) for t in (_I8, _I16, _I32))
        v16f = ir.VectorType(_F32, 16)
        w = builder.inttoptr(w_a, _I8.as_pointer())
        xs = _data(context, builder, sig.args[1], xq_v, _I16)
        dp = _data(context, builder, sig.args[2], d_v, _F32)
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16f, None))
        with cgutils.for_range(builder, nb) as loop:
            k = builder.mul(loop.index, ir.Constant(i64, XBLOCK))
            a = builder.sext(builder.load(_at(builder, w, k, v32i8), align=1), v32i32)
            b = builder.sext(builder.load(builder.bitcast(builder.gep(xs, [k]), v32i16.as_pointer()), align=2), v32i32)
            p = builder.mul(a, b)
            pair = builder.add(builder.shuffle_vector(p, p, _EVEN), builder.shuffle_vector(p, p, _ODD))
            dv = _splat(builder, builder.load(builder.gep(dp, [loop.index])), v16f)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(dv, builder.sitofp(pair, v16f))), acc)
        lanes = [builder.extract_element(builder.load(acc), ir.Constant(_I32, i)) for i in range(16)]
        while len(lanes) > 1:
            lanes = [builder.fadd(lanes[i], lanes[i + 1]) for i in range(0, len(lanes), 2)]
        return lanes[0]
    return types.float32(types.int64, xq, d, types.int64), codegen


@numba.njit(fastmath=True)
def rows_chunk(r0, r1, x, q, q_a, sc, K, xq, d, y):    # rows [r0, r1): its own function, not a prange body
    nb = K // XBLOCK
    for n in range(r0, r1):
        t = row_dot(q_a + n * K, xq, d, nb) if nb else np.float32(0.0)
        for k in range(nb * XBLOCK, K):          # a K not a multiple of 32: the last columns in float
            t += np.float32(q[n * K + k]) * x[k]
        y[n] = t * sc[n]


ROWS = 64                      # rows per parallel task


@numba.njit(fastmath=True, inline="always")
def q8_row_body(x_p, q_p, s_p, N, K, y):
    x, q, sc = at(x_p, (K,), np.float32), at(q_p, (N * K,), np.int8), at(s_p, (N,), np.float32)
    G = max(K // XBLOCK, 1)
    xq, d, d8, sx = np.zeros(G * XBLOCK, np.int16), np.empty(G, np.float32), np.empty(G, np.float32), np.empty(G, np.float32)
    if K >= XBLOCK:
        quantize_row(x[:G * XBLOCK], G, xq, d, d8, sx)
    for c in numba.prange((N + ROWS - 1) // ROWS):
        rows_chunk(c * ROWS, min(N, c * ROWS + ROWS), x, q, q_p, sc, K, xq, d, y)


@numba.njit(fastmath=True, cache=True, parallel=True)
def q8_row(x_p, q_p, s_p, N, K, y):              # row chunks spread over the threads
    q8_row_body(x_p, q_p, s_p, N, K, y)


@numba.njit(fastmath=True, cache=True)
def q8_row_serial(x_p, q_p, s_p, N, K, y):       # the same chunks in order (small matrices)
    q8_row_body(x_p, q_p, s_p, N, K, y)


def RowKernel(parts: dict, shape) -> BoundRow:
    """One q8 matrix times a float32 row."""
    N, K = shape
    return BoundRow(q8_row, q8_row_serial, parts, (parts["q"].data_ptr(), parts["scale"].data_ptr(), N, K), shape)
