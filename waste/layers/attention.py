"""Grouped-query attention with RoPE and optional per-head q/k RMSNorm (Qwen3), over a growing KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..quant.linear import linear
from .norm import rms_norm
from .rope import apply_rope, rope_cos_sin


@dataclass(frozen=True)
class GQAConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    qk_norm: bool
    eps: float


@dataclass
class KVCache:
    k: torch.Tensor   # [T, kv_heads, head_dim], keys after rotary
    v: torch.Tensor

    @staticmethod
    def empty(cfg: GQAConfig, dtype) -> "KVCache":
        z = torch.empty(0, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        return KVCache(z, z.clone())

    def __len__(self):
        return self.k.shape[0]


def causal_softmax_attend(q, k, v, scale: float, start: int) -> torch.Tensor:
    """q [T, H, d], k/v [S, H, dv] with S = start + T; query t sees keys <= start + t. Softmax in float32."""
    T, S = q.shape[0], k.shape[0]
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    if T > 1:
        mask = torch.arange(S)[None, :] > (start + torch.arange(T))[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
    p = F.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return torch.einsum("hts,shd->thd", p, v)


def gqa_forward(x: torch.Tensor, w: dict, cfg: GQAConfig, cache: KVCache, positions: torch.Tensor):
    T = x.shape[0]
    H, KV, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(x, w["q_proj.weight"], w.get("q_proj.bias")).view(T, H, d)
    k = linear(x, w["k_proj.weight"], w.get("k_proj.bias")).view(T, KV, d)
    v = linear(x, w["v_proj.weight"], w.get("v_proj.bias")).view(T, KV, d)
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm.weight"], cfg.eps)
        k = rms_norm(k, w["k_norm.weight"], cfg.eps)
    cos, sin = rope_cos_sin(positions, d, cfg.rope_theta, x.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    start = len(cache)
    cache = KVCache(torch.cat([cache.k, k]), torch.cat([cache.v, v]))
    rep = H // KV
    kk = cache.k.repeat_interleave(rep, dim=1) if rep > 1 else cache.k
    vv = cache.v.repeat_interleave(rep, dim=1) if rep > 1 else cache.v
    o = causal_softmax_attend(q, kk, vv, d ** -0.5, start)
    return linear(o.reshape(T, H * d), w["o_proj.weight"]), cache
