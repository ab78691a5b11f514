"""Triton kernels for a MoE layer's routed experts on a GPU, read in place from the expert slab's slots.

layers/moe.py's registry picks these for ("float" | "q8" | "q4" | "mxfp4", "cuda") when triton imports. One row
(decode) against its k pairs: one launch computes every pair's gate and up rows (the slot ids are read on the GPU,
so no host sync and no gathered copy of a matrix), the activation is the bank's own (torch), and one launch computes
every pair's down rows. Each program owns one pair and BN output rows and loops over K, accumulating in float32, so
a pair's result does not depend on the other pairs in the call (moe.py's exactness rule). Layouts (docs/FORMAT.md):
  float  W [slots, N, K]                                       y = W x
  q8     q int8 [slots, N, K], scale f32 [slots, N]             y = (q x) * scale
  q4     q uint8 [slots, N, K/2] (int4pack's 64-row blocks), sz bf16 [slots, K/g, N, 2]: W = (q - 8) s + z
  mxfp4  blocks uint8 [slots, N, K/2] (low nibble = even k), scales uint8 [slots, N, K/32]: W = E2M1 * 2^(e-127)
Float formats with more than one row (prefill) go through moe.segments: one matmul per distinct expert does
better there; the packed formats have no torch GPU matmul, so their prefill pairs run here too (each reads its expert).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.lowbit import E2M1
from . import q4_tiled
from .q4_tiled import _pair_block
from .moe import Bank, register, segments

# tiles per format kind (rows per program, columns per step, warps): the fastest of those timed on the H200 inside
# a CUDA graph (docs/LEARNED.md §10); q4's columns per step are its group
TILES = {"float": (16, 256, 8), "q8": (16, 256, 8), "q4": (16, 64, 4), "mxfp4": (8, 256, 4)}
# q4's block kernel (each byte read once, a 64-row block's columns loaded 32 bytes wide; K split over `split`
# programs) is opt-in (Q4_BLOCK): on the H200 a 48-layer decode step took 7.6 ms with it, 5.9 with the any-row
# kernel (docs/LEARNED.md §10b; §10 had measured its first form, one byte column at a time, worse too)
Q4_BLOCK = False
# q4 decode pairs through q4_tiled (coalesced tiles, K split over programs): the default where its shapes serve
Q4_TILED = True


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
def _q4_rows(n, N, K, NFULL):
    # int4pack's layout: rows in blocks of 64, byte j of column k of a full block holds rows j (low) and j + 32
    # (high); the tail block of nb rows holds rows 2j (low) and 2j + 1 (high). Both are base(n) + k * kstride(n).
    full = n < NFULL
    t = n - NFULL
    base = tl.where(full, (n // 64) * (K * 32) + (n % 32), NFULL * (K // 2) + t // 2).to(tl.int64)
    kstride = tl.where(full, 32, (N - NFULL) // 2)
    shift = tl.where(full, ((n % 64) // 32) * 4, (t % 2) * 4)
    return base, kstride, shift


@triton.jit
def _q4_step(qrow, kstride, shift, sptr, nm, k, xv):
    # the rows' dot with xv over the columns k of one scale group (sptr: the rows' (scale, zero) of the group)
    b = tl.load(qrow[:, None] + k[None, :].to(tl.int64) * kstride[:, None], mask=nm[:, None], other=0)
    q = ((b.to(tl.int32) >> shift[:, None]) & 15).to(tl.float32) - 8.0
    s = tl.load(sptr, mask=nm, other=0.0).to(tl.float32)
    z = tl.load(sptr + 1, mask=nm, other=0.0).to(tl.float32)
    w = q * s[:, None] + z[:, None]
    return tl.sum(w * xv[None, :], 1)


@triton.jit
def _q4_mv(x_ptr, sx, slot_ptr, q_ptr, qs, sz_ptr, szs, szg, szn, y_ptr, sy, N, K, NFULL, KDIV, NBLK, DW, DS, DY,
           BN: tl.constexpr, G: tl.constexpr):
    p, slot, held, which, n, y_ptr, nm = _pair(slot_ptr, y_ptr, DY, NBLK, N, BN)
    base, kstride, shift = _q4_rows(n, N, K, NFULL)
    qrow = q_ptr + which * DW + slot * qs + base
    srow = sz_ptr + which * DS + slot * szs + n.to(tl.int64) * szn
    xrow = x_ptr + (p // KDIV) * sx
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(0, K, G):
        k = k0 + tl.arange(0, G)
        xv = tl.load(xrow + k).to(tl.float32)
        acc += _q4_step(qrow, kstride, shift, srow + (k0 // G) * szg, nm, k, xv)
    tl.store(y_ptr + p * sy + n, tl.where(held, acc, 0.0).to(y_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _down_act(gu_ptr, DU, sgu, slot_ptr, wt_ptr, w_ptr, ws, wn, s_ptr, ss, szg, y_ptr, sy, N, K, NFULL, limit,
              BN: tl.constexpr, BK: tl.constexpr, KIND: tl.constexpr, LIMIT: tl.constexpr):
    # pair p's weight_p * down_{slot_p}(act(gate_p, up_p)), BN rows of it: the activation applied as the down matrix
    # reads it, float32 out. KIND 0: float W, 1: q8 (codes, a scale per row), 2: q4 (BK = its scale group; wn = the
    # sz row stride)
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    slot = tl.load(slot_ptr + p).to(tl.int64)
    wt = tl.where(slot >= 0, tl.load(wt_ptr + p), 0.0)      # -1: not held here; its row stays zero
    slot = tl.maximum(slot, 0)
    acc = tl.zeros([BN], tl.float32)
    if KIND == 2:
        base, kstride, shift = _q4_rows(n, N, K, NFULL)
        qrow = w_ptr + slot * ws + base
        srow = s_ptr + slot * ss + n.to(tl.int64) * wn
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            xv = _act(gu_ptr + p * sgu, DU, k, k < K, limit, LIMIT)
            acc += _q4_step(qrow, kstride, shift, srow + (k0 // BK) * szg, nm, k, xv)
    else:
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
def _q4_block_mv(x_ptr, sx, slot_ptr, q_ptr, qs, sz_ptr, szs, szg, szn, y_ptr, sy, ssplit, N, K, KDIV, NBLK, DW,
                 DS, DY, KCH, DU, wt_ptr, limit, G: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr,
                 WEIGHTED: tl.constexpr):
    # N a multiple of 64 (every block full): a program owns one 64-row block, reads each byte once (rows j and
    # j + 32 from its two nibbles) over KCH columns, its split's share of K; a group's G columns of the block are
    # G * 32 contiguous bytes, loaded as a [G, 32] tile (32 bytes of a column along the fast axis: wide loads).
    # ACT: x is a pair's gate and up outputs (up DU elements after), SwiGLU applied as read; WEIGHTED: the result
    # times the pair's routing weight (wt_ptr).
    p, slot, held, which, blk, qblk, j, lo_n = _pair_block(slot_ptr, q_ptr, qs, DW, K, NBLK)
    y_ptr = y_ptr + which * DY + tl.program_id(2) * ssplit
    srow_lo = sz_ptr + which * DS + slot * szs + lo_n.to(tl.int64) * szn
    srow_hi = srow_lo + 32 * szn
    xrow = x_ptr + (p // KDIV) * sx
    acc_lo = tl.zeros([32], tl.float32)
    acc_hi = tl.zeros([32], tl.float32)
    k_lo = tl.program_id(2) * KCH
    for k0 in range(k_lo, k_lo + KCH, G):
        k = k0 + tl.arange(0, G)
        if ACT:
            xv = _act(xrow, DU, k, k < K, limit, LIMIT)
        else:
            xv = tl.load(xrow + k).to(tl.float32)
        b = tl.load(qblk + k[:, None].to(tl.int64) * 32 + j[None, :]).to(tl.int32)
        gi = k0 // G
        s_lo = tl.load(srow_lo + gi * szg).to(tl.float32)
        z_lo = tl.load(srow_lo + gi * szg + 1).to(tl.float32)
        s_hi = tl.load(srow_hi + gi * szg).to(tl.float32)
        z_hi = tl.load(srow_hi + gi * szg + 1).to(tl.float32)
        xs = tl.sum(xv, 0)
        acc_lo += s_lo * tl.sum(((b & 15).to(tl.float32) - 8.0) * xv[:, None], 0) + z_lo * xs
        acc_hi += s_hi * tl.sum(((b >> 4).to(tl.float32) - 8.0) * xv[:, None], 0) + z_hi * xs
    if WEIGHTED:
        wt = tl.load(wt_ptr + p)
        acc_lo, acc_hi = acc_lo * wt, acc_hi * wt
    tl.store(y_ptr + p * sy + lo_n, tl.where(held, acc_lo, 0.0).to(y_ptr.dtype.element_ty))
    tl.store(y_ptr + p * sy + lo_n + 32, tl.where(held, acc_hi, 0.0).to(y_ptr.dtype.element_ty))


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
           bn: int | None = None, bk: int | None = None, warps: int | None = None,
           split: int | None = None) -> torch.Tensor:
    """out[j, p] = W_{ms[j], slots[p]} x[p // kdiv] for one or two matrices ms of the same shape (gate and up),
    every pair p, in one launch; x [rows, K] with unit column stride, out [len(ms), P, N] (contiguous rows).
    Tiles default to the format kind's TILES. split (q4 with N % 64 == 0): the block kernel, K's parts summed in
    float32."""
    N, K = bank.shapes[ms[0]]
    P = slots.numel()
    ps, kind = bank.parts[ms[0]], bank.fmt.kind or bank.fmt.name
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
    elif kind == "q4":
        q, sz = ps["q"], ps["sz"]
        g = K // sz.shape[1]
        if split is None and Q4_BLOCK:
            split = 1
        while split and split > 1 and K % (split * g):
            split //= 2
        if split and N % 64 == 0 and g >= 16:
            nb64 = N // 64
            part = out if split == 1 else torch.empty((split, *out.shape), dtype=torch.float32, device=out.device)
            po = part[0] if split == 1 else part[0, 0]
            _q4_block_mv[(P, nb64 * len(ms), split)](
                x, sx, slots, q, q.stride(0), sz, sz.stride(0), sz.stride(1), sz.stride(2), po, po.stride(0),
                part.stride(0) if split > 1 else 0, N, K, kdiv, nb64, _delta(q, two["q"]), _delta(sz, two["sz"]),
                (part.stride(1) if split > 1 else dy) if len(ms) == 2 else 0, K // split, 0, po, 0.0, G=g,
                ACT=False, LIMIT=False, WEIGHTED=False, num_warps=warps)
            if split > 1:
                torch.sum(part, 0, out=out) if out.dtype == torch.float32 else out.copy_(part.sum(0))
            return out
        _q4_mv[grid](x, sx, slots, q, q.stride(0), sz, sz.stride(0), sz.stride(1), sz.stride(2), o, o.stride(0),
                     N, K, N // 64 * 64, kdiv, nblk, _delta(q, two["q"]), _delta(sz, two["sz"]), dy,
                     BN=bn, G=g, num_warps=warps)
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

# the weighted down launch: rows per program, columns per step (q4: its group), warps
DOWN_TILES = {"float": (8, 256, 4), "q8": (8, 256, 4), "q4": (8, 0, 4)}


def serves(x: torch.Tensor, bank: Bank) -> bool:
    """Whether weighted_pairs computes these rows' pairs (not: records with biases, another activation than SwiGLU,
    mxfp4, float prefill): decided by the rows and the bank alone, so every group of a layer takes the same path."""
    kind = bank.fmt.kind or bank.fmt.name
    return not bank.bias and bank.act is None and kind in DOWN_TILES and (x.shape[0] == 1 or kind != "float")


def weighted_pairs(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, bank: Bank, bn: int | None = None,
                   bk: int | None = None, warps: int | None = None, **tune) -> torch.Tensor:
    """weights[t, k] * expert_{slots[t, k]}(x[t]) per pair, float32 [T, k, h] (-1 pairs zero), in two launches:
    gate and up (matvec), then down with the SwiGLU applied as it reads and the routing weight applied (the
    activation and the weighted sum's operators gone). Exact per pair whatever else is in the call; the caller sums
    over k once every group of the layer is in (moe.routed_groups), so the bits do not depend on the grouping."""
    T, k = slots.shape
    kind = bank.fmt.kind or bank.fmt.name
    kd = bank.fmt.kernel_dtype
    xk = (x if kd is None or x.dtype == kd else x.to(kd)).contiguous()
    flat = slots.reshape(-1).contiguous()
    P = flat.numel()
    N, K = bank.shapes["down"]
    wt = weights.reshape(-1).float().contiguous()
    if kind == "q4" and Q4_TILED and not Q4_BLOCK and q4_tiled.serves(bank):
        return q4_tiled.weighted_pairs(xk, flat, wt, bank, k, _delta, **tune).view(T, k, N)
    inter = bank.shapes["gate"][0]
    gu = torch.empty(2, P, inter, dtype=xk.dtype, device=x.device)
    matvec(("gate", "up"), xk, flat, bank, gu, k, **tune)
    dbn, dbk, dw = DOWN_TILES[kind]
    bn, warps = bn or dbn, warps or dw
    y = torch.empty(P, N, dtype=torch.float32, device=x.device)
    ps = bank.parts["down"]
    lim = bank.limit is not None
    limit = bank.limit if lim else 0.0
    if kind == "q4" and Q4_BLOCK and N % 64 == 0 and K // ps["sz"].shape[1] >= 16:
        q, sz = ps["q"], ps["sz"]
        _q4_block_mv[(P, N // 64, 1)](gu, gu.stride(1), flat, q, q.stride(0), sz, sz.stride(0), sz.stride(1),
                                      sz.stride(2), y, y.stride(0), 0, N, K, 1, N // 64, 0, 0, 0, K, gu.stride(0), wt,
                                      limit, G=K // sz.shape[1], ACT=True, LIMIT=lim, WEIGHTED=True, num_warps=warps)
        return y.view(T, k, N)
    common = dict(BN=bn, KIND={"float": 0, "q8": 1, "q4": 2}[kind], LIMIT=lim, num_warps=warps)
    grid = (P, triton.cdiv(N, bn))
    if kind == "q4":
        q, sz = ps["q"], ps["sz"]
        _down_act[grid](gu, gu.stride(0), gu.stride(1), flat, wt, q, q.stride(0), sz.stride(2), sz, sz.stride(0),
                        sz.stride(1), y, y.stride(0), N, K, N // 64 * 64, limit, BK=K // sz.shape[1], **common)
    else:
        w, s = (ps[""], None) if kind == "float" else (ps["q"], ps["scale"])
        _down_act[grid](gu, gu.stride(0), gu.stride(1), flat, wt, w, w.stride(0), w.stride(1), w if s is None else s,
                        0 if s is None else s.stride(0), 0, y, y.stride(0), N, K, 0, limit, BK=bk or dbk, **common)
    return y.view(T, k, N)


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


for _kind in ("float", "q8", "q4", "mxfp4"):
    register(_kind, "cuda")(pairs)
