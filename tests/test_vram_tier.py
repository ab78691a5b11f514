"""The two-tier expert store (`--vram` below the host budget): a compute-tier slab holding the host slab's most
recently used records, copied up as layers need them. Checked on the CPU, where a tier of the same kind runs the
same mapping (on a GPU the tier is in its memory: tests/test_cuda.py), and the two-tier plan and its flags."""
import json
import subprocess
import sys

import pytest
import torch

from waste.container import open_container
from waste.convert.convert import convert
from waste.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe
from waste.models import build_model
from waste.quant.linear import assemble_trunk
from waste.runtime.cache import ExpertCache


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier")
    write_random_qwen3_moe(root / "src", qwen3_moe_config(), seed=2)
    return convert(root / "src", root / "m.waste", experts="bf16", trunk="bf16", progress=False)


def run(path, vram, prefetch=False):
    c = open_container(path)
    ex = ExpertCache(c, None, torch.float32, vram=vram, preload=False)
    ex.tier_prefetch = ex.wants_prefetch = prefetch       # (off by default: LEARNED §10)
    try:
        f32 = set(c.manifest["trunk"].get("f32_tensors", []))
        m = build_model(c.family, c.config, assemble_trunk(c.load_trunk(), c.manifest["trunk"]), ex, torch.float32,
                        f32, capacity=256)
        st = m.new_state()
        out = [m.forward(torch.arange(3, 30), st, 0)]
        tok, pos = int(out[0][-1].argmax()), 27
        for _ in range(8):
            out.append(m.forward(torch.tensor([tok]), st, pos))
            tok, pos = int(out[-1][-1].argmax()), pos + 1
        return torch.cat(out), ex
    finally:
        ex.close()
        c.close()


def test_a_small_tier_gives_the_same_bits_as_the_whole_bank(container):
    ref, _ = run(container, None)
    k = qwen3_moe_config()["num_experts_per_tok"]
    rec = open_container(container).manifest["experts"]["record_bytes"]
    out, ex = run(container, 3 * k * rec)            # three layers' worth of experts: records copied up and evicted
    assert ex.tiered and ex.n_dev == 3 * k < ex.n_slots
    assert ex.tier_copies > ex.n_dev                 # the tier did evict and refill
    assert torch.equal(out, ref)


def test_a_tier_of_one_record_computes_in_rounds(container):
    """A tier smaller than one layer's experts: the layer is computed in rounds of what the tier holds, the same
    bits again."""
    ref, _ = run(container, None)
    rec = open_container(container).manifest["experts"]["record_bytes"]
    out, ex = run(container, rec)
    assert ex.n_dev == 1 and torch.equal(out, ref)


def test_tier_prefetch_copies_predicted_records_and_keeps_the_bits(container):
    """Next-layer prefetch over the link: the predicted records go up while a layer computes, into slots that
    layer does not read; with it on or off, the same bits as the whole bank, and some prefetched records used
    (how many is the router's business: this random model's routing is hard to guess)."""
    ref, _ = run(container, None)
    k = qwen3_moe_config()["num_experts_per_tok"]
    rec = open_container(container).manifest["experts"]["record_bytes"]
    on, ex_on = run(container, 4 * k * rec, prefetch=True)
    off, ex_off = run(container, 4 * k * rec)
    assert ex_on.tier.prefetches > 0 and ex_off.tier.prefetches == 0
    assert 0 < ex_on.tier.prefetch_used <= ex_on.tier.prefetches
    assert ex_on.tier.copy_calls <= ex_on.tier_copies + ex_on.tier.prefetches    # runs of slots: one copy each
    assert torch.equal(on, ref) and torch.equal(off, ref)


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "waste", *map(str, args)], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_plan_device_cuda_json_has_both_budgets(container):
    rec = open_container(container).manifest["experts"]["record_bytes"]
    p = cli("plan", container, "--device", "cuda", "--vram", 3 * rec + 5, "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["device"] == "cuda" and d["vram_budget_bytes"] == 3 * rec           # whole records
    assert d["host_budget_bytes"] == d["budget_bytes"] and d["bank_bytes"] > d["vram_budget_bytes"]
    assert d["tiers"] == "vram over pinned host"
    big = json.loads(cli("plan", container, "--device", "cuda", "--vram", "100G", "--json").stdout)
    assert big["vram_budget_bytes"] == big["budget_bytes"] and big["tiers"] == "mirror"   # at most the host budget
    assert json.loads(cli("plan", container, "--device", "cpu", "--json").stdout)["device"] == "cpu"
    auto = json.loads(cli("plan", container, "--json").stdout)["device"]       # --device auto, the default
    assert auto == ("cuda" if torch.cuda.is_available() else "cpu")


def test_vram_flag_errors_are_clear(container):
    p = cli("run", container, "hi", "-n", "1", "--vram", "1G", "--device", "cpu")
    assert p.returncode == 1 and "--vram sizes the GPU's expert tier: it needs --device cuda" in p.stderr
    p = cli("plan", container, "--device", "cuda", "--vram", "10")
    assert p.returncode == 1 and "smaller than one expert record" in p.stderr
    if not torch.cuda.is_available():
        p = cli("plan", container, "--device", "cuda")
        assert p.returncode == 1 and "give --vram SIZE" in p.stderr
