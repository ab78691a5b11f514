"""Triton kernels for a MoE layer's routed experts on a GPU, read in place from the expert slab's slots.

layers/moe.py's registry picks these for ("float" | "q8" | "q4" | "mxfp4", "cuda") when triton imports. One row
(decode) against its k pairs: one launch computes every pair's gate and up rows (the slot ids are read on the GPU,
so no host sync and no gathered copy of a matrix), the activation is the bank's own (torch), and one launch computes
every pair's down rows. Each program owns one pair and BN output rows and loops over K, accumulating in float32, so
a pair's result does not depend on the other pairs in the call (moe.py's exactness rule). Layouts (docs/FORMAT.md):
  float  W [slots, N, K]                                       y = W x
  q8     q int8 [slots, N, K], scale f32 [slots, N]             y = (q x) * scale
  q4     q uint8 [slots, N, K/2] in the GPU's row layout (q4_rows), sz bf16 [slots, K/g, N, 2]: W = (q - 8) s + z
  mxfp4  blocks uint8 [slots, N, K/2] (low nibble = even k), scales uint8 [slots, N, K/32]: W = E2M1 * 2^(e-127)
Float formats with more than one row (prefill) go through moe.segments: one matmul per distinct expert does
better there; the packed formats have no torch GPU matmul, so their prefill pairs run here too (each reads its expert).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.lowbit import E2M1
from . import q4_int8_rows, q4_rows
from .moe import Bank, register, register_layout, segments

# tiles per format kind (rows per program, columns per step, warps): the fastest of those timed on the H200 inside
# a CUDA graph (docs/LEARNED.md §10); q4's are q4_rows'
TILES = {"float": (16, 256, 8), "q8": (16, 256, 8), "mxfp4": (8, 256, 4)}


@triton.jit
def _pair(slot_ptr, y_ptr, DY, NBLK, N, BN: tl.constexpr):
    """What every kernel's program starts from: its pair p, the pair's slot (0 where not held), whether this call
    holds it, which of the launch's matrices, its BN output rows n, the output's base, the rows' mask."""
    p = tl.program_id(0)
    slot = tl.load(slot_ptr + p).to(tl.int64)
    held = slot >= 0                          # -1: this call does not hold the pair's expert; its row stays zero
    slot = tl.maximum(slot, 0)
    which = tl.program_id(1) // NBLK          # 0: the first matrix (gate, down), 1: the second (up)
    n = (tl.program_id(1) % NBLK) * BN + tl.arange(0, BN)
    return p, slot, held, which, n, y_ptr + which * DY, n < N


@triton.jit
def _dense_mv(x_ptr, sx, slot_ptr, w_ptr, ws, wn, s_ptr, ss, y_ptr, sy, N, K, KDIV, NBLK, DW, DS, DY,
              BN: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr):
    # float W (SCALED false) or q8 codes with a scale per row (SCALED: y = (q x) * scale)
    p, slot, held, which, n, y_ptr, nm = _pair(slot_ptr, y_ptr, DY, NBLK, N, BN)
    row = w_ptr + which * DW + slot * ws + n[:, None].to(tl.int64) * wn
    xrow = x_ptr + (p // KDIV) * sx
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        xv = tl.load(xrow + k, mask=km, other=0.0).to(tl.float32)
        w = tl.load(row + k[None, :], mask=nm[:, None] & km[None, :], other=0).to(tl.float32)
        acc += tl.sum(w * xv[None, :], 1)
    if SCALED:
        acc = acc * tl.load(s_ptr + which * DS + slot * ss + n, mask=nm, other=0.0)
    tl.store(y_ptr + p * sy + n, tl.where(held, acc, 0.0).to(y_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _down_act(gu_ptr, DU, sgu, slot_ptr, wt_ptr, w_ptr, ws, wn, s_ptr, ss, y_ptr, sy, N, K, limit,
              BN: tl.constexpr, BK: tl.constexpr, KIND: tl.constexpr, LIMIT: tl.constexpr):
    # pair p's weight_p * down_{slot_p}(act(gate_p, up_p)), BN rows of it: the activation applied as the down matrix
    # reads it, float32 out. KIND 0: float W, 1: q8 (codes, a scale per row)
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    slot = tl.load(slot_ptr + p).to(tl.int64)
    wt = tl.where(slot >= 0, tl.load(wt_ptr + p), 0.0)      # -1: not held here; its row stays zero
    slot = tl.maximum(slot, 0)
    acc = tl.zeros([BN], tl.float32)
    row = w_ptr + slot * ws + n[:, None].to(tl.int64) * wn
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        xv = _act(gu_ptr + p * sgu, DU, k, km, limit, LIMIT)
        w = tl.load(row + k[None, :], mask=nm[:, None] & km[None, :], other=0).to(tl.float32)
        acc += tl.sum(w * xv[None, :], 1)
    if KIND == 1:
        acc = acc * tl.load(s_ptr + slot * ss + n, mask=nm, other=0.0)
    tl.store(y_ptr + p * sy + n, wt * acc, mask=nm)


@triton.jit
def _act(gu_ptr, DU, k, km, limit, LIMIT: tl.constexpr):
    # SwiGLU of a pair's gate and up outputs (up DU elements after gate), clamped where the bank has a limit
    g = tl.load(gu_ptr + k, mask=km, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + DU + k, mask=km, other=0.0).to(tl.float32)
    if LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(g) * u


@triton.jit
def _mx_mv(x_ptr, sx, slot_ptr, b_ptr, bs, bn, e_ptr, es, en, lut_ptr, pow2_ptr, y_ptr, sy, N, K, KDIV, NBLK, DW, DS,
           DY, BN: tl.constexpr, BK: tl.constexpr):
    p, slot, held, which, n, y_ptr, nm = _pair(slot_ptr, y_ptr, DY, NBLK, N, BN)
    brow = b_ptr + which * DW + slot * bs + n[:, None].to(tl.int64) * bn
    erow = e_ptr + which * DS + slot * es + n[:, None].to(tl.int64) * en
    xrow = x_ptr + (p // KDIV) * sx
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        m2 = nm[:, None] & km[None, :]
        xv = tl.load(xrow + k, mask=km, other=0.0).to(tl.float32)
        c = tl.load(brow + (k // 2)[None, :], mask=m2, other=0).to(tl.int32)
        c = (c >> ((k % 2) * 4)[None, :]) & 15
        e = tl.load(erow + (k // 32)[None, :], mask=m2, other=0).to(tl.int32)
        w = tl.load(lut_ptr + c) * tl.load(pow2_ptr + e)
        acc += tl.sum(w * xv[None, :], 1)
    tl.store(y_ptr + p * sy + n, tl.where(held, acc, 0.0).to(y_ptr.dtype.element_ty), mask=nm)


_TABLES: dict = {}


def _tables(device):
    t = _TABLES.get(device)
    if t is None:
        pow2 = torch.tensor([2.0 ** (e - 127) for e in range(256)], dtype=torch.float32)
        t = _TABLES[device] = (E2M1.to(device), pow2.to(device))
    return t


def _delta(a: torch.Tensor, b: torch.Tensor) -> int:
    """b's offset from a in elements, where b is a as another matrix of the same record (same shape, strides)."""
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        raise ValueError("the two matrices of a fused launch must have the same layout")
    d, r = divmod(b.data_ptr() - a.data_ptr(), a.element_size())
    if r:
        raise ValueError("matrix parts not aligned to their element size")
    return d


def matvec(ms: tuple[str, ...], x: torch.Tensor, slots: torch.Tensor, bank: Bank, out: torch.Tensor, kdiv: int,
           bn: int | None = None, bk: int | None = None, warps: int | None = None) -> torch.Tensor:
    """out[j, p] = W_{ms[j], slots[p]} x[p // kdiv] for one or two matrices ms of the same shape (gate and up),
    every pair p, in one launch; x [rows, K] with unit column stride, out [len(ms), P, N] (contiguous rows).
    Tiles default to the format kind's TILES (q4: q4_rows' rows a program, groups a step, warps)."""
    N, K = bank.shapes[ms[0]]
    P = slots.numel()
    ps, kind = bank.parts[ms[0]], bank.fmt.kind or bank.fmt.name
    if kind == "q4":
        t = q4_rows.GATE_UP
        return q4_rows.matvec(ms, x, kdiv, slots, bank, out, _delta, (bn or t[0], t[1], warps or t[2]))
    dbn, dbk, dw = TILES.get(kind, (16, 128, 4))
    bn, bk, warps = bn or dbn, bk or dbk, warps or dw
    two = bank.parts[ms[-1]]
    nblk = triton.cdiv(N, bn)
    grid = (P, nblk * len(ms))
    sx = x.stride(0)
    dy = out.stride(0) if len(ms) == 2 else 0
    o = out[0]
    if kind in ("float", "q8"):
        w, s = (ps[""], None) if kind == "float" else (ps["q"], ps["scale"])
        _dense_mv[grid](x, sx, slots, w, w.stride(0), w.stride(1), w if s is None else s, 0 if s is None else
                        s.stride(0), o, o.stride(0), N, K, kdiv, nblk, _delta(w, two["q" if s is not None else ""]),
                        0 if s is None else _delta(s, two["scale"]), dy, BN=bn, BK=bk, SCALED=s is not None,
                        num_warps=warps)
    elif kind == "mxfp4":
        b, e = ps["blocks"], ps["scales"]
        lut, pow2 = _tables(x.device)
        _mx_mv[grid](x, sx, slots, b, b.stride(0), b.stride(1), e, e.stride(0), e.stride(1), lut, pow2, o,
                     o.stride(0), N, K, kdiv, nblk, _delta(b, two["blocks"]), _delta(e, two["scales"]), dy,
                     BN=bn, BK=bk, num_warps=warps)
    else:
        raise ValueError(f"no triton kernel for {kind}")
    return out


def pairs(x: torch.Tensor, slots: torch.Tensor, bank: Bank, **tune) -> torch.Tensor:
    """Each (row, choice) pair's expert output [T, k, h] (unweighted), read in place from the slab: two launches
    (gate and up together, then down) and the bank's activation between them. Pairs of slot -1 stay zero. Float
    formats with more than one row go through moe.segments (one matmul per distinct expert)."""
    T, k = slots.shape
    if T > 1 and bank.fmt.kind == "float":
        return segments(x, slots, bank)
    kd = bank.fmt.kernel_dtype
    xk = x if kd is None or x.dtype == kd else x.to(kd)     # q4: the row as the CPU's int4 kernel takes it
    xk = xk.contiguous()
    flat = slots.reshape(-1).contiguous()
    P = flat.numel()
    inter, hid = bank.shapes["gate"][0], bank.shapes["down"][0]
    gu = torch.empty(2, P, inter, dtype=xk.dtype, device=x.device)
    matvec(("gate", "up"), xk, flat, bank, gu, k, **tune)
    g, u = _biased(gu[0], bank, "gate", flat), _biased(gu[1], bank, "up", flat)
    h = bank.activate(g, u).contiguous()
    y = torch.empty(1, P, hid, dtype=xk.dtype, device=x.device)
    matvec(("down",), h, flat, bank, y, 1, **tune)
    y = _biased(y[0], bank, "down", flat).view(T, k, hid)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _biased(y: torch.Tensor, bank: Bank, m: str, flat: torch.Tensor) -> torch.Tensor:
    """y + the pairs' biases where the records carry them (gpt-oss), none on -1 pairs (they stay zero)."""
    b = bank.parts[m].get("bias")
    if b is None:
        return y
    return y + torch.where((flat >= 0).unsqueeze(-1), b[flat.clamp_min(0)].to(y.dtype), 0)


pairs.any_slots = True      # exact per pair at any number of rows, and -1 pairs left zero

# the weighted down launch: rows per program, columns per step, warps (q4: q4_rows' tiles)
DOWN_TILES = {"float": (8, 256, 4), "q8": (8, 256, 4)}
WEIGHTED = ("float", "q8", "q4")


def serves(x: torch.Tensor, bank: Bank) -> bool:
    """Whether weighted_pairs computes these rows' pairs (not: records with biases, another activation than SwiGLU,
    mxfp4, float prefill): decided by the rows and the bank alone, so every group of a layer takes the same path."""
    kind = bank.fmt.kind or bank.fmt.name
    return not bank.bias and bank.act is None and kind in WEIGHTED and (x.shape[0] == 1 or kind != "float")


def _rows(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, bank: Bank):
    """The kernels' operands: x in the format's kernel dtype, the pairs' slots and float32 weights flat."""
    kd = bank.fmt.kernel_dtype
    xk = (x if kd is None or x.dtype == kd else x.to(kd)).contiguous()
    return xk, slots.reshape(-1).contiguous(), weights.reshape(-1).float().contiguous()


def weighted_pairs(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, bank: Bank, bn: int | None = None,
                   bk: int | None = None, warps: int | None = None, total: torch.dtype | None = None,
                   **tune) -> torch.Tensor:
    """weights[t, k] * expert_{slots[t, k]}(x[t]) per pair, float32 [T, k, h] (-1 pairs zero), in two launches:
    gate and up (q4: with the SwiGLU applied), then down with the routing weight applied (float, q8: the SwiGLU
    applied as it reads). Exact per pair whatever else is in the call; the caller sums over k once every group of the
    layer is in (moe.routed_groups), so the bits do not depend on the grouping. total: the pairs summed over k
    instead, [T, h] in that dtype (sum_pairs' arithmetic; q4 decode rows: inside the down launch), for a layer
    whose pairs are all in one group."""
    T, k = slots.shape
    kind = bank.fmt.kind or bank.fmt.name
    xk, flat, wt = _rows(x, slots, weights, bank)
    P = flat.numel()
    N, K = bank.shapes["down"]
    if kind == "q4":
        # a decode row: x rounded to int8 as the CPU's decode row is (q4_int8_rows); prefill rows stay float32, as
        # the CPU's prefill
        rows = q4_int8_rows if T == 1 and q4_int8_rows.serves(bank) else q4_rows
        a = rows.gate_up_act(xk, k, flat, bank, _delta, tune.get("gate_up"))
        if total is not None and rows is q4_int8_rows:
            return rows.down(a, flat, wt, bank, tune.get("down"), total=total)
        y = rows.down(a, flat, wt, bank, tune.get("down")).view(T, k, N)
        return y if total is None else sum_pairs(y, total)
    inter = bank.shapes["gate"][0]
    gu = torch.empty(2, P, inter, dtype=xk.dtype, device=x.device)
    matvec(("gate", "up"), xk, flat, bank, gu, k, bn=bn, bk=bk, warps=warps)
    dbn, dbk, dw = DOWN_TILES[kind]
    bn, warps = bn or dbn, warps or dw
    y = torch.empty(P, N, dtype=torch.float32, device=x.device)
    ps = bank.parts["down"]
    lim = bank.limit is not None
    w, s = (ps[""], None) if kind == "float" else (ps["q"], ps["scale"])
    _down_act[(P, triton.cdiv(N, bn))](gu, gu.stride(0), gu.stride(1), flat, wt, w, w.stride(0), w.stride(1),
                                       w if s is None else s, 0 if s is None else s.stride(0), y, y.stride(0), N, K,
                                       bank.limit if lim else 0.0, BN=bn, BK=bk or dbk,
                                       KIND={"float": 0, "q8": 1}[kind], LIMIT=lim, num_warps=warps)
    return y.view(T, k, N) if total is None else sum_pairs(y.view(T, k, N), total)


@triton.jit
def _sum_pairs(y_ptr, o_ptr, K, N, BLOCK: tl.constexpr):
    # out[t] = sum over j of y[t, j] in the order j = 0, 1, .., in float32, rounded once on the store
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(K):
        acc += tl.load(y_ptr + (t * K + j) * N + n, mask=m, other=0.0)
    tl.store(o_ptr + t * N + n, acc.to(o_ptr.dtype.element_ty), mask=m)


def sum_pairs(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weighted_pairs' float32 pairs [T, k, h] summed over k and cast to dtype [T, h] in one launch (torch's sum over
    the middle axis and the cast were two, 5 us a layer on the H200: docs/LEARNED.md §10g)."""
    y = y.contiguous()
    T, K, N = y.shape
    out = torch.empty(T, N, dtype=dtype, device=y.device)
    _sum_pairs[(T, triton.cdiv(N, 256))](y, out, K, N, BLOCK=256, num_warps=2)
    return out


weighted_pairs.serves = serves
weighted_pairs.sum_pairs = sum_pairs
pairs.weighted_pairs = weighted_pairs
register_layout("q4", "cuda")(q4_rows.device_layout)


for _kind in ("float", "q8", "q4", "mxfp4"):
    register(_kind, "cuda")(pairs)
