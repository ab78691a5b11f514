"""RMS normalisation, computed in float32 (or float64) whatever the activation dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import decode_triton, norm_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    if norm_cpu.usable(x, weight):
        return norm_cpu.rms_rows(x, weight, eps)
    if decode_triton.norm_usable(x, weight):     # CUDA rows: one launch, the float32 weight read as it is
        return decode_triton.rms_rows(x, weight, eps)
    # torch's op, one call instead of eight: bit-identical to the lines below for float32 on torch 2.13's CPU (every
    # shape tried, 64-7168 wide); on a GPU for every dtype (one launch; tests/test_cuda.py bounds its bf16 error)
    if dt in (torch.float32, torch.float64) or x.is_cuda:
        return F.rms_norm(x, (x.shape[-1],), weight if weight.dtype == dt else weight.to(dt), eps)
    xf = x.to(torch.promote_types(dt, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dt) * xf.to(dt)

