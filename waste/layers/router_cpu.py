"""Softmax top-k routing of one float32 decode row on the CPU in one numba call (layers/router.py's softmax_topk
is five torch operators: linear, softmax, topk, sum, div). Same arithmetic: float32 logits, softmax with the max
subtracted, the k largest in descending order (ties: the lower id first), renormalised when asked."""
from __future__ import annotations

import functools

import numpy as np
import torch

from .numba_ptr import at


@functools.lru_cache(maxsize=1)
def _kernel():
    import numba

    _at = at()

    @numba.njit(fastmath=True, cache=True)
    def softmax_topk_row(x_p, w_p, h, E, k, renorm, weights, ids):
        x, W = _at(x_p, (h,), np.float32), _at(w_p, (E, h), np.float32)
        p = np.empty(E, np.float32)
        m = -np.inf
        for e in range(E):
            row = W[e]
            acc = np.float32(0.0)
            for i in range(h):
                acc += row[i] * x[i]
            p[e] = acc
            m = max(m, acc)
        tot = np.float32(0.0)
        for e in range(E):
            p[e] = np.exp(p[e] - m)
            tot += p[e]
        for e in range(E):
            p[e] /= tot
        picked = 0
        s = np.float32(0.0)
        for j in range(k):
            best = -1
            for e in range(E):
                if p[e] >= 0 and (best < 0 or p[e] > p[best]):
                    best = e
            ids[0, j] = best
            weights[0, j] = p[best]
            s += p[best]
            p[best] = -1.0            # taken (probabilities are >= 0)
            picked += 1
        if renorm:
            for j in range(picked):
                weights[0, j] /= s

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
