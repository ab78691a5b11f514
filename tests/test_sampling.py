"""Sampling against transformers' logits warpers (temperature, top-k, top-p, min-p): the tokens our sampler draws
from a fixed set of logits follow the distribution transformers' warpers leave, drawn 20000 times."""
import pytest
import torch

from waste.runtime.sampling import Sampler, SamplingParams

DRAWS = 20_000
# total variation between the draws and the reference: the sampling noise of 20000 draws over a dozen tokens is about
# 0.01 (measured 0.004 to 0.010 here); a wrong filter moves whole tokens' mass (0.05 and up on these logits)
TV = 0.025


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """transformers' warpers in generate()'s order (temperature, top-k, top-p, min-p), then softmax."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    x = logits[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    for w in warpers:
        x = w(ids, x)
    return torch.softmax(x[0], -1)


LOGITS = torch.randn(64, generator=torch.Generator().manual_seed(11)) * 1.5


@pytest.mark.parametrize("params", [
    dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.2, min_p=0.1), dict(temperature=0.9, top_k=12, top_p=0.9),
    dict(temperature=0.7, top_p=0.9, min_p=0.05),        # `waste run`'s defaults
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_draws_follow_transformers_warpers(params):
    want = reference(LOGITS, **params)
    s = Sampler(SamplingParams(seed=0, **params))
    counts = torch.bincount(torch.tensor([s(LOGITS) for _ in range(DRAWS)]), minlength=len(LOGITS)).double()
    got = counts / DRAWS
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())   # no token
    # outside transformers' kept set is ever drawn, and every token it keeps with 1% or more is drawn
    assert set(torch.nonzero(want >= 0.01).flatten().tolist()) <= set(torch.nonzero(counts).flatten().tolist())
    tv = 0.5 * (got - want.double()).abs().sum().item()
    print(f"{params}: total variation {tv:.4f} over {int((want > 0).sum())} kept tokens")
    assert tv < TV


def test_temperature_zero_is_argmax_and_seeds_reproduce():
    assert Sampler(SamplingParams(temperature=0.0))(LOGITS) == int(LOGITS.argmax())
    a, b = (Sampler(SamplingParams(temperature=1.0, seed=5)) for _ in range(2))
    c = Sampler(SamplingParams(temperature=1.0, seed=6))
    draws = [[s(LOGITS) for _ in range(50)] for s in (a, b, c)]
    assert draws[0] == draws[1] and draws[0] != draws[2]
