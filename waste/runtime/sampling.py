"""Choosing the next token: greedy, or temperature / top-k / top-p / min-p sampling with a seed."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 means no limit
    min_p: float = 0.0
    seed: int | None = None


class Sampler:
    def __init__(self, p: SamplingParams):
        self.p = p
        self.gen = torch.Generator().manual_seed(p.seed if p.seed is not None else random.getrandbits(63))

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.p
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        logits = logits.float() / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            cum = torch.cumsum(sp, 0)
            drop = cum - sp > p.top_p          # keep the smallest prefix whose mass reaches top_p
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, si, sp)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))
