"""Choosing the next token: greedy, or temperature / top-k / top-p / min-p sampling with a seed; before either,
the penalties and logit_bias (OpenAI's and vLLM's definitions) and, where a grammar constrains the sequence, its
mask (applied only when the grammar refuses the unconstrained draw: see waste/text/grammar.py)."""
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
    presence_penalty: float = 0.0     # minus this once for every token already generated
    frequency_penalty: float = 0.0    # minus this times how often a token was generated
    repetition_penalty: float = 1.0   # a token of the prompt or the output: logit / p if positive, * p if not
    logit_bias: tuple = ()            # ((token id, bias added to its logit), ...); a {id: bias} dict is taken too

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v))
                                                               for k, v in self.logit_bias.items())))

    @property
    def adjusts(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


class Sampler:
    def __init__(self, p: SamplingParams):
        self.p = p
        self.gen = torch.Generator().manual_seed(p.seed if p.seed is not None else random.getrandbits(63))

    def adjust(self, logits: torch.Tensor, prompt=(), output=()) -> torch.Tensor:
        """The penalties and the bias applied (a new tensor; the logits as they are when there are none)."""
        p = self.p
        if not p.adjusts:
            return logits
        logits = logits.float().clone()
        V = logits.shape[-1]
        if p.repetition_penalty != 1.0 and (prompt or output):
            seen = torch.tensor(sorted({t for t in (*prompt, *output) if 0 <= t < V}), dtype=torch.long)
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and output:
            ids = torch.tensor([t for t in output if 0 <= t < V], dtype=torch.long)
            counts = torch.bincount(ids, minlength=V).to(logits.dtype)
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        for tid, bias in p.logit_bias:
            if 0 <= tid < V:
                logits[tid] += bias
        return logits

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
