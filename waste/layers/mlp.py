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


def oai_glu_act(g: torch.Tensor, u: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts: (clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g') with g' = min(g, L)."""
    g = g.clamp(max=limit)
    u = u.clamp(-limit, limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           limit: float | None = None) -> torch.Tensor:
    return linear(swiglu_act(linear(x, gate), linear(x, up), limit), down)


def dense_mlp(x: torch.Tensor, w: dict, prefix: str = "", limit: float | None = None) -> torch.Tensor:
    return swiglu(x, w[f"{prefix}gate_proj.weight"], w[f"{prefix}up_proj.weight"], w[f"{prefix}down_proj.weight"],
                  limit)


def situ_act(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """Kimi K3's SiTU-GLU: (b tanh(g / b) sigmoid(g)) * (lb tanh(u / lb)), both factors soft-capped (b = beta,
    lb = linear_beta; no cap on u when it is None). Computed in float32 at least, returned in g's dtype."""
    dt = g.dtype
    cd = torch.promote_types(dt, torch.float32)
    g, u = g.to(cd), u.to(cd)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(dt)


def situ_mlp(x: torch.Tensor, w: dict, prefix: str, beta: float, linear_beta: float | None) -> torch.Tensor:
    """A SiTU-GLU MLP (K3's dense layer and shared experts): down(situ(gate x, up x))."""
    g, u = linear(x, w[f"{prefix}gate_proj.weight"]), linear(x, w[f"{prefix}up_proj.weight"])
    return linear(situ_act(g, u, beta, linear_beta), w[f"{prefix}down_proj.weight"])
