"""mHC's hyper-connection weights and the sublayer's input in one launch on a GPU (layers/mhc.py's read side).

hc_split's tail in torch is ~130 small launches a call (Sinkhorn's 2 x (iters - 1) normalisations of a 4 x 4 matrix,
three ops each), twice a layer: on the H200, eager at ~10 us a launch, over half of a GLM-5.3-Flash layer's 5.6 ms
(docs/LEARNED.md §10i). Here one program a token computes pre, post and M from the projection's row and sums the
streams into u, in float32 and in the torch path's order of operations (rounding may differ in the last bits: the
softmax's exp and the sums' order are the GPU's). The CPU keeps the torch path, so its bits never change.
"""
from __future__ import annotations

import torch

from . import decode_triton

try:
    import triton
    import triton.language as tl
except ImportError:          # no triton: the torch path
    triton = None


def usable(X: torch.Tensor) -> bool:
    return decode_triton.usable(X) and X.dtype in (torch.float32, torch.bfloat16, torch.float16)


if triton is not None:
    @triton.jit
    def _hc_tail(a_ptr, base_ptr, scale_ptr, x_ptr, u_ptr, post_ptr, m_ptr, n, D, eps, ITERS: tl.constexpr,
                 NP: tl.constexpr, BD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        W = n * (n + 2)
        i = tl.arange(0, NP)
        live = i < n
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        arow = a_ptr + t * W
        pre = tl.sigmoid(tl.load(arow + i, mask=live, other=0.0) * s0 + tl.load(base_ptr + i, mask=live, other=0.0))
        pre = tl.where(live, pre + eps, 0.0)
        post = 2 * tl.sigmoid(tl.load(arow + n + i, mask=live, other=0.0) * s1
                              + tl.load(base_ptr + n + i, mask=live, other=0.0))
        tl.store(post_ptr + t * n + i, post, mask=live)
        r = i[:, None]
        c = i[None, :]
        cell = (r < n) & (c < n)
        z = tl.load(arow + 2 * n + r * n + c, mask=cell, other=0.0) * s2 \
            + tl.load(base_ptr + 2 * n + r * n + c, mask=cell, other=0.0)
        z = tl.where(c < n, z, float("-inf"))          # a padded column takes no share of its row's softmax
        z = z - tl.max(z, 1)[:, None]
        e = tl.exp(z)
        M = tl.where(cell, e / tl.sum(e, 1)[:, None] + eps, 0.0)
        M = M / (tl.sum(M, 0)[None, :] + eps)          # columns first, then (rows, columns) ITERS - 1 times
        for _ in range(ITERS - 1):
            M = M / (tl.sum(M, 1)[:, None] + eps)
            M = M / (tl.sum(M, 0)[None, :] + eps)
        tl.store(m_ptr + t * n * n + r * n + c, M, mask=cell)
        # u = sum_j pre_j X_j, in float32, rounded once to X's dtype
        xrow = x_ptr + t * n * D
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            xs = tl.load(xrow + i[:, None] * D + d[None, :], mask=live[:, None] & (d[None, :] < D), other=0.0)
            u = tl.sum(pre[:, None] * xs.to(tl.float32), 0)
            tl.store(u_ptr + t * D + d, u.to(u_ptr.dtype.element_ty), mask=d < D)


def hc_tail(a: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, X: torch.Tensor, iters: int, eps: float):
    """a [T, (2+n)n] float32 (the projection of the normed streams), base, scale, X [T, n, D] -> (u [T, D] in X's
    dtype, post [T, n] float32, M [T, n, n] float32): hc_split's pre / post / Sinkhorn / weighted sum."""
    T, n, D = X.shape
    u = torch.empty(T, D, dtype=X.dtype, device=X.device)
    post = torch.empty(T, n, dtype=torch.float32, device=X.device)
    M = torch.empty(T, n, n, dtype=torch.float32, device=X.device)
    _hc_tail[(T,)](a.contiguous(), base.float().contiguous(), scale.float().contiguous(), X.contiguous(), u, post, M,
                   n, D, eps, ITERS=iters, NP=max(2, triton.next_power_of_2(n)), BD=512, num_warps=4)
    return u, post, M
