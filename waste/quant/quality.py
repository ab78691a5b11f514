"""Measuring what a storage format costs in output quality (benchmarks/quant_quality.py, tests/test_quant.py).

- per matrix: relative error ||W - unpack(pack(W))|| / ||W||
- end to end, against a reference container of the same release: mean KL(ref || quantized) of the next-token
  distributions over held-out text, top-1 agreement, and greedy agreement (how many of N greedily generated
  tokens equal the reference's, from several prompts).
Both engines compute in float32, so the only difference is the stored weights.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


def rel_error(fmt, w: torch.Tensor) -> float:
    d = fmt.unpack(fmt.pack(w), tuple(w.shape), torch.float32)
    return ((d - w.float()).norm() / w.float().norm()).item()


def logits_over(engine, ids: list[int], window: int = 512, decode: bool = False) -> torch.Tensor:
    """float32 logits [len(ids), V] over consecutive windows, each from a fresh state (so that every format sees
    the same contexts); decode: each window's tokens fed one at a time, through the decode-row kernels."""
    m = engine.model
    out = []
    for s in range(0, len(ids), window):
        w, state = ids[s:s + window], m.new_state()
        if decode:
            out += [m.forward(torch.tensor(w[i:i + 1]), state, i) for i in range(len(w))]
        else:
            out.append(m.forward(torch.tensor(w), state, 0))
    return torch.cat(out).float()


def kl_top1(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    p, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    return kl, (ref.argmax(-1) == got.argmax(-1)).double().mean().item()


def greedy(engine, prompt_ids: list[int], n: int) -> list[int]:
    saved, engine.eos_ids = engine.eos_ids, set()
    try:
        return engine.generate(prompt_ids, max_tokens=n).token_ids
    finally:
        engine.eos_ids = saved


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens generated alike before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class Quality:
    kl: float
    top1: float
    greedy_same: int      # tokens equal before the first difference, summed over prompts
    greedy_total: int

    def row(self) -> dict:
        return asdict(self)


def compare(ref_engine, engine, ids: list[int], prompts: list[list[int]], n: int = 32, ref_cache: dict | None = None,
            window: int = 512, decode: bool = False) -> Quality:
    """Quality of `engine` against `ref_engine` (ref_cache, if given, memoizes the reference's outputs); decode: the
    logits of tokens fed one at a time (the decode-row kernels) rather than of whole windows (prefill's)."""
    cache = ref_cache if ref_cache is not None else {}
    if "logits" not in cache:
        cache["logits"] = logits_over(ref_engine, ids, window, decode)
        cache["greedy"] = [greedy(ref_engine, p, n) for p in prompts]
    kl, top1 = kl_top1(cache["logits"], logits_over(engine, ids, window, decode))
    same = sum(agreement(r, greedy(engine, p, n)) for r, p in zip(cache["greedy"], prompts))
    return Quality(kl, top1, same, n * len(prompts))
