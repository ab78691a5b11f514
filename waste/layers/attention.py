"""Grouped-query attention with RoPE (full or partial) and optional per-head q/k RMSNorm (Qwen3), over a growing KV
cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..quant.linear import linear
from . import attention_cpu, decode_triton
from .norm import rms_norm
from .rope import apply_rope, apply_rope_table, rope_cos_sin, rotate_half_matrix
from .rows import Rows

_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class GQAConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    qk_norm: bool
    eps: float
    rotary_dim: int | None = None     # partial rotary: only the first rotary_dim dimensions of a head rotate


class KVCache:
    """Keys (after rotary) and values [T, kv_heads, head_dim] of the tokens so far (layers/rows.py: appending
    shares the buffer, which doubles when full, instead of copying the cache)."""

    __slots__ = ("_k", "_v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, capacity: int = 0):
        self._k, self._v = Rows(k, capacity), Rows(v, capacity)

    @staticmethod
    def empty(cfg: GQAConfig, dtype, capacity: int = 0, device=None) -> "KVCache":
        z = torch.empty(0, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        return KVCache(z, z.clone(), capacity)

    @property
    def k(self) -> torch.Tensor:
        return self._k.data

    @property
    def v(self) -> torch.Tensor:
        return self._v.data

    def append(self, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """The cache with these tokens' keys and values after the others (this one unchanged)."""
        out = KVCache.__new__(KVCache)
        out._k, out._v = self._k.append(k), self._v.append(v)
        return out

    def can_put(self, T: int = 1) -> bool:
        return self._k.can_put(T) and self._v.can_put(T)

    def put(self, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> "KVCache":
        """append() at the positions `at` (a tensor; Rows.put): for a captured decode step."""
        out = KVCache.__new__(KVCache)
        out._k, out._v = self._k.put(k, at), self._v.put(v, at)
        return out

    def advance(self, T: int = 1) -> "KVCache":
        out = KVCache.__new__(KVCache)
        out._k, out._v = self._k.advance(T), self._v.advance(T)
        return out

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.buffer, self._v.buffer

    def reset(self) -> "KVCache":
        out = KVCache.__new__(KVCache)
        out._k, out._v = self._k.reset(), self._v.reset()
        return out

    def __len__(self):
        return len(self._k)


def causal_softmax_attend(q, k, v, scale: float, start: int) -> torch.Tensor:
    """q [T, H, d], k/v [S, G, dv] with S = start + T and H a multiple of G (grouped-query: query head h reads
    key/value head h // (H / G), without copying the cache H / G times); query t sees keys <= start + t.
    Softmax in float32."""
    T, H, d = q.shape
    S, G = k.shape[0], k.shape[1]
    qg = q.view(T, G, H // G, d)
    scores = torch.einsum("tgrd,sgd->grts", qg, k) * scale
    if T > 1:
        mask = torch.arange(S)[None, :] > (start + torch.arange(T))[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
    p = F.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return torch.einsum("grts,sgd->tgrd", p, v).reshape(T, H, v.shape[-1])


def sdpa_attend(q, k, v, start: int) -> torch.Tensor:
    """causal_softmax_attend through torch's fused attention (its CPU flash kernel: one op, float32 accumulation,
    grouped-query heads read in place). q [T, H, d], k/v [S, G, d]."""
    T, S = q.shape[0], k.shape[0]
    mask, causal = None, False
    if T > 1:
        if start == 0:
            causal = True                   # torch's is_causal is top-left aligned: right only when S == T
        else:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(start)
    # a leading batch dimension: without it torch takes its unfused reference path (5x slower here)
    args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    kw = dict(attn_mask=mask, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    if q.device.type == "cuda":
        # not cuDNN's: it plans anew for every key length, ~10 ms a call in decode (docs/LEARNED.md §10)
        with sdpa_kernel(_CUDA_SDPA):
            o = F.scaled_dot_product_attention(*args, **kw)
    else:
        o = F.scaled_dot_product_attention(*args, **kw)
    return o[0].transpose(0, 1)


def masked_attend(q, k, v, keep: torch.Tensor) -> torch.Tensor:
    """Attention of q [T, H, d] over all of k / v [L, G, d] where keep [T, L] (bool) allows: the fixed-shape form
    a captured decode step uses (the keys past the position masked, not sliced off)."""
    args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    kw = dict(attn_mask=keep, enable_gqa=q.shape[1] != k.shape[1])
    if q.device.type == "cuda":
        with sdpa_kernel(_CUDA_SDPA):
            o = F.scaled_dot_product_attention(*args, **kw)
    else:
        o = F.scaled_dot_product_attention(*args, **kw)
    return o[0].transpose(0, 1)


def gqa_forward(x: torch.Tensor, w: dict, cfg: GQAConfig, cache: KVCache, rope, static=None):
    """One GQA layer over one sequence's new rows x [T, hidden]; rope: (cos, sin, R) from layers/rope.py's
    RopeTable.at and its R, or the positions [T]. w may hold q, k and v stacked as `qkv_proj.weight` (fuse_rows).
    static: (positions tensor [T], L[, (cos, sin) tables]) for a captured decode step: the rows are put at the
    positions and attention reads the first L rows of the cache's buffer, those past the positions masked (the cache
    can_put T rows); with the rope tables a GPU row takes decode_triton's kernels (no mask, no L)."""
    T = x.shape[0]
    H, KV, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if "qkv_proj.weight" in w:
        qkv = linear(x, w["qkv_proj.weight"], w.get("qkv_proj.bias"))
    else:
        qkv = torch.cat([linear(x, w[f"{p}_proj.weight"], w.get(f"{p}_proj.bias")) for p in "qkv"], dim=-1)
    if static is None and isinstance(rope, tuple) and attention_cpu.usable(qkv, cache.k):
        # one decode row on the CPU: norms, rotary, the cache write and attention in one call
        n, grown = len(cache), KVCache.__new__(KVCache)
        (kb, grown._k), (vb, grown._v) = cache._k.claim(1), cache._v.claim(1)
        o = attention_cpu.gqa_row(qkv, H, KV, w.get("q_norm.weight") if cfg.qk_norm else None,
                                  w.get("k_norm.weight"), cfg.eps, rope[0], rope[1], kb, vb, n, cfg.rotary_dim)
        return linear(o, w["o_proj.weight"]), grown
    if static is not None and len(static) > 2 and T == 1:
        at, _, (cos_t, sin_t) = static
        kb, vb = cache.buffers()
        if decode_triton.qk_rope_usable(qkv, cos_t, kb, d, cfg.rotary_dim):
            # a captured GPU decode row: q/k norm, rotary and the cache write in one launch, attention in another
            q = decode_triton.qk_rope_put(qkv, H, KV, d, w.get("q_norm.weight") if cfg.qk_norm else None,
                                          w.get("k_norm.weight"), cfg.eps, cos_t, sin_t, at, kb, vb)
            o = decode_triton.attend_row(q, kb, vb, at)
            return linear(o.reshape(T, H * d), w["o_proj.weight"]), cache.advance(1)
    q, k, v = qkv.view(T, H + 2 * KV, d).split((H, KV, KV), dim=1)
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm.weight"], cfg.eps)
        k = rms_norm(k, w["k_norm.weight"], cfg.eps)
    if isinstance(rope, tuple):
        cos, sin, R = rope
        q, k = apply_rope_table(q, cos, sin, R), apply_rope_table(k, cos, sin, R)
    else:
        cos, sin = rope_cos_sin(rope, d, cfg.rope_theta, x.dtype, cfg.rotary_dim)
        if cfg.rotary_dim and cfg.rotary_dim < d:
            R, cos, sin = rotate_half_matrix(d, x.dtype, x.device, cfg.rotary_dim), cos[:, None], sin[:, None]
            q, k = apply_rope_table(q, cos, sin, R), apply_rope_table(k, cos, sin, R)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if static is not None:
        at, L = static[:2]
        cache = cache.put(k, v, at)
        kb, vb = cache.buffers()
        keep = torch.arange(L, device=x.device)[None, :] <= at[:, None]
        o = masked_attend(q, kb[:L], vb[:L], keep)
        return linear(o.reshape(T, H * d), w["o_proj.weight"]), cache
    start = len(cache)
    cache = cache.append(k, v)
    o = sdpa_attend(q, cache.k, cache.v, start)
    return linear(o.reshape(T, H * d), w["o_proj.weight"]), cache
