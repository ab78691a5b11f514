"""Attention residuals (Kimi K3): a sublayer's input is a learned softmax mix of the residual stream's block
summaries and the current block's partial sum, instead of the running residual alone.

Bookkeeping, as mlx-lm's `kimi_k3` does it: `blocks` starts empty and the partial sum is the embedding. Layer i
mixes for its attention input; if i is a multiple of the block size, the partial sum is frozen into a new block
and the partial sum restarts from the attention output, else the attention output adds to it; then it mixes
again for its MLP input, and the MLP output adds to the partial sum. The final norm reads one more mix.
Mixing weights: a candidate c scores (RMSNorm(c) * norm_weight) . proj_row, softmax over the candidates.
"""
from __future__ import annotations

import torch
from torch import Tensor


def res_key(norm_w: Tensor, proj_w: Tensor) -> Tensor:
    """norm weight * projection row, float32 [D]: a candidate's score is (c . key) * rsqrt(mean(c^2) + eps)."""
    return norm_w.float() * proj_w.float().reshape(-1)


def inv_rms(x: Tensor, eps: float) -> Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.rsqrt(xf.pow(2).mean(-1) + eps)


def res_mix(blocks: list[Tensor], scales: list[Tensor], partial: Tensor, key: Tensor, eps: float) -> Tensor:
    """The softmax mix of blocks [T, D] each (with their inv_rms [T]) and the partial sum [T, D]; the partial sum
    itself when there is no block yet. Scores and weights in float32; the result in partial's dtype."""
    if not blocks:
        return partial
    cd = torch.promote_types(partial.dtype, torch.float32)
    k = key.to(cd)
    cands = blocks + [partial]
    logits = torch.stack([(c.to(cd) @ k) * s.to(cd) for c, s in zip(cands, scales + [inv_rms(partial, eps)])])
    p = torch.softmax(logits, dim=0)
    out = sum(p[j, :, None] * cands[j].to(cd) for j in range(len(cands)))
    return out.to(partial.dtype)
