"""The routed experts of a prefill chunk on the CPU: every (row, expert) pair of a MoE layer in one numba call over q4
records where they sit in the slab.

Through torch, a chunk's pairs were grouped by expert in Python and each expert's rows went through torch's int4
kernel matrix by matrix (layers/moe.py `segments`: 296 kernel calls of ~26 us in a 128-token prefill of the bundled
model, docs/LEARNED.md §10c). Here the pairs are sorted by slot inside the kernel, and each 64-row block of an
expert's matrix is dequantized once (quant/q4_rows.py) and applied to every row routed to that expert; the tasks
(expert, block, up to RB rows) are spread over torch's thread count, gate and up first, the SwiGLU, then down.
`pairs_q4_i8` is the same plan with every input rounded to int8 and full blocks multiplied by VNNI
(quant/q4_vnni.py): the kernel for records above q4_vnni.MIN_WEIGHTS on a host with VNNI (§10f).

Bits: q4_rows computes each row alone in one written order (explicit fma, no fast-math), and the VNNI rows are
exact integer sums with the decode row's epilogue, so a pair's output is the same whatever thread runs it, whatever
rows share its expert, and in whichever group of a budget-limited layer its expert lands (the VNNI pairs: the
decode row's bits too). Pairs whose slot is -1 are left zero (layers/moe.py's contract).
"""
from __future__ import annotations

import numba
import numpy as np
import torch

from ..numba_ptr import at, follow_torch_threads
from ..quant.int4pack import BLOCK
from ..quant.q4_int8 import quantize_rows
from ..quant.q4_numba import i8_blocks, q4_block
from ..quant import q4_vnni
from ..quant.q4_rows import block_rows
from ..quant.q4_vnni import QUAD, block_rows_i8
from .cpu_kernels import act
from .moe_cpu import _flat

RB = 32           # rows per task: an expert with more rows is split (the tile is dequantized once per task)
# without VNNI, records whose matrices have more weights than this stay on torch's int4 kernel, expert by expert: at
# the 30B shape (768 x 2048) that measured faster (LEARNED §10c: 608 ms a 128-token prefill against 832 through here),
# at the bundled model's (96 x 320) this call is (18.1 ms against 20.8)
MAX_WEIGHTS = 1 << 18


@numba.njit(inline="always")
def _task(q, qo, sz, zo, G, N, K, b, X, xs, r0, r1, Y, ys):
    """Rows r0..r1 of the list xs (X's rows) through block b of one q4 matrix into Y's rows ys[r0..r1]."""
    nr = r1 - r0
    xi = np.empty((nr + 3) // 4 * 4, np.int64)
    for i in range(xi.shape[0]):
        xi[i] = xs[min(r0 + i, r1 - 1)]
    yi = ys[r0:r1]
    w = np.empty((K // G, BLOCK), np.float32)
    s, z = np.empty(BLOCK, np.float32), np.empty(BLOCK, np.float32)
    accs = np.empty((xi.shape[0], BLOCK), np.float32)
    block_rows(q, qo, sz[zo:zo + G * N * 2], G, N, K, b, X, xi, nr, Y, yi, w, s, z, accs)


@numba.njit
def _plan(slots, T, k, nth):
    """The pairs sorted by slot (pair order within a slot) and tasks (slot, first sorted pair, last) of at most RB
    pairs, dealt over nth threads: (order, each sorted pair's token row, tasks)."""
    nsl = 0
    for p in range(T * k):
        nsl = max(nsl, slots[p] + 1)
    start = np.zeros(nsl + 1, np.int64)
    for p in range(T * k):
        if slots[p] >= 0:
            start[slots[p] + 1] += 1
    for s in range(nsl):
        start[s + 1] += start[s]
    P = start[nsl]
    order, fill = np.empty(P, np.int64), start[:nsl].copy()
    for p in range(T * k):                       # pairs sorted by slot, in pair order within a slot
        s = slots[p]
        if s >= 0:
            order[fill[s]] = p
            fill[s] += 1
    rows = order // k                            # each sorted pair's token row
    # tasks: (slot, first sorted pair, last) in runs of at most RB pairs
    nt = 0
    for s in range(nsl):
        nt += (start[s + 1] - start[s] + RB - 1) // RB
    tasks = np.empty((nt, 3), np.int64)
    t = 0
    for s in range(nsl):
        for a in range(start[s], start[s + 1], RB):
            tasks[t, 0], tasks[t, 1], tasks[t, 2] = s, a, min(a + RB, start[s + 1])
            t += 1
    # the threads take contiguous equal runs of the iterations (numba's static schedule): deal the tasks, largest
    # first, round-robin into as many runs as threads, so each thread gets a like share of large and small ones
    big = np.argsort(-(tasks[:, 2] - tasks[:, 1]), kind="mergesort")
    dealt, j = np.empty(nt, np.int64), 0
    for t in range(nth):
        for i in range(t, nt, nth):
            dealt[j] = big[i]
            j += 1
    tasks = tasks[dealt]
    return order, rows, tasks


@numba.njit(cache=True, parallel=True)
def pairs_q4_rows(x_p, T, h, s_p, k, gq, gz, uq, uz, dq, dz, os, groups, inter, limit, nth, out):
    """out [T * k, h] (zeroed by the caller) = each pair's down(act(gate x, up x)); slots [T, k] (-1: skipped);
    nth: numba's thread count."""
    X, slots = at(x_p, (T, h), np.float32), at(s_p, (T * k,), np.int64)
    order, rows, tasks = _plan(slots, T, k, nth)
    P, nt = order.shape[0], tasks.shape[0]
    pos = np.arange(P)                           # each sorted pair's row of the hidden buffer
    H, U = np.empty((P, inter), np.float32), np.empty((P, inter), np.float32)
    nbi, nbh = (inter + BLOCK - 1) // BLOCK, (h + BLOCK - 1) // BLOCK
    for i in numba.prange(nt * nbi):             # gate and up of one block of rows, then SwiGLU on it
        s, a, e = tasks[i // nbi, 0], tasks[i // nbi, 1], tasks[i // nbi, 2]
        b = i % nbi
        _task(gq, os[0, 0] + s * os[0, 1], gz, os[1, 0] + s * os[1, 1], groups[0], inter, h, b, X, rows, a, e, H, pos)
        _task(uq, os[2, 0] + s * os[2, 1], uz, os[3, 0] + s * os[3, 1], groups[1], inter, h, b, X, rows, a, e, U, pos)
        for r in range(a, e):
            for n in range(b * BLOCK, min(inter, b * BLOCK + BLOCK)):
                H[r, n] = act(H[r, n], U[r, n], limit)
    for i in numba.prange(nt * nbh):             # down, straight into each pair's output row
        s, a, e = tasks[i // nbh, 0], tasks[i // nbh, 1], tasks[i // nbh, 2]
        _task(dq, os[4, 0] + s * os[4, 1], dz, os[5, 0] + s * os[5, 1], groups[2], h, inter, i % nbh, H, pos, a, e,
              out, order)


@numba.njit(fastmath=True, inline="always")
def _task_i8(q, qo, sz, zo, G, N, K, b, X, XQ, D, E, S, xs, r0, r1, Y, ys):
    """Rows xs[r0..r1] of X (rounded to int8: XQ, D, E, S) through block b of one q4 matrix into Y's rows ys[r0..r1]:
    a full block by VNNI (quant/q4_vnni.py), a tail block by the decode row's float loop, row by row, as
    quant/q4_numba.mv_q4_i8 splits them, so each row has the decode row's bits."""
    szs = sz[zo:zo + G * N * 2]
    if b < i8_blocks(N, K, G):
        nr = r1 - r0
        xi = xs[r0:r1].copy()
        tile = np.empty(K // G // 4 * QUAD, np.uint8)
        acc = np.empty((nr, BLOCK), np.float32)
        block_rows_i8(np.int64(q.ctypes.data) + qo + b * 32 * K, np.int64(szs.ctypes.data) + b * BLOCK * 4, N,
                      XQ, D, E, S, xi, nr, tile, acc)
        for r in range(nr):
            Y[ys[r0 + r], b * BLOCK:b * BLOCK + BLOCK] = acc[r]
    else:
        scratch = np.empty(BLOCK, np.float32)
        for r in range(r0, r1):
            q4_block(q, qo, szs, G, N, K, b, X[xs[r]], Y[ys[r]], scratch)


@numba.njit(fastmath=True, cache=True, parallel=True)
def pairs_q4_i8(x_p, T, h, s_p, k, gq, gz, uq, uz, dq, dz, os, groups, inter, limit, nth, out):
    """pairs_q4_rows with every input row rounded to int8 as the decode row rounds it, and full blocks multiplied
    by VNNI: each pair's output has the bits the decode row's kernel (layers/cpu_kernels.pair_q4) gives it."""
    X, slots = at(x_p, (T, h), np.float32), at(s_p, (T * k,), np.int64)
    order, rows, tasks = _plan(slots, T, k, nth)
    P, nt = order.shape[0], tasks.shape[0]
    pos = np.arange(P)
    G0, G1, G2 = groups[0], groups[1], groups[2]
    XQ, D, E, S = quantize_rows(X, G0)
    XU, DU, EU, SU = (XQ, D, E, S) if G1 == G0 else quantize_rows(X, G1)
    H, U = np.empty((P, inter), np.float32), np.empty((P, inter), np.float32)
    nbi, nbh = (inter + BLOCK - 1) // BLOCK, (h + BLOCK - 1) // BLOCK
    for i in numba.prange(nt * nbi):
        s, a, e = tasks[i // nbi, 0], tasks[i // nbi, 1], tasks[i // nbi, 2]
        b = i % nbi
        _task_i8(gq, os[0, 0] + s * os[0, 1], gz, os[1, 0] + s * os[1, 1], G0, inter, h, b, X, XQ, D, E, S, rows,
                 a, e, H, pos)
        _task_i8(uq, os[2, 0] + s * os[2, 1], uz, os[3, 0] + s * os[3, 1], G1, inter, h, b, X, XU, DU, EU, SU, rows,
                 a, e, U, pos)
        for r in range(a, e):
            for n in range(b * BLOCK, min(inter, b * BLOCK + BLOCK)):
                H[r, n] = act(H[r, n], U[r, n], limit)
    HQ, HD, HE, HS = quantize_rows(H, G2)
    for i in numba.prange(nt * nbh):
        s, a, e = tasks[i // nbh, 0], tasks[i // nbh, 1], tasks[i // nbh, 2]
        _task_i8(dq, os[4, 0] + s * os[4, 1], dz, os[5, 0] + s * os[5, 1], G2, h, inter, i % nbh, H, HQ, HD, HE, HS,
                 pos, a, e, out, order)


class GroupedRows:
    """The prefill kernel for one bank of q4 records (SwiGLU, no biases): flat views of its parts made once."""

    def __init__(self, bank):
        parts = bank.parts
        flats = [_flat(parts[m][p]) for m in ("gate", "up", "down") for p in ("q", "sz")]
        self.os = np.array([(o, stride) for _, o, stride in flats], np.int64)
        self.arrays = tuple(a for a, _, _ in flats)
        self.groups = np.array([parts[m]["sz"].shape[1] for m in ("gate", "up", "down")], np.int64)
        self.inter = bank.shapes["gate"][0]
        self.limit = np.float32(bank.limit if bank.limit is not None else -1.0)
        self.fn = pairs_q4_i8 if q4_vnni.serves(*bank.shapes["gate"]) else pairs_q4_rows

    def __call__(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """x [T, h] float32 or bf16 (widened, and the pairs rounded back: as the decode row does), slots [T, k] (-1:
        left zero) -> [T, k, h]."""
        (T, h), k, dt = x.shape, slots.shape[1], x.dtype
        out = np.zeros((T, k, h), np.float32)
        x = x.float() if dt != torch.float32 else x if x.is_contiguous() else x.contiguous()
        slots = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
        follow_torch_threads()
        self.fn(x.data_ptr(), T, h, slots.data_ptr(), k, *self.arrays, self.os, self.groups, self.inter, self.limit,
                numba.get_num_threads(), out.reshape(T * k, h))
        return torch.from_numpy(out) if dt == torch.float32 else torch.from_numpy(out).to(dt)


def usable(bank) -> bool:
    """q4 records with SwiGLU (clamped or not) and no biases, on the CPU, in the stored layout (a torch build whose
    int4 operand differs has the records repacked in their slots: runtime/cache.py): the VNNI rows where they serve,
    else only records small enough for the float tiles to beat torch's int4 kernel."""
    from . import moe_cpu

    (N, K) = bank.shapes["gate"]
    return (bank.fmt.kind == "q4" and not bank.fmt.needs_prepare() and moe_cpu.usable(bank)
            and (q4_vnni.serves(N, K) or N * K <= MAX_WEIGHTS) and bank.parts["gate"]["q"].device.type == "cpu")


def warm() -> None:
    """Load (or compile, the first time on a machine) the CPU's numba kernels on tiny inputs of the real calls' types:
    the decode row's (moe_cpu.warm) and the prefill chunk's (Engine.load: before the memory plan measures the
    process's baseline)."""
    from ..quant import q4_rows
    from . import moe_cpu

    moe_cpu.warm()
    f32, i64, h, inter, k = np.float32, np.int64, 64, 64, 2
    x, slots = torch.zeros(2, h), torch.zeros(2, k, dtype=torch.int64)
    nib, sz = np.zeros(h * inter // 2, np.uint8), np.zeros(h * inter, np.uint16)
    for fn in (pairs_q4_i8, pairs_q4_rows) if q4_vnni.available() else (pairs_q4_rows,):
        fn(x.data_ptr(), 2, h, slots.data_ptr(), k, nib, sz, nib, sz, nib, sz, np.zeros((6, 2), i64),
           np.ones(3, i64), inter, f32(-1), 1, np.zeros((2 * k, h), f32))
    q = torch.zeros(h, h // 2, dtype=torch.uint8)
    q4_rows.unpack_rows_t(q.data_ptr(), q.data_ptr(), h, h, 1, 0, h, np.zeros((h, h), f32))
