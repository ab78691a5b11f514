"""One decode row of grouped-query attention on the CPU in one numba call: q/k norm, rotary, the cache write and
the attention over the cached rows.

Through torch these are about twenty operators per layer (two norms, six for rotary, the splits and views, two
cache copies, the fused attention and its transposes), each costing more in dispatch than in arithmetic at one row
(docs/LEARNED.md §10). The arithmetic is the same as layers/attention.py's: RMSNorm in float32, rotate-half
rotary, softmax in float32 over positions 0..n with scale 1/sqrt(d); its last bits differ from torch's kernels,
so a row takes this path by its shape alone (one row, float32, CPU), never by what else runs beside it.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .numba_ptr import at


@functools.lru_cache(maxsize=1)
def _kernel():
    import numba

    _at = at()
    f32 = np.float32

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

    @numba.njit(fastmath=True, cache=True)
    def gqa_row(qkv_p, H, G, d, rot, qn_p, kn_p, use_norm, eps, cos_p, sin_p, k_p, v_p, cap, n, out):
        qkv = _at(qkv_p, (H + 2 * G, d), f32)
        qn, kn = _at(qn_p, (d,), f32), _at(kn_p, (d,), f32)
        cos, sin = _at(cos_p, (d,), f32), _at(sin_p, (d,), f32)
        K, V = _at(k_p, (cap, G, d), f32), _at(v_p, (cap, G, d), f32)
        tmp, q = np.empty(d, np.float32), np.empty(d, np.float32)
        for g in range(G):
            norm_rope(qkv[H + g], kn, use_norm, eps, cos, sin, rot, K[n, g], tmp)
            src, dst = qkv[H + G + g], V[n, g]
            for i in range(d):
                dst[i] = src[i]
        scale = np.float32(1.0) / np.sqrt(np.float32(d))
        scores = np.empty(n + 1, np.float32)
        rep = H // G
        for h in range(H):
            norm_rope(qkv[h], qn, use_norm, eps, cos, sin, rot, q, tmp)
            g = h // rep
            m = -np.inf
            for t in range(n + 1):
                kt = K[t, g]
                s = np.float32(0.0)
                for i in range(d):
                    s += q[i] * kt[i]
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
                    o[i] += p * vt[i]

    return gqa_row


def usable(qkv: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """One float32 row on the CPU, over a float32 cache."""
    return (qkv.shape[0] == 1 and qkv.dtype == torch.float32 and qkv.device.type == "cpu"
            and k_buf.dtype == torch.float32)


def gqa_row(qkv: torch.Tensor, H: int, G: int, q_norm, k_norm, eps: float, cos: torch.Tensor, sin: torch.Tensor,
            k_buf: torch.Tensor, v_buf: torch.Tensor, n: int, rotary_dim: int | None = None) -> torch.Tensor:
    """qkv [1, (H + 2G) * d] of the row at position n -> its attention output [1, H * d]; writes its key (normed,
    rotated) and value into row n of k_buf / v_buf [capacity, G, d] (contiguous). cos / sin: the position's [d]
    tables (contiguous views); q_norm / k_norm [d] or None; rotary_dim: partial rotary (the first rotary_dim
    dimensions of each head rotate, the rest pass)."""
    d = k_buf.shape[-1]
    out = np.empty((1, H * d), np.float32)
    use_norm = q_norm is not None
    qkv = qkv if qkv.is_contiguous() else qkv.contiguous()
    _kernel()(qkv.data_ptr(), H, G, d, rotary_dim or d, q_norm.data_ptr() if use_norm else 0, k_norm.data_ptr() if use_norm else 0,
              use_norm, np.float32(eps), cos.data_ptr(), sin.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(),
              k_buf.shape[0], n, out.reshape(H, d))
    return torch.from_numpy(out)
