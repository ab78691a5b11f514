"""q4 decode rows with int8 activations: the row is rounded to int8 per weight group (one float scale a group) and
multiplied with the stored nibbles in 16-bit integer lanes, the way llama.cpp's Q4_0 x Q8_0 dot works.

Why by hand: the float loop (q4_numba.q4_block4) converts every nibble to float32 and runs at 7 GB/s of nibbles a
thread; llama.cpp's integer dots at ~2x that. numba types every small-integer expression as int64, so a loop written
in numba vectorises 8 lanes wide (LEARNED §10a), and no library multiplies int4pack's layout (a block's 64 rows
across, k down) by an int8 row. So the inner 16 k of a block are LLVM IR written here with explicit 32-lane vectors
(generic IR, no x86 intrinsics: LLVM picks the host's instructions, AVX-512 / AVX2 / NEON), inlined into the numba
kernels through `numba.extending.intrinsic`: 14-17 GB/s a thread, 2.1-2.5x the float loop (docs/LEARNED.md §10d).

Exactness: the result is W times the int8-rounded row, each pair's sums in integers (no overflow: |nibble x q| <=
15 x 127 and 16 of them fit int16, the group in int32), then one float32 epilogue per group; the bits depend on
neither the thread count nor the batch. Rounding x to int8 in groups of 32-256 costs ~0.5% of the row's norm, the
class of error torch's int4 kernel makes by rounding x to bf16 (quant/int4pack.py), and far below q4's own.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

KSTEP = 16                      # k per integer pass: 16 x 15 x 127 < 2^15
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V8, _V16, _V32, _VF = (ir.VectorType(t, 32) for t in (_I8, _I16, _I32, _F32))
_LANE0 = ir.Constant(_I32, 0)


def _splat(builder, value, vtype):
    undef, lanes = ir.Constant(vtype, ir.Undefined), vtype.count
    mask = ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes)
    return builder.shuffle_vector(builder.insert_element(undef, value, _LANE0), undef, mask)


def _ptr(builder, addr, t):
    return builder.inttoptr(addr, t.as_pointer())


def _data(context, builder, ty, value, t):
    """A numba array argument's data pointer, as a pointer to t: real pointer provenance, so LLVM sees every
    access the kernel's numba code makes to the same array (an address passed as an integer hides them)."""
    return builder.bitcast(context.make_array(ty)(context, builder, value).data, t.as_pointer())


def _at(builder, base, index, t):
    return builder.bitcast(builder.gep(base, [index]), t.as_pointer())


# each 16 k of a block (512 bytes of nibbles) prefetch the lines PF_BYTES on (blocks are contiguous, so near a block's
# end that is the next block's start); 0: none. A prefetch changes no arithmetic: the bits are the same
PF_BYTES = 2048


@intrinsic
def block_out(typingctx, q_a, sz_a, N, xq, d, d8sq, sx, y, y0):
    """y[y0:y0 + 64] = one full block's 64 rows of W x from x rounded to int8 (xq int16 [K]; d, d8sq, sx float32
    [G] from quantize_row). q_a: the block's nibbles (K x 32 bytes: byte j of a k holds row j low, row j + 32
    high); sz_a: its first row's (s, z) bf16 pair in group 0, group g's N pairs further ([G, N, 2]). Integer sums
    in 16-bit lanes over 16 k, int32 over a group, a float32 epilogue a group, all in registers."""
    def codegen(context, builder, sig, args):
        q_a, sz_a, N, xq_v, d_v, d8_v, sx_v, y_v, y0 = args
        tys = sig.args
        i64 = ir.IntType(64)
        qb, szb = builder.inttoptr(q_a, _I8.as_pointer()), builder.inttoptr(sz_a, _I32.as_pointer())
        xs = _data(context, builder, tys[3], xq_v, _I16)
        dp, d8p, sxp = (_data(context, builder, tys[i], args[i], _F32) for i in (4, 5, 6))
        yp = builder.gep(_data(context, builder, tys[7], y_v, _F32), [y0])
        K = context.make_array(tys[3])(context, builder, xq_v).nitems
        G = context.make_array(tys[4])(context, builder, d_v).nitems
        gs = builder.sdiv(K, G)
        m15, four = ir.Constant(_V16, [15] * 32), ir.Constant(_V16, [4] * 32)
        sixteen, high = ir.Constant(_V32, [16] * 32), ir.Constant(_V32, [-65536] * 32)
        yacc = [cgutils.alloca_once_value(builder, ir.Constant(_VF, None)) for _ in range(2)]
        acc = [cgutils.alloca_once_value(builder, ir.Constant(_V32, None)) for _ in range(2)]
        with cgutils.for_range(builder, G) as gl:
            g = gl.index
            for a in acc:
                builder.store(ir.Constant(_V32, None), a)
            k0 = builder.mul(g, gs)
            with cgutils.for_range(builder, builder.sdiv(gs, ir.Constant(i64, KSTEP))) as cl:
                kc = builder.add(k0, builder.mul(cl.index, ir.Constant(i64, KSTEP)))
                if PF_BYTES:          # a prefetch past the matrix's end cannot fault
                    pf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [
                        _I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0")
                    for line in range(0, KSTEP * 32, 64):
                        at_pf = builder.add(builder.mul(kc, ir.Constant(i64, 32)), ir.Constant(i64, PF_BYTES + line))
                        builder.call(pf, [builder.gep(qb, [at_pf]), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                          ir.Constant(_I32, 1)])
                lo = hi = ir.Constant(_V16, None)
                for k in range(KSTEP):
                    kk = builder.add(kc, ir.Constant(i64, k))
                    row = _at(builder, qb, builder.mul(kk, ir.Constant(i64, 32)), _V8)
                    c = builder.zext(builder.load(row, align=1), _V16)
                    xk = _splat(builder, builder.load(builder.gep(xs, [kk]), align=2), _V16)
                    lo = builder.add(lo, builder.mul(builder.and_(c, m15), xk))
                    hi = builder.add(hi, builder.mul(builder.lshr(c, four), xk))
                for a, v in zip(acc, (lo, hi)):
                    builder.store(builder.add(builder.load(a), builder.sext(v, _V32)), a)
            dg, d8g, sxg = (_splat(builder, builder.load(builder.gep(p, [g])), _VF) for p in (dp, d8p, sxp))
            szg = builder.gep(szb, [builder.mul(g, N)])
            for h in range(2):
                w = builder.load(_at(builder, szg, ir.Constant(i64, 32 * h), _V32), align=1)
                s = builder.bitcast(builder.shl(w, sixteen), _VF)
                z = builder.bitcast(builder.and_(w, high), _VF)
                t = builder.fsub(builder.fmul(dg, builder.sitofp(builder.load(acc[h]), _VF)), d8g)
                row = builder.fadd(builder.fmul(s, t), builder.fmul(z, sxg))
                builder.store(builder.fadd(builder.load(yacc[h]), row), yacc[h])
        for h in range(2):
            builder.store(builder.load(yacc[h]), _at(builder, yp, ir.Constant(i64, 32 * h), _VF), align=4)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, xq, d, d8sq, sx, y, types.int64), codegen


@intrinsic
def _abs_bits(typingctx, v):            # |v|'s bits as an int32: ordered as |v| is (an integer max vectorises exactly)
    def codegen(context, builder, sig, args):
        return builder.and_(builder.bitcast(args[0], _I32), ir.Constant(_I32, 0x7FFFFFFF))
    return types.int32(types.float32), codegen


@intrinsic
def _f32_bits(typingctx, v):            # the float32 whose bits are v
    return types.float32(types.int32), lambda context, builder, sig, args: builder.bitcast(args[0], _F32)


@numba.njit(nogil=True, fastmath=False)
def quantize_row(x, G, xq, d, d8sq, sx):
    """x float32 [K] -> xq int16 or int8 [K] in [-127, 127] with one scale d[g] a group; d8sq[g] = 8 d[g] sum(xq)
    (the nibbles' offset of 8, folded), sx[g] = the group's float sum (the zero points').

    No fast-math and not inlined: the float sum is 16 running lanes (k mod 16) added in one fixed tree, so its bits
    are the same in every kernel that calls this (the decode row, the prefill chunk: quant/q4_vnni.py), which a
    sum the vectoriser may reassociate per call site would not be; the max is taken on the bits (exact)."""
    K = x.shape[0]
    gs = K // G
    lanes = np.empty(16, np.float32)
    for g in range(G):
        k0 = g * gs
        mb = np.int32(0)
        for k in range(k0, k0 + gs):
            mb = max(mb, _abs_bits(x[k]))
        m = _f32_bits(mb)
        lanes[:] = 0.0
        for k in range(k0, k0 + gs - gs % 16, 16):
            for j in range(16):
                lanes[j] += x[k + j]
        for k in range(k0 + gs - gs % 16, k0 + gs):
            lanes[k % 16] += x[k]
        w = 8
        while w:
            for j in range(w):
                lanes[j] += lanes[j + w]
            w //= 2
        dg = m / np.float32(127.0)
        inv = np.float32(1.0) / dg if m > 0 else np.float32(0.0)
        s = np.int32(0)
        for k in range(k0, k0 + gs):
            v = np.int32(np.rint(x[k] * inv))
            xq[k] = v
            s += v
        d[g], d8sq[g], sx[g] = dg, dg * np.float32(8 * s), lanes[0]


@numba.njit(fastmath=True, parallel=True)
def quantize_rows(X, G):
    """Each row of X [R, K] rounded to int8 by quantize_row (the decode row's rounding): (xq int8 [R, K], d, d8sq,
    sx float32 [R, G])."""
    R, K = X.shape
    XQ, D = np.empty((R, K), np.int8), np.empty((R, G), np.float32)
    E, S = np.empty((R, G), np.float32), np.empty((R, G), np.float32)
    for r in numba.prange(R):
        quantize_row(X[r], G, XQ[r], D[r], E[r], S[r])
    return XQ, D, E, S
