"""MoE routers: which experts each token goes to, and with what weight. Routing math in float32."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import decode_triton, router_cpu


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()      # no operator at all when it already is


def softmax_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """Qwen3-MoE / Mixtral: softmax over all experts, top-k, optional renormalisation."""
    if router_cpu.usable(x, weight):         # one decode row on the CPU: one numba call instead of five operators
        return router_cpu.softmax_topk_row(x, weight, top_k, norm_topk_prob)
    if decode_triton.router_row_usable(x, weight):      # a GPU decode row: logits and tail in one launch
        return decode_triton.router_row(x, weight, top_k, norm_topk_prob)
    logits = F.linear(_f32(x), _f32(weight))
    if x.shape[0] == 1 and decode_triton.usable(logits):    # a GPU decode row: softmax, top-k, renorm in one launch
        return decode_triton.softmax_topk_tail(logits, top_k, norm_topk_prob)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, idx


def sigmoid_grouped_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                         n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float):
    """DeepSeek-V3 / Kimi (noaux_tc): sigmoid scores; the correction bias chooses, the scores weigh."""
    scores = torch.sigmoid(F.linear(_f32(x), _f32(weight)))
    choice = scores + _f32(bias) if bias is not None else scores
    n, E = choice.shape
    if n_group > 1:
        group_scores = choice.view(n, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False)[1], True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    idx = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, idx


def biased_topk_softmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int):
    """gpt-oss: logits with a bias, top-k of the logits, softmax over those k only."""
    logits = F.linear(_f32(x), _f32(weight), _f32(bias))
    top, idx = torch.topk(logits, top_k, dim=-1)
    return F.softmax(top, dim=-1), idx
