"""RMS normalisation, computed in float32 (or float64) whatever the activation dtype."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    xf = x.to(torch.promote_types(dt, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dt) * xf.to(dt)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's output norm: RMSNorm in float32 (weight included), then * sigmoid(gate), back to x's dtype."""
    dt = x.dtype
    cd = torch.promote_types(dt, torch.float32)
    xf = x.to(cd)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(cd) * xf * torch.sigmoid(gate.to(cd))).to(dt)
