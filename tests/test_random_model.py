"""`random:` models (waste/random_model.py, runtime/generated.py): weights generated in memory from a seed, no files.
The same spec gives the same logits and another seed other ones; a rank's experts are byte for byte the single
process's experts of those ids; expert parallel over 2 gloo processes gives one process's bits; `waste bench` takes
one; bad specs are refused by name."""
import json
import subprocess
import sys

import pytest
import torch
from k3_release import TEXT
from test_expert_parallel import ENV, TWO_GPUS, one_and_two_processes

from waste.convert.synthetic import qwen3_moe_config
from waste.engine import Engine
from waste.errors import WasteError
from waste.random_model import RandomModel, parse


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    """name -> spec: tiny configs of two families (the presets are real sizes), experts in three formats."""
    d = tmp_path_factory.mktemp("random")
    (d / "q.json").write_text(json.dumps(qwen3_moe_config()))
    (d / "k3.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": TEXT, "eos_token_id": 0}))
    return {"qwen3_moe": f"random:{d / 'q.json'}", "qwen3_moe_q4": f"random:{d / 'q.json'},experts=q4,seed=3",
            "kimi_k3_mxfp4": f"random:{d / 'k3.json'},experts=mxfp4,layers=4"}


def logits(spec: str) -> torch.Tensor:
    with Engine.load(spec, dtype="float32") as eng:
        m = eng.model
        return m.forward(torch.arange(3, 20), m.new_state(), 0)


def test_same_seed_same_logits_other_seed_other_logits(specs):
    for spec in specs.values():
        a = logits(spec)
        assert torch.isfinite(a).all() and a.std() > 0.1, spec
        assert torch.equal(a, logits(spec)), spec
    other = specs["qwen3_moe"] + ",seed=1"
    assert not torch.equal(logits(specs["qwen3_moe"]), logits(other))


def test_a_ranks_experts_are_the_single_process_experts_of_its_ids(specs):
    for spec in specs.values():
        r = RandomModel(spec, "cpu")
        whole = r.expert_store(torch.float32, None, _fits())
        layers = {l: list(range(n)) for l, n in ((int(k), v["num_experts"])
                                                 for k, v in r.manifest["experts"]["layers"].items())}
        odd = {l: [e for e in ids if e % 2] for l, ids in layers.items()}
        part = r.expert_store(torch.float32, odd, _fits())
        assert part.n_slots * 2 == whole.n_slots
        for l, ids in odd.items():
            for e in ids:
                assert torch.equal(part.slot_tensor(part.slot_of[(l, e)]), whole.slot_tensor(whole.slot_of[(l, e)]))
        # distinct experts differ (the seed is per id), and the codes are not all one value
        a, b = (whole.slot_tensor(whole.slot_of[(l, e)]) for l, e in ((min(layers), 0), (min(layers), 1)))
        assert not torch.equal(a, b) and len(torch.unique(a)) > 16


def _fits():
    class Plan:
        budget_bytes = bank_bytes = 0
    return Plan()


def test_expert_parallel_over_two_gloo_ranks_is_bit_identical(specs, tmp_path):
    """Both fresh processes: a forward at another thread count earlier in a process moves the last bits of K3's
    CPU path afterwards (seen with this file's first test run in the reference's process)."""
    one_and_two_processes([f"{n}={s}" for n, s in specs.items()], tmp_path, "cpu")


@TWO_GPUS
def test_expert_parallel_over_two_gpus_is_bit_identical(specs, tmp_path):
    """NCCL, a GPU per process: the experts generated on each GPU, one process on one GPU as the reference."""
    one_and_two_processes([f"{n}={s}" for n, s in specs.items()], tmp_path, "cuda")


def test_a_generated_store_queues_no_reads(specs):
    """A residency call outside the one-row GPU path (a prompt's rows, on a GPU) reaches the read queueing with no
    misses: a generated store has no bank readers, so it must return before looking one up (it raised KeyError)."""
    with Engine.load(specs["qwen3_moe_q4"]) as eng:
        ex = eng.experts
        layer = next(iter(ex.owned))
        assert ex._make_resident(layer, [0, 1]) == {}
        assert ex.stats.misses == 0


def test_bench_takes_a_random_model(specs):
    r = subprocess.run([sys.executable, "-m", "waste", "bench", specs["qwen3_moe_q4"], "-n", "4", "--prompt-len", "8",
                        "--json"], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["family"] == "qwen3_moe" and out["decode"]["tokens"] == 4 and out["decode"]["misses"] == 0
    assert out["budget_bytes"] == out["bank_bytes"] > 0
    p = subprocess.run([sys.executable, "-m", "waste", "plan", specs["kimi_k3_mxfp4"], "--expert-parallel", "2",
                        "--json"], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr
    assert [r["experts_per_layer"] for r in json.loads(p.stdout)["ranks"]] == [[4] * 3, [4] * 3]   # 8 experts


def test_presets_are_the_real_shapes():
    q = RandomModel("random:qwen3-30b-a3b,experts=q4", "cpu").manifest
    assert (q["config"]["hidden_size"], q["config"]["moe"]["num_experts"], len(q["experts"]["layers"])) == (2048, 128, 48)
    k = RandomModel("random:kimi-k3,experts=mxfp4,layers=8", "cpu").manifest
    c = k["config"]
    assert (c["hidden_size"], c["moe"]["num_experts"], c["moe"]["top_k"], c["moe"]["expert_hidden"]) == (7168, 896, 16, 3584)
    assert [l["attn"] for l in c["layers"]] == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"]
    assert [l["mlp"] for l in c["layers"]] == ["dense"] + ["moe"] * 7
    full = RandomModel("random:kimi-k3", "cpu").manifest["config"]["layers"]
    assert len(full) == 93 and sum(l["attn"] == "mla" for l in full) == 24 and full[92]["attn"] == "mla"
    kl = RandomModel("random:kimi-linear-48b-a3b,experts=q4", "cpu").manifest
    c = kl["config"]
    assert (c["hidden_size"], c["moe"]["num_experts"], c["moe"]["top_k"], len(kl["experts"]["layers"])) == (2304, 256, 8, 26)
    assert [l["attn"] for l in c["layers"]][:8] == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"]
    assert c["layers"][26]["attn"] == "mla" and c["layers"][0]["mlp"] == "dense"
    g = RandomModel("random:glm-5.3-flash,experts=q4", "cpu").manifest
    c = g["config"]
    assert (c["hidden_size"], c["moe"]["num_experts"], c["moe"]["top_k"], len(g["experts"]["layers"])) == (4096, 288, 8, 42)
    assert [l["attn"] for l in c["layers"]][:8] == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"]
    assert (c["mla"]["qk_nope_head_dim"], c["mhc"]["hc_mult"], c["swiglu_limit"]) == (256, 4, 10.0)
    cut = RandomModel("random:glm-5.3-flash,layers=5", "cpu").manifest["config"]     # its three per-layer lists cut
    assert [l["mlp"] for l in cut["layers"]] == ["dense"] * 3 + ["moe"] * 2 and len(cut["dsa"]["indexer_types"]) == 5


def test_kimi_linear_generates_the_trunk_its_release_converts_to(releases):
    """The oracle fixture's Kimi-Linear config: every trunk tensor the converted release holds, by name, with its
    values' count (A_log's stored layout is [1, 1, H, 1]), and a model that runs: the same seed, the same logits."""
    import math

    from safetensors import safe_open

    _, src, cont = releases["kimi_linear"]
    spec = f"random:{src / 'config.json'}"
    with safe_open(str(cont / "trunk.safetensors"), "pt") as f:
        stored = {n: math.prod(f.get_slice(n).get_shape()) for n in f.keys()}
    assert {n: math.prod(s) for n, s in RandomModel(spec, "cpu").spec} == stored
    a = logits(spec)
    assert torch.isfinite(a).all() and a.std() > 0.1 and torch.equal(a, logits(spec))


def test_glm5_generates_the_trunk_its_release_converts_to(tmp_path):
    """GLM-5.3's oracle fixture (KDA, DSA-MLA with a shared indexer layer, mHC, dense then sparse MLPs): every trunk
    tensor the converted release holds, by name and values' count, and a model that runs, the same for one seed."""
    import math

    import transformers
    from fixtures import save_release
    from packaging.version import Version
    from safetensors import safe_open
    from test_oracle_glm5 import glm5_model

    from waste.convert.convert import convert

    if Version(transformers.__version__) < Version("5.24"):     # the GPU machine's own transformers (5.17)
        pytest.skip(f"the GLM-5.3 fixture needs transformers 5.24's config (this has {transformers.__version__})")
    src = save_release(glm5_model(), tmp_path / "src")
    cont = convert(src, tmp_path / "glm5.waste", experts="bf16", trunk="bf16", progress=False)
    spec = f"random:{src / 'config.json'}"
    with safe_open(str(cont / "trunk.safetensors"), "pt") as f:
        stored = {n: math.prod(f.get_slice(n).get_shape()) for n in f.keys()}
    assert {n: math.prod(s) for n, s in RandomModel(spec, "cpu").spec} == stored
    a = logits(spec)
    assert torch.isfinite(a).all() and a.std() > 0.1 and torch.equal(a, logits(spec))


@pytest.mark.parametrize("spec, why", [
    ("random:nope", "neither a preset"),
    ("random:qwen3-30b-a3b,layers=x", "layers must be a whole number"),
    ("random:qwen3-30b-a3b,layers=49", "layers=49: choose 1 to 48"),
    ("random:qwen3-30b-a3b,depth=2", "is not an option of a random model"),
    ("random:qwen3-30b-a3b,experts=vq3", "experts=vq3 cannot be generated"),
])
def test_bad_specs_are_refused_by_name(spec, why):
    with pytest.raises(WasteError, match=why):
        parse(spec)


def test_a_model_too_large_is_refused_by_name(specs):
    with pytest.raises(WasteError, match="do not fit beside the trunk"):
        Engine.load(specs["qwen3_moe"], dtype="float32", budget="100K")


def test_a_family_without_trunk_shapes_is_refused(tmp_path):
    from test_oracle_deepseek import deepseek_model

    (tmp_path / "c.json").write_text(deepseek_model().config.to_json_string())
    with pytest.raises(WasteError, match="does not list its trunk shapes"):
        RandomModel(f"random:{tmp_path / 'c.json'}", "cpu")


def test_the_generated_store_sets_everything_the_cache_sets(releases, specs):
    """GeneratedExperts builds the cache's state itself (no banks to read): an attribute ExpertCache's __init__
    gains later must be added there too, or the methods it inherits break on random models."""
    from waste.container import open_container
    from waste.runtime.cache import ExpertCache

    c = open_container(releases["qwen3_moe"][2])
    try:
        cache = ExpertCache(c, None, torch.float32, preload=False)
        gen = RandomModel(specs["qwen3_moe"], "cpu").expert_store(torch.float32, None, _fits())
        assert set(vars(cache)) - set(vars(gen)) == set()
        cache.close()
    finally:
        c.close()
