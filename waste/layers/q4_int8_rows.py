"""q4 decode rows on a GPU with int8 activations: the CPU's decode arithmetic (quant/q4_int8.py) on the GPU slab's
row layout (layers/q4_rows.py), four nibbles by four int8 values in one `dp4a`.

q4_rows' float kernels spend about ten instructions a nibble byte (widen, mask, or, subtract, multiply-add, twice)
and reach a quarter of HBM's rate (docs/LEARNED.md §10j). Here a row's x is rounded to int8 once per scale group
(`quantize`: scale max|x| / 127, as quantize_row on the CPU, so the integers are the CPU's), and a thread turns a
32-bit word of nibbles into two words of four bytes (low and high nibbles: one and two instructions) and multiplies
each by a word of x in one dp4a: about 1.3 instructions a nibble byte. A group's integer sum q.xq then takes the
CPU's float32 epilogue: s (d sum(q xq) - 8 d sum(xq)) + z sum(x).

  quantize     rows [R, K] -> int8 words [R, K/4] and (d, 8 d sum(xq), sum(x)) [R, 3, K/g] float32: one launch
  gate_up_act  SwiGLU(gate x, up x) of a pair's rows from x's words: float32 [P, inter], and (the pair's last
               program to finish) the activation's words for down
  down         weight_p * down_p(act_p) from the activation's words: float32 [P, h]; or (total) the pairs summed
               by the last program of each block of rows, one launch fewer (moe_triton.sum_pairs')
Exact per pair at a fixed tile whatever else is in the call (moe.py's exactness rule); rows off a GPU (triton's
interpreter, which has no inline assembly) take the same integer sum byte by byte.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_launch import Fast, pdl, pdl_begin, pdl_wait, spec_key
from .decode_triton import counts
from .q4_rows import _bf16_pair, _held, _matrix, _swiglu
from .q4_rows import _words as _sz_words

ENABLED = True              # benchmarks switch it off to time q4_rows' float kernels in the same process
GATE_UP = (4, 16, 2)        # (rows a program, groups a step, warps): benchmarks/q4_tiles.py on the H200 (§10k)
DOWN = (16, 16, 2)
QUANT_GROUPS = 4            # scale groups a program of `quantize`


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    # c + the dot of a's and b's four signed bytes
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        s = c
        for i in tl.static_range(4):
            s += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return s


@triton.jit
def _quant_groups(x_row, w_row, sc_row, gs, gm, G, G4: tl.constexpr, CM: tl.constexpr):
    # a row's groups gs (mask gm): q = rint(x / (max|x| / 127)) packed four to a word; d, 8 d sum(q), sum(x). CM:
    # the loads' cache modifier (".cg" where other programs wrote the row: past the multiprocessor's own cache)
    wi = tl.arange(0, G4)
    b = tl.arange(0, 4)
    col = (gs[:, None, None] * G4 + wi[None, :, None]) * 4 + b[None, None, :]
    x = tl.load(x_row + col, mask=gm[:, None, None], other=0.0, cache_modifier=CM).to(tl.float32)
    m = tl.max(tl.max(tl.abs(x), 2), 1)
    d = tl.div_rn(m, 127.0)
    inv = tl.where(m > 0, tl.div_rn(1.0, d), 0.0)
    v = x * inv[:, None, None]
    q = ((v + 12582912.0) - 12582912.0).to(tl.int32)          # round half to even (|v| <= 127): np.rint's
    tl.store(w_row + gs[:, None] * G4 + wi[None, :], tl.sum((q & 255) << (8 * b[None, None, :]), 2),
             mask=gm[:, None])
    tl.store(sc_row + gs, d, mask=gm)
    tl.store(sc_row + G + gs, d * (8 * tl.sum(tl.sum(q, 2), 1)).to(tl.float32), mask=gm)
    tl.store(sc_row + 2 * G + gs, tl.sum(tl.sum(x, 2), 1), mask=gm)


@triton.jit
def _quantize(x_ptr, sx, w_ptr, sw, sc_ptr, ss, G, GB: tl.constexpr, G4: tl.constexpr, PDL: tl.constexpr):
    # row r's groups [GB j, GB j + GB)
    pdl_begin(PDL)
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    gs = tl.program_id(1) * GB + tl.arange(0, GB)
    _quant_groups(x_ptr + r * sx, w_ptr + r * sw, sc_ptr + r * ss, gs, gs < G, G, G4, "")


@triton.jit
def _dot(qrow, xw, sc, szrow, n, nm, g0, KG, szg, KW, GW: tl.constexpr, NG: tl.constexpr, ASM: tl.constexpr):
    # rows n (mask nm) of one matrix times x's words over the NG scale groups from g0: float32 [BN]. A row's group
    # is GW words (its low nibbles x's first GW words of the group, its high nibbles the next GW)
    gs = g0 + tl.arange(0, NG)
    gm = gs < KG
    i = tl.arange(0, GW)
    w = tl.load(qrow + n[:, None, None].to(tl.int64) * KW + gs[None, :, None] * GW + i[None, None, :],
                mask=nm[:, None, None] & gm[None, :, None], other=0)
    xo = gs[:, None] * (2 * GW) + i[None, :]
    xl = tl.broadcast_to(tl.load(xw + xo, mask=gm[:, None], other=0)[None, :, :], w.shape)
    xh = tl.broadcast_to(tl.load(xw + xo + GW, mask=gm[:, None], other=0)[None, :, :], w.shape)
    acc = _dp4a((w >> 4) & 0x0F0F0F0F, xh, _dp4a(w & 0x0F0F0F0F, xl, tl.zeros_like(w), ASM), ASM)
    t = tl.load(sc + gs, mask=gm, other=0.0)[None, :] * tl.sum(acc, 2).to(tl.float32) - \
        tl.load(sc + KG + gs, mask=gm, other=0.0)[None, :]
    s, z = _bf16_pair(tl.load(szrow + gs[None, :].to(tl.int64) * szg + n[:, None], mask=nm[:, None] & gm[None, :],
                              other=0))
    return tl.sum(s * t + z * tl.load(sc + 2 * KG + gs, mask=gm, other=0.0)[None, :], 1)


@triton.jit
def _gate_up_act(xw_ptr, sxw, sc_ptr, ssc, KDIV, slot_ptr, q_ptr, qs, DQ, sz_ptr, szs, szg, DS, a_ptr, sa, N, KW, KG,
                 limit, cnt_ptr, aw_ptr, saw, asc_ptr, sasc, AG, BN: tl.constexpr, NG: tl.constexpr,
                 GW: tl.constexpr, LIMIT: tl.constexpr, ROUND: tl.constexpr, ASM: tl.constexpr, AGP: tl.constexpr,
                 AG4: tl.constexpr, PDL: tl.constexpr):
    # pair p's SwiGLU(gate x, up x) of rows n, x = row p // KDIV's words; up DQ words (DS sz words) after gate; each
    # row rounded to bf16 first where the rows are (ROUND), as a stored gate / up row is; -1 pairs stored zero. The
    # pair's last program to finish (counted in cnt_ptr[p]) rounds the pair's whole row to int8 for the down launch
    # (AG groups of 4 AG4), which saves that launch
    pdl_begin(PDL)
    pdl_wait(PDL)                       # the slots and x are the kernels' before: nothing to read ahead of them
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    slot, held = _held(slot_ptr, p)
    xw = xw_ptr + (p // KDIV) * sxw
    sc = sc_ptr + (p // KDIV) * ssc
    qg = q_ptr + slot * qs
    sg = sz_ptr + slot * szs
    g = tl.zeros([BN], tl.float32)
    u = tl.zeros([BN], tl.float32)
    for g0 in range(0, KG, NG):
        g += _dot(qg, xw, sc, sg, n, nm, g0, KG, szg, KW, GW, NG, ASM)
        u += _dot(qg + DQ, xw, sc, sg + DS, n, nm, g0, KG, szg, KW, GW, NG, ASM)
    tl.store(a_ptr + p * sa + n, _swiglu(g, u, held, limit, LIMIT, ROUND), mask=nm)
    tl.debug_barrier()                  # every thread's rows stored before the count says so
    if tl.atomic_add(cnt_ptr + p, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        tl.store(cnt_ptr + p, 0)
        ag = tl.arange(0, AGP)
        _quant_groups(a_ptr + p * sa, aw_ptr + p * saw, asc_ptr + p * sasc, ag, ag < AG, AG, AG4, ".cg")


@triton.jit
def _down(aw_ptr, saw, sc_ptr, ssc, slot_ptr, wt_ptr, q_ptr, qs, sz_ptr, szs, szg, y_ptr, sy, N, KW, KG, cnt_ptr,
          o_ptr, BN: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr, ASM: tl.constexpr, SUM: tl.constexpr,
          PDL: tl.constexpr):
    # pair p's weight_p * down_p(act_p) of rows n, float32, from act_p's words; a -1 pair stored zero. SUM: the
    # last program of rows n to finish (counted in cnt_ptr) adds every pair's rows in order (moe_triton.sum_pairs'
    # arithmetic) and stores the sum in o_ptr's dtype, which saves that launch
    pdl_begin(PDL)
    pdl_wait(PDL)
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    slot, held = _held(slot_ptr, p)
    d = tl.zeros([BN], tl.float32)
    for g0 in range(0, KG, NG):
        d += _dot(q_ptr + slot * qs, aw_ptr + p * saw, sc_ptr + p * ssc, sz_ptr + slot * szs, n, nm, g0, KG, szg, KW,
                  GW, NG, ASM)
    tl.store(y_ptr + p * sy + n, tl.where(held, tl.load(wt_ptr + p) * d, 0.0), mask=nm)
    if SUM:
        b = tl.program_id(1)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.store(cnt_ptr + b, 0)
            acc = tl.zeros([BN], tl.float32)
            for j in range(tl.num_programs(0)):
                acc += tl.load(y_ptr + j * sy + n, mask=nm, other=0.0, cache_modifier=".cg")
            tl.store(o_ptr + n, acc.to(o_ptr.dtype.element_ty), mask=nm)


def _ng(KG: int, ng: int) -> int:
    return min(1 << (max(ng, 1).bit_length() - 1), triton.next_power_of_2(KG))


def _words(q: torch.Tensor) -> torch.Tensor:
    """A matrix's nibbles [slots, N, K/2] uint8 as int32 words [slots, N, K/8]."""
    return q.view(torch.int32)


def serves(bank) -> bool:
    """ENABLED, groups of whole words of both halves (g a multiple of 8, at least 32), nibbles viewable as words."""
    if not ENABLED:
        return False
    for m in ("gate", "up", "down"):
        N, K = bank.shapes[m]
        q, g = bank.parts[m]["q"], K // bank.parts[m]["sz"].shape[1]
        if g % 8 or g < 32 or q.stride(-1) != 1 or q.storage_offset() % 4 or any(s % 4 for s in q.stride()[:-1]):
            return False
    return True


# launched past triton's JIT (triton_launch.Fast): a VRAM or disk tier's layers run these eagerly; the keys name
# every argument (spec_key), so they determine each one's specialization
_QUANTIZE, _GATE_UP, _DOWN = Fast(_quantize), Fast(_gate_up_act), Fast(_down)


def quantize(x: torch.Tensor, g: int):
    """Rows [R, K] (K a multiple of g, g of 4) -> (int8 words int32 [R, K/4], float32 [R, 3, K/g]: each group's d,
    8 d sum(xq) and sum(x)), quant/q4_int8.quantize_row's rounding."""
    R, K = x.shape
    x = x.contiguous()
    G = K // g
    w = torch.empty(R, K // 4, dtype=torch.int32, device=x.device)
    sc = torch.empty(R, 3, G, dtype=torch.float32, device=x.device)
    gb = min(QUANT_GROUPS, triton.next_power_of_2(G))
    dep = pdl(x)
    args = (x, x.stride(0), w, w.stride(0), sc, sc.stride(0), G, gb, g // 4, dep)
    _QUANTIZE(spec_key(args), (R, triton.cdiv(G, gb)), *args, num_warps=4,
              enable_fp_fusion=False, launch_pdl=dep)     # x / d rounded before the rint
    return w, sc


def gate_up_act(xk, kdiv: int, flat, bank, delta, tile=None):
    """Every pair's SwiGLU(gate x, up x) (clamped where the bank has a limit), float32 [P, inter], and its rows
    rounded to int8 for the down launch (quantize's words and scales)."""
    bn, ng, warps = tile or GATE_UP
    q, sz, N, K, gh = _matrix(bank, "gate")
    qw, uw = _words(q), _words(bank.parts["up"]["q"])
    KG = sz.shape[1]
    xw, sc = quantize(xk, 2 * gh)
    P = flat.numel()
    a = torch.empty(P, N, dtype=torch.float32, device=xk.device)
    g = bank.shapes["down"][1] // bank.parts["down"]["sz"].shape[1]      # the down matrix's group
    aw = torch.empty(P, N // 4, dtype=torch.int32, device=xk.device)
    asc = torch.empty(P, 3, N // g, dtype=torch.float32, device=xk.device)
    lim, dep = bank.limit, pdl(xk)
    args = (xw, xw.stride(0), sc, sc.stride(0), kdiv, flat, qw, qw.stride(0), delta(qw, uw), sz, sz.stride(0),
            sz.stride(1), delta(sz, _sz_words(bank.parts["up"]["sz"])), a, a.stride(0), N, K // 8, KG,
            0.0 if lim is None else lim, counts(xk.device, P, "q4_int8_rows.gate_up"), aw, aw.stride(0), asc,
            asc.stride(0), N // g, bn, _ng(KG, ng), gh // 4, lim is not None, xk.dtype == torch.bfloat16, xk.is_cuda,
            triton.next_power_of_2(N // g), g // 4, dep)
    _GATE_UP(spec_key(args, warps), (P, triton.cdiv(N, bn)), *args, num_warps=warps,
             enable_fp_fusion=False,     # the rounding's x / d before its rint, as quantize's
             launch_pdl=dep)
    return a, (aw, asc)


def down(a, flat, wt, bank, tile=None, total: torch.dtype | None = None) -> torch.Tensor:
    """Every pair's weight_p * down_p(a_p) from gate_up_act's (activation, its int8 rows): float32 [P, h]; total: the
    pairs summed in order in one row [1, h] of that dtype instead (one decode row's pairs, moe_triton.sum_pairs)."""
    a, (aw, asc) = a
    bn, ng, warps = tile or DOWN
    q, sz, N, K, gh = _matrix(bank, "down")
    qw = _words(q)
    KG = sz.shape[1]
    P = flat.numel()
    y = torch.empty(P, N, dtype=torch.float32, device=a.device)
    nblk = triton.cdiv(N, bn)
    out = y if total is None else torch.empty(1, N, dtype=total, device=a.device)
    dep = pdl(a)
    args = (aw, aw.stride(0), asc, asc.stride(0), flat, wt, qw, qw.stride(0), sz, sz.stride(0), sz.stride(1), y,
            y.stride(0), N, K // 8, KG, counts(a.device, nblk, "q4_int8_rows.down"), out, bn, _ng(KG, ng), gh // 4,
            a.is_cuda, total is not None, dep)
    _DOWN(spec_key(args, warps), (P, nblk), *args, num_warps=warps, launch_pdl=dep)
    return out
