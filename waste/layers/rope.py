"""Rotary position embedding, half-rotation layout (as HF Llama/Qwen): angles in float32.

Partial rotary (`rotary_dim` < head_dim, GLM-4.5): the first rotary_dim dimensions of each head rotate (the
half-rotation within them), the rest pass through; the tables carry cos 1 and sin 0 there, so one formula serves
both and the pass-through dimensions come out exactly as they went in."""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 rotary_dim: int | None = None):
    """cos / sin [T, head_dim] of the positions; past rotary_dim (when given) cos 1 and sin 0."""
    r = rotary_dim or head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.int64, device=positions.device).float() / r))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if r < head_dim:
        cos = torch.cat((cos, cos.new_ones(cos.shape[0], head_dim - r)), dim=-1)
        sin = torch.cat((sin, sin.new_zeros(sin.shape[0], head_dim - r)), dim=-1)
    return cos.to(dtype), sin.to(dtype)


class RopeTable:
    """cos / sin of every position up to the planned context, built once (positions past it are computed when
    asked: the table is a cache, never a limit). `at(start, T)` -> (cos, sin) [T, d] of positions start..start+T-1,
    the same values rope_cos_sin gives."""

    def __init__(self, head_dim: int, theta: float, capacity: int, dtype: torch.dtype, device=None,
                 rotary_dim: int | None = None):
        self.head_dim, self.theta, self.dtype, self.rotary_dim = head_dim, theta, dtype, rotary_dim
        cos, sin = rope_cos_sin(torch.arange(capacity, device=device), head_dim, theta, dtype, rotary_dim)
        self.cos, self.sin = cos[:, None, :], sin[:, None, :]        # [positions, 1, d]: broadcast over heads
        self.R = rotate_half_matrix(head_dim, dtype, device, rotary_dim)

    def at(self, start: int, T: int):
        """(cos, sin) [T, 1, d] of positions start .. start + T - 1."""
        if start + T <= self.cos.shape[0]:
            return self.cos[start:start + T], self.sin[start:start + T]
        positions = torch.arange(start, start + T, device=self.cos.device)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, self.dtype, self.rotary_dim)
        return cos[:, None, :], sin[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def rotate_half_matrix(d: int, dtype: torch.dtype, device=None, rotary_dim: int | None = None) -> torch.Tensor:
    """R [d, d] with x @ R == cat(-x[d/2:], x[:d/2]): each output is one input times +-1 plus zeros, so the
    product is exact; one matmul instead of two slices, a negation and a concatenation. With rotary_dim r: the
    half-rotation of x[:r], zeros past it."""
    r = rotary_dim or d
    h = r // 2
    R = torch.zeros(d, d, dtype=dtype, device=device)
    R[h:r, :h] = -torch.eye(h, dtype=dtype, device=device)
    R[:h, h:r] = torch.eye(h, dtype=dtype, device=device)
    return R


def apply_rope_table(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """apply_rope with cos/sin [T, 1, d] (RopeTable.at) and R from rotate_half_matrix: three ops."""
    return torch.addcmul(x * cos, x @ R, sin)
