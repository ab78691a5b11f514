"""Streaming under a small budget for the families whose MoE layers differ most from the fixture's: DeepSeek-V3
(grouped top-k over 16 experts, shared experts) and GLM-5.3 (mHC streams, DSA). Under one working set of cache the
experts are read from disk and evicted all the time; the logits and the greedy tokens must be bit-identical to the
run with the whole bank resident."""
import sys

sys.modules.setdefault("fla", None)

import pytest
import torch
from fixtures import prompt, save_release

import waste
from waste.convert.convert import convert
from waste.quant.quality import greedy, logits_over


def build(family):
    if family == "glm5_next":
        from test_oracle_glm5 import glm5_model
        return glm5_model()
    from test_oracle_deepseek import deepseek_model
    return deepseek_model()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm5_next"])
def test_small_budget_is_bit_identical_to_resident(family, tmp_path):
    src = save_release(build(family), tmp_path / "src")
    out = convert(src, tmp_path / "m.waste", experts="bf16", trunk="bf16", progress=False)
    ids = prompt(40, seed=6)
    with waste.load(out, dtype="float32") as eng:
        want, want_tokens = logits_over(eng, ids.tolist()), greedy(eng, ids[:8].tolist(), 16)
        ws = eng.plan.working_set_bytes
    with waste.load(out, dtype="float32", budget=ws, preload=False) as eng:
        got, got_tokens = logits_over(eng, ids.tolist()), greedy(eng, ids[:8].tolist(), 16)
        stats = eng.experts.stats
        assert stats.misses > 0 and stats.evictions > 0          # it really streamed
    assert torch.equal(got, want)
    assert got_tokens == want_tokens and len(got_tokens) == 16
