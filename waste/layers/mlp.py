"""SwiGLU MLPs: the dense / shared-expert form and the routed experts' form."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.linear import linear


def swiglu_act(g: torch.Tensor, u: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(g) * u; with a limit (GLM-5.3, DeepSeek-V4: `swiglu_limit`) the clamped form
    silu(min(g, L)) * clamp(u, -L, L). The one activation of dense, shared and routed MLPs."""
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return F.silu(g) * u


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           limit: float | None = None) -> torch.Tensor:
    return linear(swiglu_act(linear(x, gate), linear(x, up), limit), down)


def dense_mlp(x: torch.Tensor, w: dict, prefix: str = "", limit: float | None = None) -> torch.Tensor:
    return swiglu(x, w[f"{prefix}gate_proj.weight"], w[f"{prefix}up_proj.weight"], w[f"{prefix}down_proj.weight"],
                  limit)
