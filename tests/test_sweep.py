"""`waste sweep`: arms of one model in one process; routing agreement as set and rank apart."""
import subprocess
import sys

import pytest
import torch

import waste
from waste.convert.convert import convert
from waste.errors import WasteError
from waste.runtime.sweep import agreement, parse_arm, sweep


def test_agreement_counts_a_swap_as_the_same_set_but_not_the_same_rank():
    ref = {0: torch.tensor([[1, 2], [3, 4]]), 1: torch.tensor([[5, 6], [7, 0]])}
    got = {0: torch.tensor([[2, 1], [3, 4]]), 1: torch.tensor([[5, 6], [7, 1]])}
    a = agreement(ref, got)
    assert a["set"] == 7 / 8 and a["rank"] == 5 / 8
    # an arm routing to fewer experts is compared over its ranks only
    assert agreement(ref, {0: torch.tensor([[1], [4]]), 1: torch.tensor([[5], [7]])}) == {"set": 0.75, "rank": 0.75}


@pytest.mark.parametrize("text", ["nocolon", ":--budget 1G", "x:--bogus 3", "x:--threads 0", "x:--budget lots"])
def test_a_bad_arm_is_refused_by_name(text):
    with pytest.raises(WasteError, match="--arm"):
        parse_arm(text)


def test_sweep_arms_in_one_process(releases, tmp_path):
    _, src, c = releases["qwen3_moe"]
    q8 = convert(src, tmp_path / "q8.waste", experts="q8", trunk="bf16", progress=False)
    engines = {None: waste.load(c, dtype="float32", preload=False),
               str(q8): waste.load(q8, dtype="float32", preload=False)}
    try:
        ws = engines[None].plan.working_set_bytes
        arms = [parse_arm(t) for t in ("base:", f"small:--budget {ws} --threads 1", "nopf:--no-prefetch --budget "
                                       f"{ws} --compute-threads 1", "k1:--experts-per-token 1",
                                       "chunk:--prefill-chunk 5", f"q8:--model {q8}")]
        defaults = dict(budget=None, context=512, threads=2, prefetch=True, prefill_chunk=None, verify=True,
                        direct=True)
        r = sweep(engines, arms, defaults, repeat=2, n=6, prompt_len=12, feed="random", routing="model", text=None)
        by = {a["name"]: a for a in r["arms"]}
        assert list(by) == ["base", "small", "nopf", "k1", "chunk", "q8"] and all(a["runs"] == 2 for a in r["arms"])
        # the budget, reader / compute threads and prefetch change no bits: the same routing, rank for rank
        for name in ("base", "small", "nopf"):
            assert by[name]["set_agreement"] == by[name]["rank_agreement"] == 1.0, name
        assert by["small"]["budget_bytes"] == ws < by["base"]["budget_bytes"]
        assert by["small"]["decode_bytes_read"]["median"] > by["base"]["decode_bytes_read"]["median"]
        assert by["small"]["decode_hit_rate"]["median"] < by["base"]["decode_hit_rate"]["median"]
        assert by["chunk"]["prefill_chunk"] == 5 and by["chunk"]["set_agreement"] > 0.9
        # another format routes nearly alike; a set is never less alike than its ranks
        assert 0.5 < by["q8"]["rank_agreement"] <= by["q8"]["set_agreement"] <= 1.0
        assert by["q8"]["model"] == str(q8)
        assert by["k1"]["experts_per_token"] == 1 and by["k1"]["rank_agreement"] <= by["k1"]["set_agreement"]
        # the engines are left as they were loaded
        assert engines[None].model.top_k == 2 and engines[None].model.experts is engines[None].experts
    finally:
        for e in engines.values():
            e.close()


def test_cli_sweep_refuses_another_model_and_a_missing_arm(releases):
    q, k = (str(releases[f][2]) for f in ("qwen3_moe", "kimi_linear"))
    r = subprocess.run([sys.executable, "-m", "waste", "sweep", q], capture_output=True, text=True)
    assert r.returncode == 1 and "give at least one --arm" in r.stderr
    r = subprocess.run([sys.executable, "-m", "waste", "sweep", q, "--arm", "a:", "--arm", f"b:--model {k}"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "not a container of the same model" in r.stderr and "Traceback" not in r.stderr


def test_cli_sweep_prints_one_row_per_arm(releases):
    q = str(releases["qwen3_moe"][2])
    r = subprocess.run([sys.executable, "-m", "waste", "sweep", q, "--arm", "a:", "--arm", "b:--no-prefetch --budget 64K",
                        "--repeat", "1", "-n", "2", "--prompt-len", "4", "--context", "64"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [l.split() for l in r.stdout.splitlines() if l.split() and l.split()[0] in ("a", "b")]
    assert [x[0] for x in rows] == ["a", "b"] and all(x[-2:] == ["100.00%", "100.00%"] for x in rows)
    assert "round 1/1 b:" in r.stderr
