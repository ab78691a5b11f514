"""SwiGLU MLPs: the dense / shared-expert form and the routed experts' form."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def dense_mlp(x: torch.Tensor, w: dict, prefix: str = "") -> torch.Tensor:
    return swiglu(x, w[f"{prefix}gate_proj.weight"], w[f"{prefix}up_proj.weight"], w[f"{prefix}down_proj.weight"])
