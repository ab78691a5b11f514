"""Qwen3-Next's full attention: GQA whose q projection also yields a per-head output gate ([q; gate] per head),
per-head q/k RMSNorm, rotary on the first `rot_dim` channels of each head only, the output times sigmoid(gate)."""
from __future__ import annotations

import torch

from ..quant.linear import linear
from .attention import GQAConfig, KVCache, sdpa_attend
from .norm import rms_norm
from .rope import apply_rope_table


def gated_gqa_forward(x: torch.Tensor, w: dict, cfg: GQAConfig, cache: KVCache, rope: tuple, rot_dim: int
                      ) -> tuple[torch.Tensor, KVCache]:
    """x [T, hidden] -> (out [T, hidden], cache with these rows); rope: (cos, sin, R) [T, 1, rot_dim] of these
    rows' positions (layers/rope.py RopeTable.at and R). q_norm / k_norm weights as the norm multiplies them."""
    T = x.shape[0]
    H, KV, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = linear(x, w["q_proj.weight"]).view(T, H, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = linear(x, w["k_proj.weight"]).view(T, KV, d)
    v = linear(x, w["v_proj.weight"]).view(T, KV, d)
    q, k = rms_norm(q, w["q_norm.weight"], cfg.eps), rms_norm(k, w["k_norm.weight"], cfg.eps)
    cos, sin, R = rope
    q = torch.cat([apply_rope_table(q[..., :rot_dim], cos, sin, R), q[..., rot_dim:]], dim=-1)
    k = torch.cat([apply_rope_table(k[..., :rot_dim], cos, sin, R), k[..., rot_dim:]], dim=-1)
    start = len(cache)
    cache = cache.append(k, v)
    o = sdpa_attend(q, cache.k, cache.v, start) * torch.sigmoid(gate)
    return linear(o.reshape(T, H * d), w["o_proj.weight"]), cache
