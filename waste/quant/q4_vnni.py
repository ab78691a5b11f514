"""q4 matrices times many int8-rounded rows with AVX-512 VNNI (prefill): `vpdpbusd` multiplies 64 unsigned nibbles
by 64 signed int8 activations and adds them four at a time into 16 int32 lanes, 64 multiply-adds an instruction.

Why by hand: at the 30B shape a prefill chunk's expert pairs went through torch's int4 kernel at ~80 GMAC/s on two
threads (docs/LEARNED.md §10c), 60% of a 128-token prefill; llama.cpp's prefill multiplies int8 by int4 with these
instructions. numba cannot name them and LLVM does not find them in generic integer IR, so the inner loop is IR
written here around the `llvm.x86.avx512.vpdpbusd.512` intrinsic, inlined into numba kernels (as q4_int8.py's).

The stored layout (int4pack.py) has a block's 64 rows across and k down; vpdpbusd wants a row's four consecutive k in
one lane. So each group of a block is first regrouped into a small tile (4 k x 64 rows a 256-byte quad, one
two-source byte shuffle per 16 rows), then every row routed to the matrix runs over the tile: the regrouping is paid
once per block and group, not once per row.

Exactness: the integer sums are the same integers q4_int8.block_out forms (each exact in int32), and the float32
epilogue a group is the same instructions in the same order, so a row's output has the decode row's bits: it depends
on neither the thread count, nor the rows beside it, nor on whether the row was prefilled or decoded.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..numba_ptr import at, follow_torch_threads
from .int4pack import BLOCK
from .q4_int8 import quantize_rows
from .q4_numba import i8_blocks, q4_block

_I8, _I32, _F32, _I64 = ir.IntType(8), ir.IntType(32), ir.FloatType(), ir.IntType(64)
_B64, _V16, _VF = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
QUAD = 256                      # tile bytes per 4 k: 64 rows x 4 nibbles, rows 16 i .. 16 i + 15 in vector i


@functools.cache
def available() -> bool:
    """The host has AVX-512 VNNI (numba compiles for the host)."""
    import llvmlite.binding as llvm

    return llvm.get_host_cpu_features().get("avx512vnni", False)


# below this many weights a matrix stays on the float paths (quant/q4_rows.py): at the bundled model's widths (320 x
# 320, 160 x 320 with a 32-row tail block, experts of 96 x 320) they measured as fast or faster (LEARNED §10f)
MIN_WEIGHTS = 1 << 17


def serves(N: int, K: int) -> bool:
    """Whether an N x K q4 matrix's many-row products take the VNNI rows here."""
    return available() and N * K > MIN_WEIGHTS


def _c(v):
    return ir.Constant(_I64, v)


def _splat(builder, value, vtype):
    undef, lanes = ir.Constant(vtype, ir.Undefined), vtype.count
    mask = ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes)
    return builder.shuffle_vector(builder.insert_element(undef, value, ir.Constant(_I32, 0)), undef, mask)


def _vec(builder, base, index, t):
    return builder.bitcast(builder.gep(base, [index]), t.as_pointer())


def _quad_masks():
    """Byte shuffles taking (k, k + 1 | k + 2, k + 3) x 32 rows of nibbles to rows 16 h .. 16 h + 15, four k each."""
    masks = []
    for h in range(2):
        m = []
        for r in range(16):
            for t in range(4):
                m.append((t * 32 if t < 2 else 64 + (t - 2) * 32) + 16 * h + r)
        masks.append(ir.Constant(ir.VectorType(_I32, 64), m))
    return masks


def _regroup(builder, qb, kg, nq, tp):
    """tile[quad] (quads of k from kg) = the block's nibbles, each lane's four bytes one row's four k."""
    masks = _quad_masks()
    m15, four = ir.Constant(_B64, [15] * 64), ir.Constant(_B64, [4] * 64)
    with cgutils.for_range(builder, nq) as ql:
        src = builder.gep(qb, [builder.mul(builder.add(kg, builder.mul(ql.index, _c(4))), _c(32))])
        v01 = builder.load(_vec(builder, src, _c(0), _B64), align=1)
        v23 = builder.load(_vec(builder, src, _c(64), _B64), align=1)
        halves = ((builder.and_(v01, m15), builder.and_(v23, m15)), (builder.lshr(v01, four), builder.lshr(v23, four)))
        dst = builder.gep(tp, [builder.mul(ql.index, _c(QUAD))])
        for i in range(4):
            a, b = halves[i // 2]
            builder.store(builder.shuffle_vector(a, b, masks[i % 2]), _vec(builder, dst, _c(64 * i), _B64), align=1)


def _rows_pass(builder, R, first, count, x):
    """Rows first .. first + count (count a multiple of R) over the tile, R rows a pass sharing the tile's loads,
    then each row's group epilogue into its accumulator row. x: the kernel's pointers and sizes."""
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16, _V16, _V16]),
                                         "llvm.x86.avx512.vpdpbusd.512")
    accs = [cgutils.alloca_once(builder, _V16) for _ in range(4 * R)]
    with cgutils.for_range(builder, builder.sdiv(count, _c(R))) as rl:
        r0 = builder.add(first, builder.mul(rl.index, _c(R)))
        rows = [builder.load(builder.gep(x["xi"], [builder.add(r0, _c(j))])) for j in range(R)]
        xrows = [builder.gep(x["xq"], [builder.add(builder.mul(r, x["K"]), x["kg"])]) for r in rows]
        for a in accs:
            builder.store(ir.Constant(_V16, None), a)
        with cgutils.for_range(builder, x["nq"]) as ql:
            tq = builder.gep(x["tile"], [builder.mul(ql.index, _c(QUAD))])
            tv = [builder.load(_vec(builder, tq, _c(64 * i), _V16), align=1) for i in range(4)]
            k4 = builder.mul(ql.index, _c(4))
            for j in range(R):
                xb = _splat(builder, builder.load(_vec(builder, xrows[j], k4, _I32), align=1), _V16)
                for i in range(4):
                    a = accs[4 * j + i]
                    builder.store(builder.call(dot, [builder.load(a), tv[i], xb]), a)
        sixteen, high = ir.Constant(_V16, [16] * 16), ir.Constant(_V16, [-65536] * 16)
        szg = builder.gep(x["sz"], [builder.mul(x["g"], x["N"])])
        for j in range(R):
            at = builder.add(builder.mul(rows[j], x["G"]), x["g"])
            dg, d8g, sxg = (_splat(builder, builder.load(builder.gep(x[p], [at])), _VF) for p in ("d", "d8", "sx"))
            out = builder.gep(x["acc"], [builder.mul(builder.add(r0, _c(j)), _c(64))])
            for i in range(4):
                w = builder.load(_vec(builder, szg, _c(16 * i), _V16), align=1)
                s = builder.bitcast(builder.shl(w, sixteen), _VF)
                z = builder.bitcast(builder.and_(w, high), _VF)
                # q4_int8.block_out's epilogue, instruction for instruction (its bits)
                t = builder.fsub(builder.fmul(dg, builder.sitofp(builder.load(accs[4 * j + i]), _VF)), d8g)
                row = builder.fadd(builder.fmul(s, t), builder.fmul(z, sxg))
                dst = _vec(builder, out, _c(16 * i), _VF)
                builder.store(builder.fadd(builder.load(dst, align=4), row), dst, align=4)


def arrays(context, builder, sig, args):
    """An intrinsic's array arguments as numba array structs (None for the others), and data(i, t): argument i's
    data pointer as a pointer to t (real pointer provenance, as q4_int8._data says why)."""
    arr = [context.make_array(t)(context, builder, a) if isinstance(t, types.Array) else None
           for t, a in zip(sig.args, args)]

    def data(i, t):
        return builder.bitcast(arr[i].data, t.as_pointer())
    return arr, data


@intrinsic
def block_rows_i8(typingctx, q_a, sz_a, N, xq, d, d8sq, sx, xi, nr, tile, acc):
    """acc[r, :64] = one full block's 64 rows of W times row xi[r] of xq (int8 [R, K], rounded by
    q4_int8.quantize_row with d, d8sq, sx float32 [R, G]), r < nr. q_a: the block's nibbles (K x 32 bytes); sz_a: its
    first row's (s, z) bf16 pair in group 0, group g's N pairs further. Scratch: tile uint8 [K / G / 4 * 256]."""
    def codegen(context, builder, sig, args):
        arr, data = arrays(context, builder, sig, args)
        K = cgutils.unpack_tuple(builder, arr[3].shape)[1]
        G = cgutils.unpack_tuple(builder, arr[4].shape)[1]
        x = {"xq": data(3, _I8), "d": data(4, _F32), "d8": data(5, _F32), "sx": data(6, _F32),
             "xi": data(7, _I64), "tile": data(9, _I8), "acc": data(10, _F32), "K": K, "G": G, "N": args[2],
             "sz": builder.inttoptr(args[1], _I32.as_pointer())}
        qb, nr = builder.inttoptr(args[0], _I8.as_pointer()), args[8]
        gs = builder.sdiv(K, G)
        x["nq"] = builder.sdiv(gs, _c(4))
        with cgutils.for_range(builder, builder.mul(nr, _c(4))) as zl:
            builder.store(ir.Constant(_VF, None), _vec(builder, x["acc"], builder.mul(zl.index, _c(16)), _VF), align=4)
        n4 = builder.mul(builder.sdiv(nr, _c(4)), _c(4))
        with cgutils.for_range(builder, G) as gl:
            x["g"] = gl.index
            x["kg"] = builder.mul(gl.index, gs)
            _regroup(builder, qb, x["kg"], x["nq"], x["tile"])
            _rows_pass(builder, 4, _c(0), n4, x)
            _rows_pass(builder, 1, n4, builder.sub(nr, n4), x)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, xq, d, d8sq, sx, xi, types.int64, tile, acc), codegen


RB = 64                         # rows per task of a trunk matrix (its tile regrouped once a task)


@numba.njit(fastmath=True, cache=True, parallel=True)
def matmul_i8(x_p, R, q_p, sz_p, N, K, G, y):
    """y [R, N] = X [R, K] @ W.T for one q4 matrix, each row as the decode row computes it (quant/q4_numba.q4_row:
    full blocks from the int8-rounded row, a tail block in float): tasks of (block, RB rows) over the threads."""
    X = at(x_p, (R, K), np.float32)
    q, szs = at(q_p, (N * K // 2,), np.uint8), at(sz_p, (G * N * 2,), np.uint16)
    XQ, D, E, S = quantize_rows(X, G)
    nfull, nblk, nrb = i8_blocks(N, K, G), (N + BLOCK - 1) // BLOCK, (R + RB - 1) // RB
    for t in numba.prange(nblk * nrb):
        b, r0 = t // nrb, t % nrb * RB
        r1 = min(R, r0 + RB)
        if b < nfull:
            xi = np.arange(r0, r1)
            tile, acc = np.empty(K // G // 4 * QUAD, np.uint8), np.empty((r1 - r0, BLOCK), np.float32)
            block_rows_i8(q_p + b * 32 * K, sz_p + b * BLOCK * 4, N, XQ, D, E, S, xi, r1 - r0, tile, acc)
            for r in range(r0, r1):
                y[r, b * BLOCK:b * BLOCK + BLOCK] = acc[r - r0]
        else:
            scratch = np.empty(BLOCK, np.float32)
            for r in range(r0, r1):
                q4_block(q, 0, szs, G, N, K, b, X[r], y[r], scratch)


def linear(x: torch.Tensor, parts: dict, shape) -> torch.Tensor:
    """x [T, K] float32 @ W.T for one q4 matrix in the stored layout (a prefill chunk through the trunk)."""
    N, K = shape
    x = x if x.is_contiguous() else x.contiguous()
    y = np.empty((x.shape[0], N), np.float32)
    follow_torch_threads()
    matmul_i8(x.data_ptr(), x.shape[0], parts["q"].data_ptr(), parts["sz"].data_ptr(), N, K, parts["sz"].shape[0], y)
    return torch.from_numpy(y)
