"""Latent MoE (Kimi K3): routed experts read and write a narrower latent. The layer projects its input down once
(routed_expert_down_proj), the selected experts run in the latent, and their weighted sum is normed
(routed_expert_norm, when the release has it) and projected back up once (routed_expert_up_proj). The norm comes
after the sum, as mlx-lm's `kimi_k3` applies it."""
from __future__ import annotations

from torch import Tensor

from ..quant.linear import linear
from .norm import rms_norm


def to_latent(x: Tensor, w: dict, prefix: str) -> Tensor:
    return linear(x, w[f"{prefix}routed_expert_down_proj.weight"])


def from_latent(y: Tensor, w: dict, prefix: str, eps: float) -> Tensor:
    norm = w.get(f"{prefix}routed_expert_norm.weight")
    if norm is not None:
        y = rms_norm(y, norm, eps)
    return linear(y, w[f"{prefix}routed_expert_up_proj.weight"])
