"""gpt-oss attention: GQA with biases on every projection, a learned logit per head (the "sink") that joins each
query's softmax and then drops out, and on alternate layers a sliding window (a query sees itself and the
window - 1 tokens before it). Half-split rotary from a (cos, sin) table, YaRN's attention factor folded into it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.linear import linear
from .attention import GQAConfig, KVCache
from .rope import apply_rope_table


def sink_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float, start: int,
                window: int | None) -> torch.Tensor:
    """q [T, H, d], k/v [S, G, d] with S = start + T; query t (position start + t) sees keys s <= start + t, and
    with a window only s > start + t - window. sinks [H]: one extra logit per head in the softmax, whose share of
    the probability goes nowhere. Softmax in float32 (at least)."""
    T, H, d = q.shape
    S, G = k.shape[0], k.shape[1]
    qg = q.view(T, G, H // G, d)
    scores = torch.einsum("tgrd,sgd->grts", qg, k) * scale
    pos = start + torch.arange(T, device=q.device)[:, None]
    keys = torch.arange(S, device=q.device)[None, :]
    masked = keys > pos
    if window is not None:
        masked |= keys <= pos - window
    if masked.any():
        scores = scores.masked_fill(masked, float("-inf"))
    cd = torch.promote_types(q.dtype, torch.float32)
    sink = sinks.to(cd).view(G, H // G, 1, 1).expand(G, H // G, T, 1)
    p = F.softmax(torch.cat([scores.to(cd), sink], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    return torch.einsum("grts,sgd->tgrd", p, v).reshape(T, H, v.shape[-1])


def sink_gqa_forward(x: torch.Tensor, w: dict, cfg: GQAConfig, cache: KVCache, rope: tuple,
                     window: int | None) -> tuple[torch.Tensor, KVCache]:
    """One gpt-oss attention layer over one sequence's new rows x [T, hidden]; rope: (cos, sin, R) of these rows'
    positions (layers/rope.py apply_rope_table's arguments). w: q/k/v/o projections with biases, `sinks` [H]."""
    T = x.shape[0]
    H, KV, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(x, w["q_proj.weight"], w.get("q_proj.bias")).view(T, H, d)
    k = linear(x, w["k_proj.weight"], w.get("k_proj.bias")).view(T, KV, d)
    v = linear(x, w["v_proj.weight"], w.get("v_proj.bias")).view(T, KV, d)
    cos, sin, R = rope
    q, k = apply_rope_table(q, cos, sin, R), apply_rope_table(k, cos, sin, R)
    start = len(cache)
    cache = cache.append(k, v)
    o = sink_attend(q, cache.k, cache.v, w["sinks"], d ** -0.5, start, window)
    return linear(o.reshape(T, H * d), w["o_proj.weight"], w.get("o_proj.bias")), cache
