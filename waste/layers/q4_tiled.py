"""q4 routed experts for decode rows on a GPU, read coalesced from int4pack's own layout (moe_triton's q4 path).

int4pack stores a matrix in blocks of 64 rows, k down: column k of a full block is 32 contiguous bytes (byte j holds
row j in its low nibble, row j + 32 in its high one), so a block's columns k0 .. k0 + G are G * 32 contiguous bytes.
A program owns one pair, one 64-row block and a share of K (the split): each step loads a [G, 32] byte tile, one scale
group (16 bytes a thread at 4 warps), NG groups a step unrolled, or one group a step with the next one's loads
issued before this one's arithmetic (prefetch); it keeps a [G, 32] float32 accumulator per nibble and sums over k
once at the end (no cross-thread reduction inside the loop).
Splitting K puts enough programs on the chip at decode's 8 pairs (a Qwen3-30B-A3B gate + up launch is 192 blocks
unsplit: 1.5 a multiprocessor, too few loads in flight to reach HBM's rate).

  gate + up  [split, 2, P, inter] float32 partials   (split 1: the bank's dtype [2, P, inter], no partials)
  act        SwiGLU of the partials' sums, each sum rounded to the row dtype first, as a stored gate / up row is
  down       weight_p * down(act), float32, [split, P, h] partials summed by torch when split > 1
Exact per pair at a fixed split whatever else is in the call (moe.py's exactness rule); the split changes the bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (split, groups a step, warps[, prefetch the next step]) for gate + up and for down, shrunk per call to what
# divides K (fit): the fastest of benchmarks/q4_tiles.py's grid on the H200 (docs/LEARNED.md §10g)
GU = (2, 1, 4, 1)
DOWN = (1, 4, 8)


@triton.jit
def _bf16_pair(v):
    # an int32 holding two bf16 (the low half first in memory): both as float32, by their bits
    return (v << 16).to(tl.float32, bitcast=True), ((v >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _pair_block(slot_ptr, q_ptr, qs, DW, K, NBLK):
    """A block program's pair p, the pair's slot (0 where not held), whether this call holds it, which matrix of
    the launch, its 64-row block, the block's first byte, the byte lane j of a column, the block's low rows."""
    p = tl.program_id(0)
    slot = tl.load(slot_ptr + p).to(tl.int64)
    held = slot >= 0                          # -1: this call does not hold the pair's expert; its rows stay zero
    slot = tl.maximum(slot, 0)
    which = tl.program_id(1) // NBLK
    blk = tl.program_id(1) % NBLK
    j = tl.arange(0, 32)
    qblk = q_ptr + which * DW + slot * qs + blk.to(tl.int64) * K * 32
    return p, slot, held, which, blk, qblk, j, blk * 64 + j


@triton.jit
def _fetch(qblk, s_lo, s_hi, xrow, DU, k0, kk, j, G: tl.constexpr, szg, ACT: tl.constexpr):
    # one scale group's operands from column k0: the block's [G, 32] bytes, the rows' (scale, zero) words, x's G
    # values (ACT: gate's and up's)
    k = k0 + kk
    b = tl.load(qblk + k[:, None].to(tl.int64) * 32 + j[None, :])
    gs = (k0 // G) * szg
    xa = tl.load(xrow + k)
    xb = tl.load(xrow + DU + k) if ACT else xa
    return b, tl.load(s_lo + gs), tl.load(s_hi + gs), xa, xb


@triton.jit
def _xv(xa, xb, limit, ACT: tl.constexpr, LIMIT: tl.constexpr):
    # the row the matrix multiplies: x, or SwiGLU of gate (xa) and up (xb), clamped where the bank has a limit
    if ACT:
        g = xa.to(tl.float32)
        u = xb.to(tl.float32)
        if LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        return g * tl.sigmoid(g) * u
    return xa.to(tl.float32)


@triton.jit
def _fma(b, wl, wh, xv, acc_lo, acc_hi):
    # the step's products into the [G, 32] accumulators; a nibble's float by its bits (2^23 + q), not a conversion
    # instruction: exact, and cheaper
    b = b.to(tl.int32)
    sl, zl = _bf16_pair(wl)
    sh, zh = _bf16_pair(wh)
    ql = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    qh = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    acc_lo += (ql * sl[None, :] + zl[None, :]) * xv[:, None]
    acc_hi += (qh * sh[None, :] + zh[None, :]) * xv[:, None]
    return acc_lo, acc_hi


@triton.jit
def _tiled(x_ptr, sx, KDIV, slot_ptr, q_ptr, qs, sz_ptr, szs, szg, y_ptr, sy, ssplit, K, NBLK, DW, DS, DY, KCH,
           DU, wt_ptr, limit, G: tl.constexpr, NG: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr,
           WEIGHTED: tl.constexpr, PREF: tl.constexpr):
    # grid (pair, block of 64 rows x matrix, split). x: pair p's row x[p // KDIV] (ACT: its gate and up outputs, up
    # DU elements after gate, SwiGLU applied as read); sz: int32 words, a (scale, zero) bf16 pair each per (group,
    # row), so a thread's 16 rows' pairs are 64 contiguous bytes (2-byte loads of each half, 64 a thread a group, had
    # cost more than the weights' one 16-byte load); WEIGHTED: times the pair's routing weight. Rows of a -1 pair
    # (not held) are stored zero.
    p, slot, held, which, blk, qblk, j, rows = _pair_block(slot_ptr, q_ptr, qs, DW, K, NBLK)
    kk = tl.arange(0, G)
    s_lo = sz_ptr + which * DS + slot * szs + rows.to(tl.int64)      # a row's (scale, zero) bf16 pair as one int32
    s_hi = s_lo + 32
    xrow = x_ptr + (p // KDIV) * sx
    acc_lo = tl.zeros([G, 32], tl.float32)
    acc_hi = tl.zeros([G, 32], tl.float32)
    k_lo = tl.program_id(2) * KCH
    if PREF:
        # one group a step, the next step's operands loaded before this step's arithmetic (in flight during it; a
        # loop's loads are otherwise issued only when its previous step is done); the last step reloads its own
        nxt = _fetch(qblk, s_lo, s_hi, xrow, DU, k_lo, kk, j, G, szg, ACT)
        for k0 in range(k_lo, k_lo + KCH, G):
            b, wl, wh, xa, xb = nxt
            nxt = _fetch(qblk, s_lo, s_hi, xrow, DU, tl.minimum(k0 + G, k_lo + KCH - G), kk, j, G, szg, ACT)
            acc_lo, acc_hi = _fma(b, wl, wh, _xv(xa, xb, limit, ACT, LIMIT), acc_lo, acc_hi)
    else:
        for k0 in range(k_lo, k_lo + KCH, G * NG):
            for i in tl.static_range(NG):
                b, wl, wh, xa, xb = _fetch(qblk, s_lo, s_hi, xrow, DU, k0 + i * G, kk, j, G, szg, ACT)
                acc_lo, acc_hi = _fma(b, wl, wh, _xv(xa, xb, limit, ACT, LIMIT), acc_lo, acc_hi)
    lo = tl.sum(acc_lo, 0)
    hi = tl.sum(acc_hi, 0)
    if WEIGHTED:
        wt = tl.load(wt_ptr + p)
        lo, hi = lo * wt, hi * wt
    out = y_ptr + which * DY + tl.program_id(2) * ssplit + p * sy + rows
    tl.store(out, tl.where(held, lo, 0.0).to(y_ptr.dtype.element_ty))
    tl.store(out + 32, tl.where(held, hi, 0.0).to(y_ptr.dtype.element_ty))


@triton.jit
def _act_sum(part_ptr, S, ss, DU, sp, a_ptr, sa, N, limit, BLOCK: tl.constexpr, LIMIT: tl.constexpr,
             ROUND: tl.constexpr):
    # SwiGLU of pair p's gate and up rows, each the sum of S float32 partials (gate, then up DU elements after),
    # rounded to bf16 first where the bank's rows are bf16 (ROUND), as the unsplit launch would have stored them
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    g = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for s in range(S):
        g += tl.load(part_ptr + s * ss + p * sp + n, mask=m, other=0.0)
        u += tl.load(part_ptr + s * ss + DU + p * sp + n, mask=m, other=0.0)
    if ROUND:
        g = g.to(tl.bfloat16).to(tl.float32)
        u = u.to(tl.bfloat16).to(tl.float32)
    if LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(a_ptr + p * sa + n, g * tl.sigmoid(g) * u, mask=m)


def fit(K: int, G: int, split: int, ng: int) -> tuple[int, int]:
    """(split, groups a step) no larger than asked with split * groups * G dividing K."""
    groups = K // G
    while groups % ng:
        ng -= 1
    while split > 1 and (groups // ng) % split:
        split -= 1
    return split, ng


def _tile(t: tuple, K: int, G: int) -> tuple[int, int, int, bool]:
    """A tile (split, groups a step, warps[, prefetch]) fitted to K: prefetching steps one group at a time."""
    pref = bool(t[3]) if len(t) > 3 else False
    split, ng = fit(K, G, t[0], 1 if pref else t[1])
    return split, ng, t[2], pref


def serves(bank) -> bool:
    """Full 64-row blocks in every matrix, scale groups of at least 16 columns (16 bytes a thread), (scale, zero)
    pairs adjacent per row."""
    I, H = bank.shapes["gate"]
    return I % 64 == 0 and H % 64 == 0 and all(
        bank.shapes[m][1] // sz.shape[1] >= 16 and sz.stride()[-2:] == (2, 1) and sz.stride(0) % 2 == 0
        and sz.storage_offset() % 2 == 0
        for m, sz in ((m, bank.parts[m]["sz"]) for m in ("gate", "up", "down")))


def _words(sz: torch.Tensor) -> torch.Tensor:
    """[slots, K/g, N, 2] bf16 (scale, zero) pairs as [slots, K/g, N] int32 words."""
    return sz.view(torch.int32)[..., 0]


def _launch(x, sx, kdiv, flat, q, sz, dq, dsz, y, sy, ssplit, dy, N, K, nmat, split, ng, warps, pref, act=False,
            du=0, wt=None, limit=None):
    G = K // sz.shape[1]
    nb = N // 64
    _tiled[(flat.numel(), nb * nmat, split)](
        x, sx, kdiv, flat, q, q.stride(0), sz, sz.stride(0), sz.stride(1), y, sy, ssplit, K, nb, dq, dsz, dy,
        K // split, du, y if wt is None else wt, 0.0 if limit is None else limit, G=G, NG=ng, ACT=act,
        LIMIT=limit is not None, WEIGHTED=wt is not None, PREF=pref, num_warps=warps)


def weighted_pairs(xk: torch.Tensor, flat: torch.Tensor, wt: torch.Tensor, bank, kdiv: int, delta,
                   gu: tuple | None = None, down: tuple | None = None) -> torch.Tensor:
    """moe_triton.weighted_pairs for a q4 bank of full blocks: float32 [P, h], weight_p * expert_p(x[p // kdiv])."""
    P = flat.numel()
    gp, dp = bank.parts["gate"], bank.parts["down"]
    I, H = bank.shapes["gate"]
    G = H // gp["sz"].shape[1]
    s1, n1, w1, p1 = _tile(gu or GU, H, G)
    gz, dz = _words(gp["sz"]), _words(dp["sz"])
    dq, dsz = delta(gp["q"], bank.parts["up"]["q"]), delta(gz, _words(bank.parts["up"]["sz"]))
    lim = bank.limit
    if s1 == 1:       # no partials: gate and up rows in the row dtype, SwiGLU applied as the down launch reads them
        a = torch.empty(2, P, I, dtype=xk.dtype, device=xk.device)
        _launch(xk, xk.stride(0), kdiv, flat, gp["q"], gz, dq, dsz, a, a.stride(1), 0, a.stride(0), I, H, 2,
                1, n1, w1, p1)
        act = dict(act=True, du=a.stride(0), limit=lim)
    else:
        part = torch.empty(s1, 2, P, I, dtype=torch.float32, device=xk.device)
        _launch(xk, xk.stride(0), kdiv, flat, gp["q"], gz, dq, dsz, part, part.stride(2), part.stride(0),
                part.stride(1), I, H, 2, s1, n1, w1, p1)
        a = torch.empty(P, I, dtype=torch.float32, device=xk.device)
        _act_sum[(P, triton.cdiv(I, 1024))](part, s1, part.stride(0), part.stride(1), part.stride(2), a, a.stride(0),
                                            I, 0.0 if lim is None else lim, BLOCK=1024, LIMIT=lim is not None,
                                            ROUND=xk.dtype == torch.bfloat16, num_warps=4)
        act = dict(act=False)
    dG = I // dp["sz"].shape[1]
    s2, n2, w2, p2 = _tile(down or DOWN, I, dG)
    y = torch.empty(s2, P, H, dtype=torch.float32, device=xk.device)
    _launch(a, a.stride(-2), 1, flat, dp["q"], dz, 0, 0, y, y.stride(1), y.stride(0), 0, H, I, 1, s2, n2, w2, p2,
            wt=wt, **act)
    return y[0] if s2 == 1 else y.sum(0)
