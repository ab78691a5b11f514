"""A q8 trunk matrix times many rows by AVX-512 VNNI (prefill): each row rounded to int8 in blocks of 32 as the
decode row rounds it (q4_int8.quantize_row), a block of 64 weight rows regrouped once per 32 k into a tile (each
lane one row's four k: `vpdpbusd`'s operand), then every row over the tile.

Why: a prefill chunk's q8 trunk went through torch's `_weight_int8pack_mm` (bf16) or the codes widened to float32
(float32 rows): 28 ms a layer for a 128-token chunk of the Qwen3-30B-A3B shape, a third of the default container's
prefill after the experts moved to VNNI (docs/LEARNED.md §10f). vpdpbusd multiplies unsigned by signed bytes: the
row goes in as xq + 128 and 128 x the block's code sums (one more vpdpbusd against ones, once per tile) is taken off.

Bits: integer sums per (row, block) exact; the float epilogue per block in block order, then the row scale: a row's
result depends on neither the threads nor the other rows (not the decode row's bits: that kernel sums across k
lanes). Only the trunk takes it (quant/linear.py): Q8.linear stays float32-exact for the experts' pairs.
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..numba_ptr import at, follow_torch_threads
from .q4_int8 import quantize_rows
from .q4_vnni import QUAD, _B64, _F32, _I8, _I32, _I64, _V16, _VF, _c, _splat, _vec, arrays, available

XB = 32                         # x's rounding block (q8_numba's)
ROWS = 64                       # weight rows a tile; rows of x a task below
# from this many weights (the bundled model's 320 x 320 measured no faster: 0.11 against 0.105 ms at 128 rows, and there
# the exact float path keeps the prefill's logits closer to the release's; the 30B shape's matrices are 40x this)
MIN_WEIGHTS = 1 << 18


def serves(N: int, K: int) -> bool:
    return available() and N % ROWS == 0 and K % XB == 0 and N * K >= MIN_WEIGHTS


def _regroup(builder, w, K, k0, tile, sw, dot):
    """tile[q] (q < 8) = rows 0..63's codes at k0 + 4q .. + 3, lane i of vector v row 16 v + i; sw[v] = the block's
    code sums a row (vpdpbusd of ones against the tile)."""
    ones = ir.Constant(_B64, [1] * 64)
    sums = [ir.Constant(_V16, None)] * 4
    for q in range(8):
        for v in range(4):
            vec = ir.Constant(_V16, ir.Undefined)
            for i in range(16):
                at_ = builder.add(builder.mul(_c(16 * v + i), K), builder.add(k0, _c(4 * q)))
                val = builder.load(builder.bitcast(builder.gep(w, [at_]), _I32.as_pointer()), align=1)
                vec = builder.insert_element(vec, val, ir.Constant(_I32, i))
            builder.store(vec, _vec(builder, tile, _c(QUAD * q + 64 * v), _V16), align=1)
            sums[v] = builder.call(dot, [sums[v], builder.bitcast(ones, _V16), vec])
    for v in range(4):
        builder.store(sums[v], _vec(builder, sw, _c(16 * v), _V16), align=4)


def _pass(builder, R, first, count, x, dot):
    accs = [cgutils.alloca_once(builder, _V16) for _ in range(4 * R)]
    seven = ir.Constant(_V16, [7] * 16)
    with cgutils.for_range(builder, builder.sdiv(count, _c(R))) as rl:
        r0 = builder.add(first, builder.mul(rl.index, _c(R)))
        rows = [builder.load(builder.gep(x["xi"], [builder.add(r0, _c(j))])) for j in range(R)]
        xrows = [builder.gep(x["xu"], [builder.add(builder.mul(r, x["Kp"]), x["k0"])]) for r in rows]
        for a in accs:
            builder.store(ir.Constant(_V16, None), a)
        for q in range(8):
            tv = [builder.load(_vec(builder, x["tile"], _c(QUAD * q + 64 * i), _V16), align=1) for i in range(4)]
            for j in range(R):
                xb = _splat(builder, builder.load(_vec(builder, xrows[j], _c(4 * q), _I32), align=1), _V16)
                for i in range(4):
                    a = accs[4 * j + i]
                    builder.store(builder.call(dot, [builder.load(a), xb, tv[i]]), a)
        sw = [builder.shl(builder.load(_vec(builder, x["sw"], _c(16 * i), _V16), align=4), seven) for i in range(4)]
        for j in range(R):
            dg = _splat(builder, builder.load(builder.gep(x["d"], [builder.add(builder.mul(rows[j], x["G"]), x["b"])])),
                        _VF)
            out = builder.gep(x["acc"], [builder.mul(builder.add(r0, _c(j)), _c(64))])
            for i in range(4):
                t = builder.sitofp(builder.sub(builder.load(accs[4 * j + i]), sw[i]), _VF)
                dst = _vec(builder, out, _c(16 * i), _VF)
                builder.store(builder.fadd(builder.load(dst, align=4), builder.fmul(dg, t)), dst, align=4)


@intrinsic
def block_rows_q8(typingctx, w_a, K, xu, d, xi, nr, tile, sw, acc):
    """acc[r, :64] = sum over blocks b (ascending) of d[xi[r], b] * (64 weight rows' codes at w_a (row stride K) .
    the int8 row xi[r] in block b), r < nr: xu uint8 [R, Kp] (xq + 128), d float32 [R, K / 32]. Scratch: tile
    uint8 [8 * 256], sw int32 [64]."""
    def codegen(context, builder, sig, args):
        arr, data = arrays(context, builder, sig, args)
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16, _V16, _V16]),
                                             "llvm.x86.avx512.vpdpbusd.512")
        K, nr = args[1], args[5]
        x = {"xu": data(2, _I8), "d": data(3, _F32), "xi": data(4, _I64), "tile": data(6, _I8), "sw": data(7, _I32),
             "acc": data(8, _F32), "Kp": cgutils.unpack_tuple(builder, arr[2].shape)[1],
             "G": cgutils.unpack_tuple(builder, arr[3].shape)[1]}
        w = builder.inttoptr(args[0], _I8.as_pointer())
        with cgutils.for_range(builder, builder.mul(nr, _c(4))) as zl:
            builder.store(ir.Constant(_VF, None), _vec(builder, x["acc"], builder.mul(zl.index, _c(16)), _VF), align=4)
        n4 = builder.mul(builder.sdiv(nr, _c(4)), _c(4))
        with cgutils.for_range(builder, builder.sdiv(K, _c(XB))) as bl:
            x["b"], x["k0"] = bl.index, builder.mul(bl.index, _c(XB))
            _regroup(builder, w, K, x["k0"], x["tile"], x["sw"], dot)
            _pass(builder, 4, _c(0), n4, x, dot)
            _pass(builder, 1, n4, builder.sub(nr, n4), x, dot)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, xu, d, xi, types.int64, tile, sw, acc), codegen


@numba.njit(fastmath=True, cache=True, parallel=True)
def matmul_q8(x_p, R, q_p, s_p, N, K, y):
    """y [R, N] = X [R, K] @ W.T for one q8 matrix (N a multiple of 64, K of 32): tasks of (64 weight rows, ROWS
    rows of X) over the threads."""
    X, sc = at(x_p, (R, K), np.float32), at(s_p, (N,), np.float32)
    XQ, D, _, _ = quantize_rows(X, K // XB)
    XU = np.empty((R, K), np.uint8)
    for r in numba.prange(R):
        for k in range(K):
            XU[r, k] = np.uint8(XQ[r, k] + 128)
    nrb = (R + ROWS - 1) // ROWS
    for t in numba.prange(N // ROWS * nrb):
        b, r0 = t // nrb, t % nrb * ROWS
        r1 = min(R, r0 + ROWS)
        xi = np.arange(r0, r1)
        tile, sw, acc = np.empty(8 * QUAD, np.uint8), np.empty(64, np.int32), np.empty((r1 - r0, 64), np.float32)
        block_rows_q8(q_p + b * ROWS * K, K, XU, D, xi, r1 - r0, tile, sw, acc)
        for r in range(r0, r1):
            for j in range(64):
                y[r, b * ROWS + j] = acc[r - r0, j] * sc[b * ROWS + j]


def linear(x: torch.Tensor, parts: dict, shape) -> torch.Tensor:
    """x [T, K] float32 or bf16 (widened, the result rounded back) @ W.T for one q8 trunk matrix."""
    N, K = shape
    dt = x.dtype
    x = x.float() if dt != torch.float32 else x if x.is_contiguous() else x.contiguous()
    y = np.empty((x.shape[0], N), np.float32)
    follow_torch_threads()
    matmul_q8(x.data_ptr(), x.shape[0], parts["q"].data_ptr(), parts["scale"].data_ptr(), N, K, y)
    return torch.from_numpy(y) if dt == torch.float32 else torch.from_numpy(y).to(dt)
