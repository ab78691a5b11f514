"""Softmax top-k routing of one float32 decode row on the CPU in one numba call (layers/router.py's softmax_topk
is five torch operators: linear, softmax, topk, sum, div). Same arithmetic: float32 logits, softmax with the max
subtracted, the k largest in descending order (ties: the lower id first), renormalised when asked."""
from __future__ import annotations

import functools

import numpy as np
import torch



@functools.lru_cache(maxsize=1)
def _kernel():
    from .cpu_kernels import softmax_topk_row

    return softmax_topk_row


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.shape[0] == 1 and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.is_contiguous())


def softmax_topk_row(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """x [1, h] float32, weight [E, h] float32 -> (weights [1, k] float32, ids [1, k] int64)."""
    x = x if x.is_contiguous() else x.contiguous()
    w, ids = np.empty((1, top_k), np.float32), np.empty((1, top_k), np.int64)
    _kernel()(x.data_ptr(), weight.data_ptr(), x.shape[1], weight.shape[0], top_k, norm_topk_prob, w, ids)
    return torch.from_numpy(w), torch.from_numpy(ids)
