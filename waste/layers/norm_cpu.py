"""RMS normalisation of float32 rows on the CPU, one numba call for all rows.

torch's F.rms_norm on the CPU runs as about eight operators (pow, mean, add, rsqrt, mul, casts), ~20 us at a decode
row, which was a fifth of the bundled model's decode step (docs/LEARNED.md §10). Every row goes through the same
loop whatever the number of rows, so a row's bits do not depend on what else is in the batch.
"""
from __future__ import annotations

import functools

import numpy as np
import torch



@functools.lru_cache(maxsize=1)
def _kernel():
    from .cpu_kernels import rms_rows

    return rms_rows


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.is_contiguous() and x.dim() >= 1 and x.numel() > 0
            and not x.requires_grad)


def rms_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., h] float32, weight [h] float32 -> x / rms(x) * weight, the shape of x."""
    h = x.shape[-1]
    x = x if x.is_contiguous() else x.contiguous()
    out = np.empty(tuple(x.shape), np.float32)      # x's shape: a view afterwards would be one more operator
    _kernel()(x.data_ptr(), weight.data_ptr(), x.numel() // h, h, float(eps), out.ctypes.data)
    return torch.from_numpy(out)
