"""One decode row of grouped-query attention on the CPU in one numba call: q/k norm, rotary, the cache write and
the attention over the cached rows.

Through torch these are about twenty operators per layer (two norms, six for rotary, the splits and views, two
cache copies, the fused attention and its transposes), each costing more in dispatch than in arithmetic at one row
(docs/LEARNED.md §10). The arithmetic is the same as layers/attention.py's: RMSNorm in float32, rotate-half
rotary, softmax in float32 over positions 0..n with scale 1/sqrt(d); its last bits differ from torch's kernels,
so a row takes this path by its shape alone (one row, float32, CPU), never by what else runs beside it.
"""
from __future__ import annotations

import functools

import numpy as np
import torch



@functools.lru_cache(maxsize=1)
def _kernel():
    from .cpu_kernels import gqa_row

    return gqa_row


@functools.lru_cache(maxsize=1)
def _follow():
    from ..numba_ptr import follow_torch_threads      # imports numba: lazily

    return follow_torch_threads


def usable(qkv: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """One float32 row over a float32 cache, or a bf16 row over a bf16 cache (models above 2 GiB), on the CPU."""
    return (qkv.shape[0] == 1 and qkv.dtype in (torch.float32, torch.bfloat16) and qkv.device.type == "cpu"
            and k_buf.dtype == qkv.dtype)


def gqa_row(qkv: torch.Tensor, H: int, G: int, q_norm, k_norm, eps: float, cos: torch.Tensor, sin: torch.Tensor,
            k_buf: torch.Tensor, v_buf: torch.Tensor, n: int, rotary_dim: int | None = None) -> torch.Tensor:
    """qkv [1, (H + 2G) * d] of the row at position n -> its attention output [1, H * d]; writes its key (normed,
    rotated) and value into row n of k_buf / v_buf [capacity, G, d] (contiguous). cos / sin: the position's [d]
    tables (contiguous views); q_norm / k_norm [d] or None; rotary_dim: partial rotary (the first rotary_dim
    dimensions of each head rotate, the rest pass). A bf16 row computes in float32 (its cache read widened, its
    key and value rounded to bf16 as they are written) and its output is rounded to bf16."""
    if qkv.dtype != torch.float32:
        f = (lambda t: t if t is None else t.float())
        o = gqa_row(qkv.float(), H, G, f(q_norm), f(k_norm), eps, f(cos), f(sin), k_buf, v_buf, n, rotary_dim)
        return o.to(qkv.dtype)
    d = k_buf.shape[-1]
    out = np.empty((1, H * d), np.float32)
    use_norm = q_norm is not None
    qkv = qkv if qkv.is_contiguous() else qkv.contiguous()
    _follow()()
    _kernel()(qkv.data_ptr(), H, G, d, rotary_dim or d, q_norm.data_ptr() if use_norm else 0, k_norm.data_ptr() if use_norm else 0,
              use_norm, np.float32(eps), cos.data_ptr(), sin.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(),
              k_buf.shape[0], n, k_buf.dtype == torch.bfloat16, out.reshape(H, d))
    return torch.from_numpy(out)
