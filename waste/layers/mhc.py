"""Manifold-constrained hyper-connections (mHC), as pure functions of tensors (architectures.md §5).

The residual is n = hc_mult parallel streams X [T, n, D]; the embeddings are copied into every stream. Around each
sublayer (attention, then MLP) one hyper-connection, with weights fn [(2+n)n, nD], base [(2+n)n], scale [3]:
    x~   = X.flatten() * rsqrt(mean(X^2) + rms_eps)            (unweighted RMSNorm, float32)
    a    = x~ fn^T  ->  a_pre [n], a_post [n], a_res [n, n]
    pre  = sigmoid(scale0 a_pre + base_pre) + eps
    post = 2 sigmoid(scale1 a_post + base_post)
    M    = softmax_row(scale2 a_res + base_res) + eps, then Sinkhorn: columns, then (iters - 1) x (rows, columns)
    u    = sum_j pre_j X_j                                   the sublayer's input (before its own pre-norm)
    X'_k = post_k y + sum_j M[j, k] X_j                      y = sublayer(u): note the TRANSPOSE of M
At the end GLM-5.3 collapses the streams with an unweighted mean (DeepSeek-V4 uses a learned head instead).
The weights are computed in float32 whatever the activation dtype; the streams stay in the activation dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import mhc_triton


@dataclass(frozen=True)
class MHCConfig:
    hc_mult: int          # n, the number of residual streams
    sinkhorn_iters: int   # 20 on GLM-5.3
    eps: float            # hc_eps: added after sigmoid / softmax and inside every Sinkhorn normalisation
    norm_eps: float       # the model's rms_norm_eps, for the unweighted RMSNorm of the flattened streams


def hc_split(X: Tensor, fn: Tensor, base: Tensor, scale: Tensor, cfg: MHCConfig) -> tuple[Tensor, Tensor, Tensor]:
    """One hyper-connection's read side: (u [T, D] in X's dtype, post [T, n], M [T, n, n]) from X [T, n, D]."""
    T, n, D = X.shape
    cd = torch.promote_types(X.dtype, torch.float32)
    flat = X.reshape(T, n * D).to(cd)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.norm_eps)
    a = F.linear(flat, fn.to(cd))
    if cd == torch.float32 and mhc_triton.usable(X):      # one launch for the ~130 below (mhc_triton.py)
        return mhc_triton.hc_tail(a, base, scale, X, cfg.sinkhorn_iters, cfg.eps)
    a_pre, a_post, a_res = a.split([n, n, n * n], dim=-1)
    base, scale = base.to(cd), scale.to(cd)
    pre = torch.sigmoid(a_pre * scale[0] + base[:n]) + cfg.eps
    post = 2 * torch.sigmoid(a_post * scale[1] + base[n:2 * n])
    M = torch.softmax(a_res.view(T, n, n) * scale[2] + base[2 * n:].view(n, n), dim=-1) + cfg.eps
    M = M / (M.sum(dim=-2, keepdim=True) + cfg.eps)
    for _ in range(cfg.sinkhorn_iters - 1):
        M = M / (M.sum(dim=-1, keepdim=True) + cfg.eps)
        M = M / (M.sum(dim=-2, keepdim=True) + cfg.eps)
    u = (pre[..., None] * X).sum(dim=1).to(X.dtype)
    return u, post, M


def hc_merge(X: Tensor, y: Tensor, post: Tensor, M: Tensor) -> Tensor:
    """The write side: X'_k = post_k y + sum_j M[j, k] X_j, in X's dtype. X [T, n, D], y [T, D]."""
    dt = X.dtype
    return post.to(dt)[..., None] * y[:, None, :] + torch.matmul(M.to(dt).transpose(-1, -2), X)


def hc_expand(x: Tensor, n: int) -> Tensor:
    """The embeddings copied into n streams: [T, D] -> [T, n, D]."""
    return x[:, None, :].expand(-1, n, -1).contiguous()


def hc_mean(X: Tensor) -> Tensor:
    """GLM-5.3's final collapse: the unweighted mean of the streams, [T, n, D] -> [T, D]."""
    return X.mean(dim=1)
