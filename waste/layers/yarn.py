"""Rotary embedding of MLA's rope slice: plain RoPE or YaRN (DeepSeek-V3 / Kimi-K2), interleaved pairs or halves.

The config is the manifest's `mla.rope` dict (architectures.md §2.2):
    {"type": "default" | "yarn", "theta", "interleave",
     yarn only: "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor" (null: derived from mscale / mscale_all_dim), "truncate"}
YaRN blends interpolated (theta * factor) and extrapolated frequencies with a linear ramp between the correction
dims of beta_fast and beta_slow; cos/sin are multiplied by the attention factor, and the softmax scale by
mscale(factor, mscale_all_dim)^2 (`softmax_mscale`). Angles are computed in float32 as transformers does.

Interleaved rotary (DeepSeek's own layout) rotates pairs (x0, x1), (x2, x3), ...; like transformers, the result is
returned de-interleaved ([rotated evens ; rotated odds]) for q and k alike, so dot products are unchanged.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: dict, dim: int) -> tuple[Tensor, float]:
    """(inv_freq [dim // 2] float32, attention factor that multiplies cos and sin)."""
    base = float(rope.get("theta", 10000.0))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if rope.get("type", "default") == "default":
        return 1.0 / pos_freqs, 1.0
    if rope["type"] != "yarn":
        raise ValueError(f"unsupported rope type {rope['type']!r}")
    factor = float(rope["factor"])
    original = rope["original_max_position_embeddings"]
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
        if ms and ms_all:
            attention_factor = yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, ms_all)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_mscale(rope: dict | None) -> float:
    """What YaRN multiplies MLA's softmax scale by: mscale(factor, mscale_all_dim)^2 (1 without YaRN)."""
    if not rope or rope.get("type", "default") == "default":
        return 1.0
    ms_all = rope.get("mscale_all_dim") or 0
    if not ms_all:
        return 1.0
    m = yarn_get_mscale(float(rope["factor"]), ms_all)
    return m * m


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def make_rope(rope: dict, dim: int):
    """The MLA rotary hook: (q_pe [T, H, r], k_pe [T, r], positions [T]) -> (q_pe, k_pe)."""
    inv_freq, attention_factor = rope_frequencies(rope, dim)
    interleave = bool(rope.get("interleave", False))

    def apply(q_pe: Tensor, k_pe: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]   # [T, r/2]
        if interleave:
            cos = (freqs.cos() * attention_factor).to(q_pe.dtype)
            sin = (freqs.sin() * attention_factor).to(q_pe.dtype)

            def rot(x, c, s):
                x1, x2 = x[..., 0::2], x[..., 1::2]
                return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

            return rot(q_pe, cos[:, None], sin[:, None]), rot(k_pe, cos, sin)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * attention_factor).to(q_pe.dtype)
        sin = (emb.sin() * attention_factor).to(q_pe.dtype)
        return (q_pe * cos[:, None] + _rotate_half(q_pe) * sin[:, None]), (k_pe * cos + _rotate_half(k_pe) * sin)

    return apply
