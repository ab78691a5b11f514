"""q8 decode rows in numba with int8 activations: one row x [K] times a q8 matrix (int8 codes [N, K] row-major, one
float32 scale a row) without widening the matrix.

Why: a float32 row met the codes through F.linear of the codes widened to float32 (quant/intq.py), which reads
the int8 matrix, writes it four times larger and reads that again at every decode row (+1.2 ms a token on the
bundled model's q8 trunk). Here x is rounded to int8 in blocks of 32 (one scale a block: quant/q4_int8.py's
quantize_row), each block of a row is 32-bit integer sums of int8 x int8 products (the pairwise sums LLVM lowers
to `vpmaddwd`), scaled into 16 float lanes, and the lanes are summed once a row. The inner block is LLVM IR written
with explicit vectors for the reason q4_int8.py gives (numba types small integers as int64). A row's bits depend
on neither the thread count nor the other rows. Import lazily: importing this module imports numba.

Where the host has AVX-512 VNNI, matrices from VNNI_MIN weights take `rows_dot_vnni` instead: `vpdpbusd` needs one
unsigned operand, so x goes in as xq + 128 and 128 x the codes' sum (a second vpdpbusd against ones) is taken off
each lane; a pass covers 64 k (two blocks, their scales in one 16-lane vector), four rows a pass sharing the loads
of x and the scales, the next pass's rows prefetched (PF_ROWS). Other bits than the kernel above (another
summation), the same rules: exact integer lanes, a fixed float order, no dependence on threads or rows.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..numba_ptr import BoundRow, at, fetch_add
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


_B64, _V16I, _V16F = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)


# each 64 bytes of a row read with the line PF_ROWS rows and PF_BYTES on prefetched (the next pass's, a little ahead):
# a 30B-shaped layer's q/k/v and o cold on one thread 0.80-0.83 -> 0.63-0.65 ms, hot 0.32-0.42 -> 0.27-0.28
# (benchmarks/q8_row_prefetch.py, docs/LEARNED.md §3m); the rows' bits are unchanged
PF_ROWS, PF_BYTES = 4, 512


def _rows_dot_vnni(Rv, pf_rows=PF_ROWS, pf_bytes=PF_BYTES):
    @intrinsic
    def rows_dot_vnni(typingctx, w_a, K, xu, dv, nch, half, out):
        """out[j] (j < R, R 1 or 4) = sum over the blocks of row j (codes at w_a + j K) of d[b] * (codes . x rounded):
        by `vpdpbusd`, x as unsigned bytes (xu = xq + 128) against the signed codes, less 128 x the codes' sum (a second
        vpdpbusd against ones), 64 k a pass (two blocks: dv holds each pass's 16 lane scales), the int32 lanes scaled into
        16 float lanes and summed in a fixed tree at the end. half: a last pass of 32 k (a masked load). The R rows of a
        pass share the loads of xu and dv."""
        def codegen(context, builder, sig, args):
            w_a, K, xu_v, dv_v, nch, half, out_v = args
            i64 = ir.IntType(64)
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16I, [_V16I, _V16I, _V16I]),
                                                 "llvm.x86.avx512.vpdpbusd.512")
            mload = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_B64, [_B64.as_pointer(), _I32, ir.VectorType(ir.IntType(1), 64), _B64]),
                "llvm.masked.load.v64i8.p0")
            pf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [
                _I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0")
            w = builder.inttoptr(w_a, _I8.as_pointer())
            xs = _data(context, builder, sig.args[2], xu_v, _I8)
            dp = _data(context, builder, sig.args[3], dv_v, _F32)
            op = _data(context, builder, sig.args[6], out_v, _F32)
            ones, zero = ir.Constant(_B64, [1] * 64), ir.Constant(_V16I, None)
            seven = ir.Constant(_V16I, [7] * 16)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, None)) for _ in range(Rv)]

            def chunk(c, load_w, ones_v):
                k = builder.mul(c, ir.Constant(i64, 64))
                xv = builder.bitcast(builder.load(_at(builder, xs, k, _B64), align=1), _V16I)
                dvec = builder.load(_at(builder, dp, builder.mul(c, ir.Constant(i64, 16)), _V16F), align=4)
                for j in range(Rv):
                    at_w = builder.add(builder.mul(K, ir.Constant(i64, j)), k)
                    if pf_rows or pf_bytes:        # a prefetch past the matrix's end cannot fault
                        ahead = builder.add(at_w, ir.Constant(i64, pf_bytes))
                        ahead = builder.add(ahead, builder.mul(K, ir.Constant(i64, pf_rows)))
                        builder.call(pf, [builder.gep(w, [ahead]), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                          ir.Constant(_I32, 1)])
                    wv = builder.bitcast(load_w(builder.gep(w, [at_w])), _V16I)
                    xw = builder.call(dot, [zero, xv, wv])
                    sw = builder.call(dot, [zero, builder.bitcast(ones_v, _V16I), wv])
                    t = builder.sitofp(builder.sub(xw, builder.shl(sw, seven)), _V16F)
                    builder.store(builder.fadd(builder.load(accs[j]), builder.fmul(dvec, t)), accs[j])

            def full(ptr):
                return builder.load(builder.bitcast(ptr, _B64.as_pointer()), align=1)

            def masked(ptr):
                m = ir.Constant(ir.VectorType(ir.IntType(1), 64), [1] * 32 + [0] * 32)
                return builder.call(mload, [builder.bitcast(ptr, _B64.as_pointer()), ir.Constant(_I32, 1), m,
                                            ir.Constant(_B64, None)])
            with cgutils.for_range(builder, nch) as loop:
                chunk(loop.index, full, ones)
            with builder.if_then(builder.icmp_signed("!=", half, ir.Constant(i64, 0))):
                chunk(nch, masked, ir.Constant(_B64, [1] * 32 + [0] * 32))
            for j in range(Rv):
                acc = builder.load(accs[j])
                lanes = [builder.extract_element(acc, ir.Constant(_I32, i)) for i in range(16)]
                while len(lanes) > 1:
                    lanes = [builder.fadd(lanes[i], lanes[i + 1]) for i in range(0, len(lanes), 2)]
                builder.store(lanes[0], builder.gep(op, [ir.Constant(i64, j)]))
            return context.get_dummy_value()
        return types.void(types.int64, types.int64, xu, dv, types.int64, types.int64, out), codegen
    return rows_dot_vnni


def vnni_chunk_of(r4, r1):
    """rows [r0, r1) by VNNI through the given four-row and one-row passes (benchmarks/q8_row_prefetch.py builds
    other prefetch distances): its own function, not a prange body."""
    @numba.njit(fastmath=True)
    def chunk(r0, r1_, x, q, q_a, sc, K, xu, dv, y):
        nb = K // XBLOCK
        nch, half = nb // 2, nb % 2
        out = np.empty(4, np.float32)
        n = r0
        while n < r1_:
            R = 4 if n + 4 <= r1_ else 1
            if R == 4:
                r4(q_a + n * K, K, xu, dv, nch, half, out)
            else:
                r1(q_a + n * K, K, xu, dv, nch, half, out)
            for j in range(R):
                t = out[j]
                for k in range(nb * XBLOCK, K):
                    t += np.float32(q[(n + j) * K + k]) * x[k]
                y[n + j] = t * sc[n + j]
            n += R
    return chunk


vnni_chunk = vnni_chunk_of(_rows_dot_vnni(4), _rows_dot_vnni(1))


@numba.njit(fastmath=True)
def vnni_operands(x, K):
    """x [K] rounded to int8 in blocks as unsigned bytes (xu = xq + 128) and each pass's 16 lane scales (dv)."""
    G = K // XBLOCK
    nch2 = (G + 1) // 2
    xq, d, d8, sx = np.zeros(G * XBLOCK, np.int16), np.empty(G, np.float32), np.empty(G, np.float32), np.empty(G, np.float32)
    xu, dv = np.zeros(nch2 * 64, np.uint8), np.zeros((nch2, 16), np.float32)
    if G:
        quantize_row(x[:G * XBLOCK], G, xq, d, d8, sx)
        for k in range(G * XBLOCK):
            xu[k] = np.uint8(xq[k] + 128)
        for b in range(G):
            for i in range(8):
                dv[b // 2, (b % 2) * 8 + i] = d[b]
    return xu, dv


@numba.njit(fastmath=True, inline="always")
def q8_vnni_body(x_p, q_p, s_p, N, K, y):
    x, q, sc = at(x_p, (K,), np.float32), at(q_p, (N * K,), np.int8), at(s_p, (N,), np.float32)
    xu, dv = vnni_operands(x, K)
    for c in numba.prange((N + ROWS - 1) // ROWS):
        vnni_chunk(c * ROWS, min(N, c * ROWS + ROWS), x, q, q_p, sc, K, xu, dv, y)


@numba.njit(fastmath=True, cache=True, parallel=True)
def q8_row_vnni(x_p, q_p, s_p, N, K, y):
    q8_vnni_body(x_p, q_p, s_p, N, K, y)


@numba.njit(fastmath=True, cache=True)
def q8_row_vnni_serial(x_p, q_p, s_p, N, K, y):
    q8_vnni_body(x_p, q_p, s_p, N, K, y)


@numba.njit(fastmath=True, cache=True, nogil=True)
def q8_row_vnni_shared(x_p, q_p, s_p, N, K, y_p, queue_p, helper):
    """q8_row_vnni's chunks taken from a queue ([next, done] int64 at queue_p) by every thread that calls it; the caller
    (helper False) returns once all are done, a helper as soon as none is left to take."""
    x, q, sc = at(x_p, (K,), np.float32), at(q_p, (N * K,), np.int8), at(s_p, (N,), np.float32)
    y = at(y_p, (N,), np.float32)
    n = (N + ROWS - 1) // ROWS
    if helper and fetch_add(queue_p, 0, 0) >= n:
        return
    xu, dv = vnni_operands(x, K)
    while True:
        c = fetch_add(queue_p, 0, 1)
        if c >= n:
            break
        vnni_chunk(c * ROWS, min(N, c * ROWS + ROWS), x, q, q_p, sc, K, xu, dv, y)
        fetch_add(queue_p, 1, 1)
    while not helper and fetch_add(queue_p, 1, 0) < n:
        pass


# from this many weights a row takes the VNNI kernel where the host has it: 2.49 -> 1.93-2.02 ms for a 30B-shaped
# layer's q/k/v and o from memory on one thread; smaller matrices (the bundled model's) measured slower through it
VNNI_MIN = 1 << 16


def RowKernel(parts: dict, shape) -> BoundRow:
    """One q8 matrix times a float32 row."""
    from .q4_vnni import available

    N, K = shape
    vnni = available() and N * K >= VNNI_MIN
    fns = (q8_row_vnni, q8_row_vnni_serial) if vnni else (q8_row, q8_row_serial)
    return BoundRow(*fns, parts, (parts["q"].data_ptr(), parts["scale"].data_ptr(), N, K), shape,
                    q8_row_vnni_shared if vnni else None)
