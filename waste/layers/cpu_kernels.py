"""The numba kernels of one float32 decode row on the CPU: routed expert pairs (moe_cpu.py), grouped-query attention
(attention_cpu.py), softmax top-k routing (router_cpu.py) and RMS normalisation (norm_cpu.py); those modules
hold the torch-facing wrappers and say what each kernel replaces.

Module-level functions, so numba's on-disk cache keeps them across processes (defined in closures they were
compiled again in every process: 7 s of every CPU engine load, docs/LEARNED.md §10). Import lazily: importing this
module imports numba.
"""
from __future__ import annotations

import numba
import numpy as np

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

from ..numba_ptr import at, fetch_add
from ..quant.int4pack import BLOCK
from ..quant.q4_int8 import quantize_row
from ..quant.q4_numba import bf16, mv_q4_block, mv_q4_i8

f32 = np.float32


def widen(v):                          # a cache element as float32: itself, or bf16 bits widened
    pass


def narrow(v, dst):                    # a float32 as an element of dst: itself, or rounded to bf16 bits
    pass


@overload(widen, inline="always")
def _widen(v):
    if v == types.uint16:
        return lambda v: bf16(v)
    return lambda v: v


@overload(narrow, inline="always")
def _narrow(v, dst):
    if dst.dtype == types.uint16:     # round to nearest even, as torch's .to(bfloat16) (no NaN in a cache row)
        def rne(v, dst):
            b = _bits(v)
            return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return rne
    return lambda v, dst: v


@intrinsic
def _bits(typingctx, v):               # the bits of a float32
    return types.uint32(types.float32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.IntType(32))


@numba.njit(nogil=True, fastmath=False)
def act(g, u, limit):                  # swiglu_act: silu(min(g, L)) * clamp(u, -L, L), or silu(g) * u
    # no fast-math, not inlined into the (fast-math) kernels: a fast division may be a reciprocal estimate in one
    # loop's vector form and exact in another's, and prefill and decode must give a pair the same bits
    if limit > 0:
        g = min(g, limit)
        u = max(-limit, min(u, limit))
    return g / (np.float32(1.0) + np.exp(-g)) * u


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


@numba.njit(fastmath=True, cache=True, parallel=True, nogil=True)   # nogil: layers/moe.py spread
def pairs_bf16(x_p, h, s_p, k, gw, uw, dw, os, inter, limit, out):
    x, slots = at(x_p, (h,), np.float32), at(s_p, (k,), np.int64)
    for p in numba.prange(slots.shape[0]):
        s = slots[p]
        if s < 0:
            continue
        g, u = np.empty(inter, np.float32), np.empty(inter, np.float32)
        tmp = np.empty(max(inter, x.shape[0]), np.uint32)
        mv_bf16(gw, os[0, 0] + s * os[0, 1], x, g, tmp)
        mv_bf16(uw, os[1, 0] + s * os[1, 1], x, u, tmp)
        for i in range(inter):
            g[i] = act(g[i], u[i], limit)
        mv_bf16(dw, os[2, 0] + s * os[2, 1], g, out[p], tmp)


@numba.njit(fastmath=True, cache=True, parallel=True, nogil=True)   # nogil: layers/moe.py spread
def pairs_f32(x_p, h, s_p, k, gw, uw, dw, os, inter, limit, out):
    x, slots = at(x_p, (h,), np.float32), at(s_p, (k,), np.int64)
    for p in numba.prange(slots.shape[0]):
        s = slots[p]
        if s < 0:
            continue
        g, u = np.empty(inter, np.float32), np.empty(inter, np.float32)
        mv_f32(gw, os[0, 0] + s * os[0, 1], x, g)
        mv_f32(uw, os[1, 0] + s * os[1, 1], x, u)
        for i in range(inter):
            g[i] = act(g[i], u[i], limit)
        mv_f32(dw, os[2, 0] + s * os[2, 1], g, out[p])


@numba.njit(fastmath=True, cache=True, parallel=True, nogil=True)   # nogil: layers/moe.py spread
def pairs_q8(x_p, h, s_p, k, gq, gs, uq, us, dq, ds, os, inter, limit, out):
    x, slots = at(x_p, (h,), np.float32), at(s_p, (k,), np.int64)
    for p in numba.prange(slots.shape[0]):
        s = slots[p]
        if s < 0:
            continue
        g, u = np.empty(inter, np.float32), np.empty(inter, np.float32)
        mv_q8(gq, os[0, 0] + s * os[0, 1], gs, os[1, 0] + s * os[1, 1], x, g)
        mv_q8(uq, os[2, 0] + s * os[2, 1], us, os[3, 0] + s * os[3, 1], x, u)
        for i in range(inter):
            g[i] = act(g[i], u[i], limit)
        mv_q8(dq, os[4, 0] + s * os[4, 1], ds, os[5, 0] + s * os[5, 1], g, out[p])


@numba.njit(fastmath=True, nogil=True)
def pair_q4(s, x, xq, d, d8sq, sx, gq, gz, uq, uz, dq, dz, os, groups, inter, limit, y):
    # one pair, its own function (its scratch its own) rather than the prange body
    h = x.shape[0]
    acc = np.empty(BLOCK, np.float32)
    g, u = np.empty(inter, np.float32), np.empty(inter, np.float32)
    G = groups[0]
    mv_q4_i8(gq, os[0, 0] + s * os[0, 1], gz, os[1, 0] + s * os[1, 1], G, x, xq, d, d8sq, sx, g, acc)
    if groups[1] == G:
        mv_q4_i8(uq, os[2, 0] + s * os[2, 1], uz, os[3, 0] + s * os[3, 1], G, x, xq, d, d8sq, sx, u, acc)
    else:
        Gu = groups[1]
        xu, du, eu, tu = np.empty(h, np.int16), np.empty(Gu, np.float32), np.empty(Gu, np.float32), np.empty(Gu, np.float32)
        quantize_row(x, Gu, xu, du, eu, tu)
        mv_q4_i8(uq, os[2, 0] + s * os[2, 1], uz, os[3, 0] + s * os[3, 1], Gu, x, xu, du, eu, tu, u, acc)
    for i in range(inter):
        g[i] = act(g[i], u[i], limit)
    Gd = groups[2]
    gx, dd, de, dt = np.empty(inter, np.int16), np.empty(Gd, np.float32), np.empty(Gd, np.float32), np.empty(Gd, np.float32)
    quantize_row(g, Gd, gx, dd, de, dt)
    mv_q4_i8(dq, os[4, 0] + s * os[4, 1], dz, os[5, 0] + s * os[5, 1], Gd, g, gx, dd, de, dt, y, acc)


@numba.njit(fastmath=True, cache=True, parallel=True, nogil=True)   # nogil: layers/moe.py spread
def pairs_q4(x_p, h, s_p, k, gq, gz, uq, uz, dq, dz, os, groups, inter, limit, out):
    # x is rounded to int8 once for every pair's gate and up (quant/q4_int8.py); each pair's down input alone
    x, slots = at(x_p, (h,), np.float32), at(s_p, (k,), np.int64)
    G = groups[0]
    xq, d, d8sq, sx = np.empty(h, np.int16), np.empty(G, np.float32), np.empty(G, np.float32), np.empty(G, np.float32)
    quantize_row(x, G, xq, d, d8sq, sx)
    for p in numba.prange(slots.shape[0]):
        if slots[p] >= 0:
            pair_q4(slots[p], x, xq, d, d8sq, sx, gq, gz, uq, uz, dq, dz, os, groups, inter, limit, out[p])


@numba.njit(fastmath=True, cache=True, nogil=True)
def pair_q4_shared(x_p, h, s, gq, gz, uq, uz, dq, dz, os, groups, inter, limit, y_p, g_p, u_p, queue_p, helper):
    """pair_q4 of slot s into y (float32 [h] at y_p), its 64-row blocks taken from a queue ([next, done] int64 at
    queue_p) by every thread that calls it: first the gate and up blocks (into g, u float32 [inter] at g_p, u_p,
    shared), then, once every one of them is done, the down blocks, each thread that takes one having made its own
    copy of the activation and its int8 rounding. The caller (helper False) returns once every block is done, a
    helper as soon as none is left to take (one that wakes late finds the queue spent). A layer's last record is
    often a lone pair on the step's critical path (docs/LEARNED.md §3o). Each block is mv_q4_i8's (mv_q4_block),
    the activation and rounding pair_q4's, so the bits are pair_q4's on any threads."""
    x, y = at(x_p, (h,), np.float32), at(y_p, (h,), np.float32)
    g, u = at(g_p, (inter,), np.float32), at(u_p, (inter,), np.float32)
    nb1, nb2 = (inter + BLOCK - 1) // BLOCK, (h + BLOCK - 1) // BLOCK
    n = nb1 + nb2
    if helper and fetch_add(queue_p, 0, 0) >= n:
        return
    G, Gu, Gd = groups[0], groups[1], groups[2]
    xq, d, d8sq, sx = np.empty(h, np.int16), np.empty(G, np.float32), np.empty(G, np.float32), np.empty(G, np.float32)
    quantize_row(x, G, xq, d, d8sq, sx)
    xu, du, eu, tu = xq, d, d8sq, sx
    if Gu != G:
        xu, du, eu, tu = np.empty(h, np.int16), np.empty(Gu, np.float32), np.empty(Gu, np.float32), np.empty(Gu, np.float32)
        quantize_row(x, Gu, xu, du, eu, tu)
    a, acc = np.empty(inter, np.float32), np.empty(BLOCK, np.float32)
    gx, dd, de, dt = np.empty(inter, np.int16), np.empty(Gd, np.float32), np.empty(Gd, np.float32), np.empty(Gd, np.float32)
    ready = False
    while True:
        c = fetch_add(queue_p, 0, 1)
        if c >= n:
            break
        if c < nb1:
            mv_q4_block(gq, os[0, 0] + s * os[0, 1], gz, os[1, 0] + s * os[1, 1], G, x, xq, d, d8sq, sx, g, acc, c)
            mv_q4_block(uq, os[2, 0] + s * os[2, 1], uz, os[3, 0] + s * os[3, 1], Gu, x, xu, du, eu, tu, u, acc, c)
        else:
            if not ready:
                while fetch_add(queue_p, 1, 0) < nb1:     # every gate and up block done (by whichever thread)
                    pass
                for i in range(inter):
                    a[i] = act(g[i], u[i], limit)
                quantize_row(a, Gd, gx, dd, de, dt)
                ready = True
            mv_q4_block(dq, os[4, 0] + s * os[4, 1], dz, os[5, 0] + s * os[5, 1], Gd, a, gx, dd, de, dt, y, acc, c - nb1)
        fetch_add(queue_p, 1, 1)
    while not helper and fetch_add(queue_p, 1, 0) < n:
        pass


@numba.njit(fastmath=True, cache=True)
def weighted_row(y_p, w_p, k, h, out):      # out[i] = sum_j w[j] * y[j, i], j ascending
    y, w = at(y_p, (k, h), np.float32), at(w_p, (k,), np.float32)
    for i in range(h):
        out[0, i] = 0.0
    for j in range(k):
        wj, yj = w[j], y[j]
        for i in range(h):
            out[0, i] += wj * yj[i]


@numba.njit(fastmath=True, cache=True)
def weighted_row_bf16(y_p, w_p, k, h, o_p):    # weighted_row of bf16 pairs: summed in float32, rounded once
    y, w, out = at(y_p, (k, h), np.uint16), at(w_p, (k,), np.float32), at(o_p, (h,), np.uint16)
    acc = np.zeros(h, np.float32)
    for j in range(k):
        wj, yj = w[j], y[j]
        for i in range(h):
            acc[i] += wj * widen(yj[i])
    for i in range(h):
        out[i] = narrow(acc[i], out)


@numba.njit(fastmath=True, inline="always")
def norm_rope(src, w, use_norm, eps, cos, sin, rot, dst, tmp):   # dst = rope(norm(src)), the first rot dims
    d = src.shape[0]
    half = rot // 2
    r = np.float32(1.0)
    if use_norm:
        ss = np.float32(0.0)
        for i in range(d):
            ss += src[i] * src[i]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
    for i in range(d):
        tmp[i] = src[i] * r * w[i] if use_norm else src[i]
    for i in range(half):
        dst[i] = tmp[i] * cos[i] - tmp[half + i] * sin[i]
        dst[half + i] = tmp[half + i] * cos[half + i] + tmp[i] * sin[half + i]
    for i in range(rot, d):            # partial rotary: the rest of the head passes through
        dst[i] = tmp[i]


@numba.njit(fastmath=True, cache=True, parallel=True)
def gqa_row(qkv_p, H, G, d, rot, qn_p, kn_p, use_norm, eps, cos_p, sin_p, k_p, v_p, cap, n, bf, out):
    # bf: the cache holds bf16 (the compute dtype above 2 GiB), read widened and written rounded to nearest even
    if bf:
        attend(qkv_p, H, G, d, rot, qn_p, kn_p, use_norm, eps, cos_p, sin_p,
               at(k_p, (cap, G, d), np.uint16), at(v_p, (cap, G, d), np.uint16), n, out)
    else:
        attend(qkv_p, H, G, d, rot, qn_p, kn_p, use_norm, eps, cos_p, sin_p,
               at(k_p, (cap, G, d), f32), at(v_p, (cap, G, d), f32), n, out)


@numba.njit(fastmath=True, inline="always")
def attend(qkv_p, H, G, d, rot, qn_p, kn_p, use_norm, eps, cos_p, sin_p, K, V, n, out):
    qkv = at(qkv_p, (H + 2 * G, d), f32)
    qn, kn = at(qn_p, (d,), f32), at(kn_p, (d,), f32)
    cos, sin = at(cos_p, (d,), f32), at(sin_p, (d,), f32)
    tmp, row = np.empty(d, np.float32), np.empty(d, np.float32)
    for g in range(G):
        norm_rope(qkv[H + g], kn, use_norm, eps, cos, sin, rot, row, tmp)
        kd, src, vd = K[n, g], qkv[H + G + g], V[n, g]
        for i in range(d):
            kd[i] = narrow(row[i], kd)
            vd[i] = narrow(src[i], vd)
    scale = np.float32(1.0) / np.sqrt(np.float32(d))
    rep = H // G
    for h in numba.prange(H):              # heads spread over the threads: each head is one thread's, same bits
        hq, htmp, scores = np.empty(d, np.float32), np.empty(d, np.float32), np.empty(n + 1, np.float32)
        norm_rope(qkv[h], qn, use_norm, eps, cos, sin, rot, hq, htmp)
        g = h // rep
        m = -np.inf
        for t in range(n + 1):
            kt = K[t, g]
            s = np.float32(0.0)
            for i in range(d):
                s += hq[i] * widen(kt[i])
            s *= scale
            scores[t] = s
            m = max(m, s)
        tot = np.float32(0.0)
        for t in range(n + 1):
            e = np.exp(scores[t] - m)
            scores[t] = e
            tot += e
        o = out[h]
        for i in range(d):
            o[i] = 0.0
        for t in range(n + 1):
            p = scores[t] / tot
            vt = V[t, g]
            for i in range(d):
                o[i] += p * widen(vt[i])


@numba.njit(fastmath=True, cache=True)
def softmax_topk_row(x_p, w_p, h, E, k, renorm, weights, ids):
    x, W = at(x_p, (h,), np.float32), at(w_p, (E, h), np.float32)
    p = np.empty(E, np.float32)
    m = -np.inf
    for e in range(E):
        row = W[e]
        acc = np.float32(0.0)
        for i in range(h):
            acc += row[i] * x[i]
        p[e] = acc
        m = max(m, acc)
    tot = np.float32(0.0)
    for e in range(E):
        p[e] = np.exp(p[e] - m)
        tot += p[e]
    for e in range(E):
        p[e] /= tot
    picked = 0
    s = np.float32(0.0)
    for j in range(k):
        best = -1
        for e in range(E):
            if p[e] >= 0 and (best < 0 or p[e] > p[best]):
                best = e
        ids[0, j] = best
        weights[0, j] = p[best]
        s += p[best]
        p[best] = -1.0            # taken (probabilities are >= 0)
        picked += 1
    if renorm:
        for j in range(picked):
            weights[0, j] /= s


@numba.njit(fastmath=True, inline="always")
def rms_bf16_body(x, w, out, R, h, eps):
    """bf16 rows (their bits) as norm.py's bf16 lines compute them: in float32, x / rms(x) rounded to bf16, then times
    the weight rounded to bf16 (w: its bf16 bits or float32) and rounded again."""
    for r in range(R):
        row = x[r]
        ss = np.float32(0.0)
        for i in range(h):
            v = widen(row[i])
            ss += v * v
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(h) + np.float32(eps))
        o = out[r]
        for i in range(h):
            o[i] = narrow(widen(narrow(widen(w[i]), o)) * widen(narrow(widen(row[i]) * inv, o)), o)


@numba.njit(fastmath=True, cache=True)
def rms_rows_bf16(x_p, w_p, R, h, eps, o_p):       # the weight in bf16
    rms_bf16_body(at(x_p, (R, h), np.uint16), at(w_p, (h,), np.uint16), at(o_p, (R, h), np.uint16), R, h, eps)


@numba.njit(fastmath=True, cache=True)
def rms_rows_bf16_w32(x_p, w_p, R, h, eps, o_p):   # the weight in float32 (a trunk's norms in a bf16 model)
    rms_bf16_body(at(x_p, (R, h), np.uint16), at(w_p, (h,), np.float32), at(o_p, (R, h), np.uint16), R, h, eps)


@numba.njit(fastmath=True, cache=True)
def rms_rows(x_p, w_p, R, h, eps, o_p):
    x, w, out = at(x_p, (R, h), np.float32), at(w_p, (h,), np.float32), at(o_p, (R, h), np.float32)
    for r in range(R):
        row = x[r]
        ss = np.float32(0.0)
        for i in range(h):
            ss += row[i] * row[i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(h) + np.float32(eps))
        o = out[r]
        for i in range(h):
            o[i] = row[i] * inv * w[i]
