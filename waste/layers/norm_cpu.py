"""RMS normalisation of float32 and bf16 rows on the CPU, one numba call for all rows.

torch's F.rms_norm on the CPU runs as about eight operators (pow, mean, add, rsqrt, mul, casts), ~20 us at a decode
row, which was a fifth of the bundled model's decode step (docs/LEARNED.md §10). Every row goes through the same
loop whatever the number of rows, so a row's bits do not depend on what else is in the batch. bf16 rows (the compute
dtype above 2 GiB) took seven operators, ~65 us a row on a streamed decode step's critical path (LEARNED §3l).
"""
from __future__ import annotations

import functools

import numpy as np
import torch



@functools.lru_cache(maxsize=3)
def _kernel(dtype: torch.dtype, weight: torch.dtype):
    from . import cpu_kernels

    if dtype == torch.float32:
        return cpu_kernels.rms_rows
    return cpu_kernels.rms_rows_bf16 if weight == torch.bfloat16 else cpu_kernels.rms_rows_bf16_w32


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype in (torch.float32, torch.bfloat16) and weight.dtype in (x.dtype, torch.float32)
            and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.is_contiguous() and x.dim() >= 1 and x.numel() > 0
            and not x.requires_grad)


def rms_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., h] float32 or bf16, weight [h] float32 or x's dtype (used as rounded to it) -> x / rms(x) * weight,
    the shape and dtype of x."""
    h = x.shape[-1]
    x = x if x.is_contiguous() else x.contiguous()
    if x.dtype == torch.float32:
        out = np.empty(tuple(x.shape), np.float32)      # x's shape: a view afterwards would be one more operator
        _kernel(x.dtype, weight.dtype)(x.data_ptr(), weight.data_ptr(), x.numel() // h, h, float(eps), out.ctypes.data)
        return torch.from_numpy(out)
    y = torch.empty(x.shape, dtype=x.dtype)
    _kernel(x.dtype, weight.dtype)(x.data_ptr(), weight.data_ptr(), x.numel() // h, h, float(eps), y.data_ptr())
    return y
