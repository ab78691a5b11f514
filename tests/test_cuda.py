"""The CUDA path (`--device cuda`): the same model on the GPU gives the CPU's logits within float32 rounding and
the same greedy tokens, with every expert resident and with a budget that makes the GPU mirror refill. Skips
without a GPU (CI has none); run on the GPU machine (docs/LEARNED.md §10)."""
import pytest
import torch

import waste
from waste.convert.convert import convert
from waste.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (CI has none)")


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    cfg = qwen3_moe_config()
    write_random_qwen3_moe(root / "src", cfg, seed=0)
    return {fmt: convert(root / "src", root / f"m-{fmt}.waste", experts=fmt, trunk="bf16", progress=False)
            for fmt in ("bf16", "q8")}


@pytest.mark.parametrize("fmt", ["bf16", "q8"])
@pytest.mark.parametrize("small", [False, True])
def test_cuda_logits_and_tokens_match_cpu(container, fmt, small):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    budget = None
    if small:        # one working set: the GPU mirror is refilled as layers evict each other's experts
        with waste.load(container[fmt], dtype="float32") as eng:
            budget = eng.plan.working_set_bytes
    ids = list(range(3, 40))
    out = {}
    for device in ("cpu", "cuda"):
        with waste.load(container[fmt], dtype="float32", device=device, budget=budget) as eng:
            m = eng.model
            logits = m.forward(torch.tensor(ids), m.new_state(), 0)
            out[device] = (logits, eng.generate(ids, max_tokens=16).token_ids, eng.experts.stats.misses)
    a, b = out["cpu"][0], out["cuda"][0]
    assert b.device.type == "cpu"                    # logits come back to the host, where sampling runs
    assert (a - b).norm() / a.norm() < 1e-5
    assert out["cpu"][1] == out["cuda"][1]
    if small:
        assert out["cuda"][2] > 0                    # the mirror did refill
