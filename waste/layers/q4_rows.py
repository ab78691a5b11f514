"""q4 routed experts on a GPU, read in place from the row layout the GPU slab holds (moe_triton's q4 path).

A record reaches GPU memory in int4pack's stored layout and is rewritten there, once per fill of a GPU slot, into
rows (`device_layout`, quant/int4pack.to_rows): row n's K/2 bytes in order, each scale group's g/2 bytes holding its
first g/2 columns in the low nibbles and its last g/2 in the high ones. A program owns BN rows of one pair and walks
K NG groups a step: each step loads a [BN, NG, g/2] byte tile (a thread's 16 contiguous bytes are 32 columns of one
row under one (scale, zero) pair), the groups' two halves of x and the rows' (scale, zero) words, and sums each group
inside the tile, so a thread keeps one accumulator per row. (int4pack's blocks put 32 rows in a thread's 16 bytes, and
with them 32 rows' scales: the registers that kept q4_tiled latency-bound, docs/LEARNED.md §10g.)

  gate_up_act  SwiGLU(gate x, up x) of BN rows of one pair, both matrices in one program: float32 [P, inter]
  down         weight_p * down(act_p) of BN rows of one pair, float32 [P, h] (moe_triton.sum_pairs sums a row's)
  mv           W x for one or two matrices of a launch (prefill pairs; moe_triton.pairs applies the activation)
Exact per pair at a fixed tile whatever else is in the call (moe.py's exactness rule).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.int4pack import to_rows

# (rows a program, groups a step, warps) per launch: the fastest of benchmarks/q4_tiles.py's grid on the H200
# (docs/LEARNED.md §10j)
GATE_UP = (8, 8, 4)
DOWN = (8, 4, 2)
CHUNK = 64            # records rewritten per batch of device_layout (its scratch: 2x their nibbles' bytes)


@triton.jit
def _bf16_pair(v):
    # an int32 holding two bf16 (the low half first in memory): both as float32, by their bits
    return (v << 16).to(tl.float32, bitcast=True), ((v >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _dot(qrow, xrow, szrow, n, nm, g0, KG, szg, KB, GH: tl.constexpr, NG: tl.constexpr):
    # rows n (mask nm) of one matrix times x over the NG scale groups from g0: float32 [BN]. A nibble's float by its
    # bits (2^23 + q, less 2^23 + 8: q - 8 exactly) instead of a conversion instruction
    gs = g0 + tl.arange(0, NG)
    gm = gs < KG
    i = tl.arange(0, GH)
    col = gs[None, :, None] * GH + i[None, None, :]
    b = tl.load(qrow + n[:, None, None].to(tl.int64) * KB + col, mask=nm[:, None, None] & gm[None, :, None],
                other=0).to(tl.int32)
    xo = gs[:, None] * (2 * GH) + i[None, :]
    xl = tl.load(xrow + xo, mask=gm[:, None], other=0.0).to(tl.float32)
    xh = tl.load(xrow + xo + GH, mask=gm[:, None], other=0.0).to(tl.float32)
    ql = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    qh = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    d = tl.sum(ql * xl[None, :, :] + qh * xh[None, :, :], 2)               # [BN, NG]: sum of (q - 8) x a group
    xs = tl.sum(xl + xh, 1)                                                   # [NG]: sum of x a group
    w = tl.load(szrow + gs[None, :].to(tl.int64) * szg + n[:, None], mask=nm[:, None] & gm[None, :], other=0)
    s, z = _bf16_pair(w)
    return tl.sum(d * s + z * xs[None, :], 1)


@triton.jit
def _swiglu(g, u, held, limit, LIMIT: tl.constexpr, ROUND: tl.constexpr):
    # SwiGLU of a pair's gate and up rows, each rounded to bf16 first where the rows are (ROUND), as a stored gate /
    # up row is, clamped where the bank has a limit; zero where the call does not hold the pair
    if ROUND:
        g = g.to(tl.bfloat16).to(tl.float32)
        u = u.to(tl.bfloat16).to(tl.float32)
    if LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return tl.where(held, g * tl.sigmoid(g) * u, 0.0)


@triton.jit
def _held(slot_ptr, p):
    # a pair's slot (0 where not held) and whether this call holds it (-1: another group of the layer computes it)
    slot = tl.load(slot_ptr + p).to(tl.int64)
    return tl.maximum(slot, 0), slot >= 0


@triton.jit
def _gate_up_act(x_ptr, sx, KDIV, slot_ptr, q_ptr, qs, DQ, sz_ptr, szs, szg, DS, a_ptr, sa, N, KB, KG, limit,
                 BN: tl.constexpr, NG: tl.constexpr, GH: tl.constexpr, LIMIT: tl.constexpr, ROUND: tl.constexpr):
    # pair p's SwiGLU(gate x, up x) of rows n, x = x[p // KDIV]; up DQ bytes (DS words of sz) after gate; each row
    # rounded to bf16 first where the rows are (ROUND), as a stored gate / up row is; -1 pairs stored zero
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    slot, held = _held(slot_ptr, p)
    xrow = x_ptr + (p // KDIV) * sx
    qg = q_ptr + slot * qs
    sg = sz_ptr + slot * szs
    g = tl.zeros([BN], tl.float32)
    u = tl.zeros([BN], tl.float32)
    for g0 in range(0, KG, NG):
        g += _dot(qg, xrow, sg, n, nm, g0, KG, szg, KB, GH, NG)
        u += _dot(qg + DQ, xrow, sg + DS, n, nm, g0, KG, szg, KB, GH, NG)
    tl.store(a_ptr + p * sa + n, _swiglu(g, u, held, limit, LIMIT, ROUND), mask=nm)


@triton.jit
def _down(a_ptr, sa, slot_ptr, wt_ptr, q_ptr, qs, sz_ptr, szs, szg, y_ptr, sy, N, KB, KG,
          BN: tl.constexpr, NG: tl.constexpr, GH: tl.constexpr):
    # pair p's weight_p * down_p(act_p) of rows n, float32; a -1 pair stored zero
    p = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < N
    slot, held = _held(slot_ptr, p)
    arow = a_ptr + p * sa
    qd = q_ptr + slot * qs
    sd = sz_ptr + slot * szs
    d = tl.zeros([BN], tl.float32)
    for g0 in range(0, KG, NG):
        d += _dot(qd, arow, sd, n, nm, g0, KG, szg, KB, GH, NG)
    tl.store(y_ptr + p * sy + n, tl.where(held, tl.load(wt_ptr + p) * d, 0.0), mask=nm)


@triton.jit
def _mv(x_ptr, sx, KDIV, slot_ptr, q_ptr, qs, DQ, sz_ptr, szs, szg, DS, y_ptr, sy, DY, N, KB, KG, NBLK,
        BN: tl.constexpr, NG: tl.constexpr, GH: tl.constexpr):
    # y[which, p, n] = W_{which, slot_p} x[p // KDIV] for the launch's one or two matrices; -1 pairs stored zero
    p = tl.program_id(0)
    which = tl.program_id(1) // NBLK
    n = (tl.program_id(1) % NBLK) * BN + tl.arange(0, BN)
    nm = n < N
    slot, held = _held(slot_ptr, p)
    xrow = x_ptr + (p // KDIV) * sx
    qm = q_ptr + which * DQ + slot * qs
    sm = sz_ptr + which * DS + slot * szs
    acc = tl.zeros([BN], tl.float32)
    for g0 in range(0, KG, NG):
        acc += _dot(qm, xrow, sm, n, nm, g0, KG, szg, KB, GH, NG)
    tl.store(y_ptr + which * DY + p * sy + n, tl.where(held, acc, 0.0).to(y_ptr.dtype.element_ty), mask=nm)


def _words(sz: torch.Tensor) -> torch.Tensor:
    """[slots, K/g, N, 2] bf16 (scale, zero) pairs as [slots, K/g, N] int32 words."""
    return sz.view(torch.int32)[..., 0]


def _matrix(bank, m: str):
    """A matrix's nibbles [slots, N, K/2], (scale, zero) words [slots, K/g, N], its shape and half-group."""
    ps = bank.parts[m]
    N, K = bank.shapes[m]
    sz = _words(ps["sz"])
    return ps["q"], sz, N, K, K // ps["sz"].shape[1] // 2


def serves(bank) -> bool:
    """Even scale groups whose halves are whole bytes, (scale, zero) pairs adjacent per row."""
    return all(bank.shapes[m][1] // bank.parts[m]["sz"].shape[1] >= 2 and bank.parts[m]["sz"].stride()[-2:] == (2, 1)
               and bank.parts[m]["sz"].stride(0) % 2 == 0 and bank.parts[m]["sz"].storage_offset() % 2 == 0
               for m in ("gate", "up", "down"))


def _ng(KG: int, ng: int) -> int:
    """Groups a step: a power of two, at most ng and no more than K's groups need (the last step's extra masked)."""
    return min(1 << (max(ng, 1).bit_length() - 1), triton.next_power_of_2(KG))


def gate_up_act(xk, kdiv: int, flat, bank, delta, tile=None) -> torch.Tensor:
    """Every pair's SwiGLU(gate x, up x) (clamped where the bank has a limit), float32 [P, inter]."""
    bn, ng, warps = tile or GATE_UP
    q, sz, N, K, gh = _matrix(bank, "gate")
    uq, usz = bank.parts["up"]["q"], _words(bank.parts["up"]["sz"])
    KG = sz.shape[1]
    a = torch.empty(flat.numel(), N, dtype=torch.float32, device=xk.device)
    lim = bank.limit
    _gate_up_act[(flat.numel(), triton.cdiv(N, bn))](
        xk, xk.stride(0), kdiv, flat, q, q.stride(0), delta(q, uq), sz, sz.stride(0), sz.stride(1), delta(sz, usz),
        a, a.stride(0), N, K // 2, KG, 0.0 if lim is None else lim, BN=bn, NG=_ng(KG, ng), GH=gh,
        LIMIT=lim is not None, ROUND=xk.dtype == torch.bfloat16, num_warps=warps)
    return a


def down(a, flat, wt, bank, tile=None) -> torch.Tensor:
    """Every pair's weight_p * down_p(a_p), float32 [P, h]."""
    bn, ng, warps = tile or DOWN
    q, sz, N, K, gh = _matrix(bank, "down")
    KG = sz.shape[1]
    y = torch.empty(flat.numel(), N, dtype=torch.float32, device=a.device)
    _down[(flat.numel(), triton.cdiv(N, bn))](a, a.stride(0), flat, wt, q, q.stride(0), sz, sz.stride(0),
                                              sz.stride(1), y, y.stride(0), N, K // 2, KG, BN=bn, NG=_ng(KG, ng),
                                              GH=gh, num_warps=warps)
    return y


def matvec(ms, x, kdiv: int, flat, bank, out, delta, tile=None) -> torch.Tensor:
    """out[j, p] = W_{ms[j], slot_p} x[p // kdiv] for one or two matrices of the same shape, every pair p."""
    bn, ng, warps = tile or GATE_UP
    q, sz, N, K, gh = _matrix(bank, ms[0])
    KG = sz.shape[1]
    two = len(ms) == 2
    dq = delta(q, bank.parts[ms[1]]["q"]) if two else 0
    ds = delta(sz, _words(bank.parts[ms[1]]["sz"])) if two else 0
    nblk = triton.cdiv(N, bn)
    o = out[0]
    _mv[(flat.numel(), nblk * len(ms))](x, x.stride(0), kdiv, flat, q, q.stride(0), dq, sz, sz.stride(0),
                                        sz.stride(1), ds, o, o.stride(0), out.stride(0) if two else 0, N, K // 2, KG,
                                        nblk, BN=bn, NG=_ng(KG, ng), GH=gh, num_warps=warps)
    return out


GRAPHED = 4           # a rewrite of at most this many records replays a CUDA graph (a decode layer's misses)


def device_layout(layout, fmt):
    """The rewrite of a q4 record's nibbles into rows, in place in a slab on the GPU: fn(rows [slots, record_bytes]
    uint8, slot ids) for the expert store to call once a record's bytes have landed in a GPU slot. On a GPU a batch
    of at most GRAPHED records replays a graph of the rewrite over slot ids in GPU memory, captured once per slab and
    count: with ~45 torch operators a batch, a streamed decode's flush took 0.25-0.35 ms a call (mean) on the H200's
    host, 0.13 ms with the graph (LEARNED §10n)."""
    groups = {p.name.partition(".")[0]: p.shape[0] for p in layout.parts if p.name.endswith(".sz")}
    qparts = [(p.offset, p.nbytes, p.shape, groups[p.name.partition(".")[0]]) for p in layout.parts
              if p.name.endswith(".q")]
    graphs: dict = {}       # (slab address, slots, count) -> (slot ids on the GPU, graph)

    def body(rows: torch.Tensor, sl: torch.Tensor) -> None:
        for off, nb, (N, KB), kg in qparts:
            v = rows[sl, off:off + nb].view(sl.numel(), N, KB)
            rows[sl, off:off + nb] = to_rows(v, N, 2 * KB, 2 * KB // kg).view(sl.numel(), nb)

    def graphed(rows: torch.Tensor, n: int):
        key = (rows.data_ptr(), rows.shape[0], n)
        g = graphs.get(key)
        if g is None:
            # plain torch operators (no library handles to warm up): captured without running, so no live record
            # is touched; the slot ids are the graph's input
            with torch.inference_mode(False):    # a normal tensor: written in place under inference mode or not
                sl = torch.zeros(n, dtype=torch.long, device=rows.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(rows.device), capture_error_mode="thread_local"):
                body(rows, sl)
            g = graphs[key] = (sl, graph)
        return g

    def rewrite(rows: torch.Tensor, slots) -> None:
        # (the ids staged without a host wait for the launches queued before: _to_device's note in runtime/cache.py)
        idx = torch.as_tensor(slots, dtype=torch.long).reshape(-1).to(rows.device, non_blocking=True)
        if rows.device.type == "cuda" and 0 < idx.numel() <= GRAPHED and not torch.cuda.is_current_stream_capturing():
            sl, graph = graphed(rows, idx.numel())
            sl.copy_(idx)
            graph.replay()
            return
        for c in range(0, idx.numel(), CHUNK):
            body(rows, idx[c:c + CHUNK])
    return rewrite
