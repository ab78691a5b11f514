"""q4 decode rows with int8 activations: the row is rounded to int8 per weight group (one float scale a group) and
multiplied with the stored nibbles in 16-bit integer lanes, the way llama.cpp's Q4_0 x Q8_0 dot works.

Why by hand: the float loop (q4_numba.q4_block4) converts every nibble to float32 and runs at 7 GB/s of nibbles a
thread; llama.cpp's integer dots at ~2x that. numba types every small-integer expression as int64, so a loop written
in numba vectorises 8 lanes wide (LEARNED §10a), and no library multiplies int4pack's layout (a block's 64 rows
across, k down) by an int8 row. So the inner 16 k of a block are LLVM IR written here with explicit 32-lane vectors
(generic IR, no x86 intrinsics: LLVM picks the host's instructions, AVX-512 / AVX2 / NEON), inlined into the numba
kernels through `numba.extending.intrinsic`: 16.4 GB/s a thread on a 768 x 2048 matrix (docs/LEARNED.md §10d).

Exactness: the result is W times the int8-rounded row, each pair's sums in integers (no overflow: |nibble x q| <=
15 x 127 and 16 of them fit int16, the group in int32), then one float32 epilogue per group; the bits depend on
neither the thread count nor the batch. Rounding x to int8 in groups of 32-256 costs ~0.5% of the row's norm, the
class of error torch's int4 kernel makes by rounding x to bf16 (quant/int4pack.py), and far below q4's own.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

KSTEP = 16                      # k per integer pass: 16 x 15 x 127 < 2^15
_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V8, _V16, _V32, _VF = (ir.VectorType(t, 32) for t in (_I8, _I16, _I32, _F32))
_LANE0 = ir.Constant(_I32, 0)
_SPLAT = ir.Constant(ir.VectorType(_I32, 32), [0] * 32)


def _splat(builder, value, vtype):
    undef = ir.Constant(vtype, ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(undef, value, _LANE0), undef, _SPLAT)


def _ptr(builder, addr, t):
    return builder.inttoptr(addr, t.as_pointer())


@intrinsic
def dot16(typingctx, b_p, x_p, acc_p):
    """acc int32 [64] += the 64 rows of a full block over 16 k: nibbles at b_p (16 x 32 bytes: byte j of a k holds
    row j low, row j + 32 high), x_p 16 int16 (the int8-rounded row)."""
    def codegen(context, builder, sig, args):
        rows, xs = _ptr(builder, args[0], _V8), _ptr(builder, args[1], _I16)
        m15, four = ir.Constant(_V16, [15] * 32), ir.Constant(_V16, [4] * 32)
        lo = hi = ir.Constant(_V16, None)
        for k in range(KSTEP):
            c = builder.zext(builder.load(builder.gep(rows, [ir.Constant(_I32, k)]), align=1), _V16)
            xk = _splat(builder, builder.load(builder.gep(xs, [ir.Constant(_I32, k)]), align=2), _V16)
            lo = builder.add(lo, builder.mul(builder.and_(c, m15), xk))
            hi = builder.add(hi, builder.mul(builder.lshr(c, four), xk))
        acc = _ptr(builder, args[2], _V32)
        for h, v in enumerate((lo, hi)):
            a = builder.gep(acc, [ir.Constant(_I32, h)])
            builder.store(builder.add(builder.load(a, align=4), builder.sext(v, _V32)), a, align=4)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def group_out(typingctx, acc_p, sz_p, y_p, d, d8sq, sx):
    """y float32 [64] += s (d acc - d8sq) + z sx for the block's 64 rows of one group, then acc = 0; sz_p: the
    rows' (s, z) bf16 pairs, read as one 32-bit word a row (s the low half, z the high: little-endian)."""
    def codegen(context, builder, sig, args):
        acc, sz, y = _ptr(builder, args[0], _V32), _ptr(builder, args[1], _V32), _ptr(builder, args[2], _VF)
        dv, d8v, sxv = (_splat(builder, v, _VF) for v in args[3:])
        sixteen, high = ir.Constant(_V32, [16] * 32), ir.Constant(_V32, [-65536] * 32)
        for h in range(2):
            i = [ir.Constant(_I32, h)]
            w = builder.load(builder.gep(sz, i), align=1)
            s = builder.bitcast(builder.shl(w, sixteen), _VF)
            z = builder.bitcast(builder.and_(w, high), _VF)
            a = builder.gep(acc, i)
            t = builder.fsub(builder.fmul(dv, builder.sitofp(builder.load(a, align=4), _VF)), d8v)
            yh = builder.gep(y, i)
            builder.store(builder.fadd(builder.load(yh, align=4), builder.fadd(builder.fmul(s, t), builder.fmul(z, sxv))),
                          yh, align=4)
            builder.store(ir.Constant(_V32, None), a, align=4)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, types.float32, types.float32, types.float32), codegen


@numba.njit(fastmath=True, inline="always")
def quantize_row(x, G, xq, d, d8sq, sx):
    """x float32 [K] -> xq int16 [K] in [-127, 127] with one scale d[g] a group; d8sq[g] = 8 d[g] sum(xq) (the
    nibbles' offset of 8, folded), sx[g] = the group's float sum (the zero points')."""
    K = x.shape[0]
    gs = K // G
    for g in range(G):
        m = np.float32(0.0)
        t = np.float32(0.0)
        for k in range(g * gs, g * gs + gs):
            m = max(m, abs(x[k]))
            t += x[k]
        dg = m / np.float32(127.0)
        inv = np.float32(1.0) / dg if m > 0 else np.float32(0.0)
        s = 0
        for k in range(g * gs, g * gs + gs):
            v = np.int32(np.rint(x[k] * inv))
            xq[k] = v
            s += v
        d[g], d8sq[g], sx[g] = dg, dg * np.float32(8 * s), t


@numba.njit(fastmath=True, inline="always")
def block_i8(q_a, sz_a, G, N, K, b, xq_a, d, d8sq, sx, acc_a, yb_a):
    """Block b (full, 64 rows) of W x into yb [64] from the int8 row: q_a the matrix's nibbles' address, sz_a its
    (s, z) pairs' address ([G, N, 2] bf16), xq_a / acc_a / yb_a addresses of xq int16 [K], acc int32 [64] (zero)
    and yb float32 [64] (zero)."""
    gs = K // G
    base = q_a + b * 32 * K
    for g in range(G):
        for c in range(g * gs // KSTEP, (g * gs + gs) // KSTEP):
            dot16(base + c * KSTEP * 32, xq_a + c * KSTEP * 2, acc_a)
        group_out(acc_a, sz_a + (g * N + b * 64) * 4, yb_a, d[g], d8sq[g], sx[g])
