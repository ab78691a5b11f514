"""The routed experts of one decode row on the CPU, every pair in one numba call straight from the slab.

At one row a pair is three matrix-vector products and an activation: through torch that is 6-12 operators per
pair (casts, gathers, bmm or int4 matmuls, the activation), each costing more in dispatch than in arithmetic at
the sizes of a decode step (docs/LEARNED.md §10). Here all k pairs of the row are one call that reads each
record's bytes where they sit in the slab (bf16 / float32 / q8 codes / q4 nibbles in the stored layout), so
nothing is gathered or widened first.

Exact per pair: each pair is computed by the same loops whatever else is in the call and on one thread, so a
pair gives the same bits in any group, at any budget, at any thread count. Float32 compute only; another
compute dtype, another activation (K3's SiTU-GLU) or more than one row take layers/moe.py's torch kernels.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ..quant.int4pack import BLOCK
from .numba_ptr import at


@functools.lru_cache(maxsize=1)
def _kernels():
    import numba
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    _at = at()

    @intrinsic
    def _f32_of(typingctx, b):             # the float32 whose bits are b
        return types.float32(types.uint32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())

    @numba.njit(inline="always")
    def act(g, u, limit):                  # swiglu_act: silu(min(g, L)) * clamp(u, -L, L), or silu(g) * u
        if limit > 0:
            g = min(g, limit)
            u = max(-limit, min(u, limit))
        return g / (np.float32(1.0) + np.exp(-g)) * u

    @numba.njit(inline="always")
    def bf16(bits):                        # bf16 bits (uint16) -> float32
        return _f32_of(np.uint32(bits) << np.uint32(16))

    @numba.njit(fastmath=True, inline="always")
    def mv_bf16(w, o, x, y, tmp):          # y = W x, W [N, K] bf16 bits from w[o]: a row widened, then its dot
        N, K = y.shape[0], x.shape[0]
        tf = tmp.view(np.float32)
        for n in range(N):
            row = w[o + n * K:o + n * K + K]     # a slice: indices from range() need no negative-index check
            for k in range(K):
                tmp[k] = np.uint32(row[k]) << np.uint32(16)
            acc = np.float32(0.0)
            for k in range(K):
                acc += tf[k] * x[k]
            y[n] = acc

    @numba.njit(fastmath=True, inline="always")
    def mv_f32(w, o, x, y):
        N, K = y.shape[0], x.shape[0]
        for n in range(N):
            row = w[o + n * K:o + n * K + K]
            acc = np.float32(0.0)
            for k in range(K):
                acc += row[k] * x[k]
            y[n] = acc

    @numba.njit(fastmath=True, inline="always")
    def mv_q8(q, o, sc, so, x, y):         # W[n, k] = q[n, k] * scale[n]
        N, K = y.shape[0], x.shape[0]
        for n in range(N):
            row = q[o + n * K:o + n * K + K]
            acc = np.float32(0.0)
            for k in range(K):
                acc += np.float32(row[k]) * x[k]
            y[n] = acc * sc[so + n]

    @numba.njit(fastmath=True, inline="always")
    def mv_q4(q, o, sz, zo, G, x, y, acc):  # quant/intq.py Q4: nibbles in int4pack's layout, sz bf16 [G, N, 2]
        N, K = y.shape[0], x.shape[0]
        szs = sz[zo:zo + G * N * 2]
        gs = K // G
        for n in range(N):
            y[n] = 0.0
        nfull = N // BLOCK
        for b in range(nfull + (1 if N % BLOCK else 0)):
            rows = BLOCK if b < nfull else N - nfull * BLOCK
            hb = rows // 2
            base = o + b * BLOCK * K // 2
            for g in range(G):
                for j in range(rows):
                    acc[j] = 0.0
                sx = np.float32(0.0)
                for k in range(g * gs, g * gs + gs):
                    xk = x[k]
                    sx += xk
                    col = q[base + k * hb:base + k * hb + hb]
                    for j in range(hb):
                        c = col[j]
                        acc[j] += np.float32(c & 15) * xk
                        acc[hb + j] += np.float32(c >> 4) * xk
                for j in range(rows):
                    # a full block holds rows j and j + 32 in a byte, the tail rows 2j and 2j + 1
                    n = b * BLOCK + (j if b < nfull else (2 * j if j < hb else 2 * (j - hb) + 1))
                    z = (g * N + n) * 2
                    y[n] += bf16(szs[z]) * (acc[j] - np.float32(8.0) * sx) + bf16(szs[z + 1]) * sx

    @numba.njit(fastmath=True, cache=True, nogil=True)     # nogil: layers/moe.py spread
    def pairs_bf16(x_p, h, s_p, k, gw, uw, dw, os, inter, limit, out):
        x, slots = _at(x_p, (h,), np.float32), _at(s_p, (k,), np.int64)
        g, u = np.empty(inter, np.float32), np.empty(inter, np.float32)
        tmp = np.empty(max(inter, x.shape[0]), np.uint32)
        for p in range(slots.shape[0]):
            s = slots[p]
            if s < 0:
                continue
            mv_bf16(gw, os[0, 0] + s * os[0, 1], x, g, tmp)
            mv_bf16(uw, os[1, 0] + s * os[1, 1], x, u, tmp)
            for i in range(inter):
                g[i] = act(g[i], u[i], limit)
            mv_bf16(dw, os[2, 0] + s * os[2, 1], g, out[p], tmp)

    @numba.njit(fastmath=True, cache=True, nogil=True)     # nogil: layers/moe.py spread
    def pairs_f32(x_p, h, s_p, k, gw, uw, dw, os, inter, limit, out):
        x, slots = _at(x_p, (h,), np.float32), _at(s_p, (k,), np.int64)
        g, u = np.empty(inter, np.float32), np.empty(inter, np.float32)
        for p in range(slots.shape[0]):
            s = slots[p]
            if s < 0:
                continue
            mv_f32(gw, os[0, 0] + s * os[0, 1], x, g)
            mv_f32(uw, os[1, 0] + s * os[1, 1], x, u)
            for i in range(inter):
                g[i] = act(g[i], u[i], limit)
            mv_f32(dw, os[2, 0] + s * os[2, 1], g, out[p])

    @numba.njit(fastmath=True, cache=True, nogil=True)     # nogil: layers/moe.py spread
    def pairs_q8(x_p, h, s_p, k, gq, gs, uq, us, dq, ds, os, inter, limit, out):
        x, slots = _at(x_p, (h,), np.float32), _at(s_p, (k,), np.int64)
        g, u = np.empty(inter, np.float32), np.empty(inter, np.float32)
        for p in range(slots.shape[0]):
            s = slots[p]
            if s < 0:
                continue
            mv_q8(gq, os[0, 0] + s * os[0, 1], gs, os[1, 0] + s * os[1, 1], x, g)
            mv_q8(uq, os[2, 0] + s * os[2, 1], us, os[3, 0] + s * os[3, 1], x, u)
            for i in range(inter):
                g[i] = act(g[i], u[i], limit)
            mv_q8(dq, os[4, 0] + s * os[4, 1], ds, os[5, 0] + s * os[5, 1], g, out[p])

    @numba.njit(fastmath=True, cache=True, nogil=True)     # nogil: layers/moe.py spread
    def pairs_q4(x_p, h, s_p, k, gq, gz, uq, uz, dq, dz, os, groups, inter, limit, out):
        x, slots = _at(x_p, (h,), np.float32), _at(s_p, (k,), np.int64)
        acc = np.empty(BLOCK, np.float32)
        g, u = np.empty(inter, np.float32), np.empty(inter, np.float32)
        for p in range(slots.shape[0]):
            s = slots[p]
            if s < 0:
                continue
            mv_q4(gq, os[0, 0] + s * os[0, 1], gz, os[1, 0] + s * os[1, 1], groups[0], x, g, acc)
            mv_q4(uq, os[2, 0] + s * os[2, 1], uz, os[3, 0] + s * os[3, 1], groups[1], x, u, acc)
            for i in range(inter):
                g[i] = act(g[i], u[i], limit)
            mv_q4(dq, os[4, 0] + s * os[4, 1], dz, os[5, 0] + s * os[5, 1], groups[2], g, out[p], acc)

    @numba.njit(fastmath=True, cache=True)
    def weighted_row(y_p, w_p, k, h, out):      # out[i] = sum_j w[j] * y[j, i], j ascending
        y, w = _at(y_p, (k, h), np.float32), _at(w_p, (k,), np.float32)
        for i in range(h):
            out[0, i] = 0.0
        for j in range(k):
            wj, yj = w[j], y[j]
            for i in range(h):
                out[0, i] += wj * yj[i]

    return {"weighted_row": weighted_row, "bf16": pairs_bf16, "f32": pairs_f32, "q8": pairs_q8, "q4": pairs_q4}


def _flat(t: torch.Tensor) -> tuple[np.ndarray, int, int]:
    """A [slots, ...] view of the slab as (the whole slab as one flat numpy array of the part's dtype, bf16 as its
    uint16 bits; the part's offset in elements; the record stride in elements). The kernels slice a row out of it
    before looping: an index computed as offset + k may be negative for all numba knows, and the check it then adds
    per element stopped the loops from vectorising (8x slower, measured: LEARNED §10)."""
    dt = torch.int16 if t.dtype == torch.bfloat16 else t.dtype
    st = t.untyped_storage()
    flat = torch.empty(0, dtype=dt).set_(st, 0, (st.nbytes() // t.element_size(),)).numpy()
    return (flat.view(np.uint16) if t.dtype == torch.bfloat16 else flat), t.storage_offset(), t.stride(0)


class NumbaPairs:
    """The decode-row kernel for one bank: flat numpy views of its parts made once (the slab never moves)."""

    PARTS = {"float": ("",), "q8": ("q", "scale"), "q4": ("q", "sz")}

    def __init__(self, bank):
        parts, kind = bank.parts, bank.fmt.kind
        flats = [_flat(parts[m][k]) for m in ("gate", "up", "down") for k in self.PARTS[kind]]
        os = np.array([(o, stride) for _, o, stride in flats], np.int64)
        arrays = tuple(a for a, _, _ in flats)
        inter = bank.shapes["gate"][0]
        limit = np.float32(bank.limit if bank.limit is not None else -1.0)
        if kind == "float":
            key = "bf16" if parts["gate"][""].dtype == torch.bfloat16 else "f32"
            self.fn, self.args = _kernels()[key], (*arrays, os, inter, limit)
        elif kind == "q8":
            self.fn, self.args = _kernels()["q8"], (*arrays, os, inter, limit)
        else:
            groups = np.array([parts[m]["sz"].shape[1] for m in ("gate", "up", "down")], np.int64)
            self.fn, self.args = _kernels()["q4"], (*arrays, os, groups, inter, limit)

    def __call__(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """x [1, h] float32, slots [1, k] int64 (-1: left zero) -> [1, k, h]."""
        k, h = slots.shape[1], x.shape[-1]
        out = np.zeros((1, k, h), np.float32)
        x = x if x.is_contiguous() else x.contiguous()
        slots = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
        self.fn(x.data_ptr(), h, slots.data_ptr(), k, *self.args, out[0])
        return torch.from_numpy(out)


def weighted_row(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """layers/moe.py weighted_sum of one float32 row on the CPU in one call ([1, k, h], [1, k] -> [1, h]), or None
    where it does not apply."""
    if y.shape[0] != 1 or y.dtype != torch.float32 or weights.dtype != torch.float32 or y.device.type != "cpu":
        return None
    y = y if y.is_contiguous() else y.contiguous()
    weights = weights if weights.is_contiguous() else weights.contiguous()
    out = np.empty((1, y.shape[2]), np.float32)
    _kernels()["weighted_row"](y.data_ptr(), weights.data_ptr(), y.shape[1], y.shape[2], out)
    return torch.from_numpy(out)


def usable(bank) -> bool:
    """Whether this bank's records can go through the numba pairs: q4 / q8 / bf16 / float32 records with SwiGLU and
    no biases (gpt-oss's biased, clamped-GLU records take the torch kernels)."""
    if bank.act is not None or getattr(bank, "bias", False) or bank.fmt.kind not in ("float", "q8", "q4"):
        return False
    if bank.fmt.kind == "float":
        dts = {bank.parts[m][""].dtype for m in ("gate", "up", "down")}
        return dts in ({torch.bfloat16}, {torch.float32})
    if bank.fmt.kind == "q4":
        return all(set(bank.parts[m]) == {"q", "sz"} for m in ("gate", "up", "down"))
    return True


def warm() -> None:
    """Load (or compile, the first time on a machine) every numba kernel a CPU decode row uses, on tiny inputs of the
    real calls' types: numba and its LLVM runtime take about 150 MB once a kernel runs, and the memory plan measures
    the process's own memory as its baseline, so this runs before the plan does (Engine.load)."""
    from . import attention_cpu, router_cpu

    f32, i64 = np.float32, np.int64
    h, k, inter = 64, 2, 32
    x, slots = torch.zeros(1, h), torch.zeros(1, k, dtype=torch.int64)
    out = np.zeros((1, k, h), f32)[0]
    os = np.zeros((6, 2), i64)
    ks = _kernels()
    words = np.zeros(h * inter, np.uint16)
    ks["bf16"](x.data_ptr(), h, slots.data_ptr(), k, words, words, words, os[:3].copy(), inter, f32(-1), out)
    floats = np.zeros(h * inter, f32)
    ks["f32"](x.data_ptr(), h, slots.data_ptr(), k, floats, floats, floats, os[:3].copy(), inter, f32(-1), out)
    codes, scales = np.zeros(h * inter, np.int8), np.ones(h * inter, f32)
    ks["q8"](x.data_ptr(), h, slots.data_ptr(), k, codes, scales, codes, scales, codes, scales, os, inter, f32(-1), out)
    nib, sz = np.zeros(h * inter // 2, np.uint8), np.zeros(h * inter, np.uint16)
    ks["q4"](x.data_ptr(), h, slots.data_ptr(), k, nib, sz, nib, sz, nib, sz, os, np.ones(3, i64), inter, f32(-1), out)
    weighted_row(torch.zeros(1, k, h), torch.zeros(1, k))
    router_cpu.softmax_topk_row(x, torch.zeros(4, h), 2, True)
    H, G, d = 2, 1, 8
    buf = torch.zeros(4, G, d)
    attention_cpu.gqa_row(torch.zeros(1, (H + 2 * G) * d), H, G, torch.ones(d), torch.ones(d), 1e-6, torch.ones(d),
                          torch.zeros(d), buf, buf.clone(), 0)
