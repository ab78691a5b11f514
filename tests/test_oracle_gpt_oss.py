"""gpt-oss (`gpt_oss`) against transformers 5.24.0 (`GptOssForCausalLM`) on a tiny random release in the format
OpenAI ships: trunk in bf16, each layer's experts fused and in mxfp4 (`*_blocks` / `*_scales`, written here from
random codes), biases beside them. The oracle is transformers loading that same release (its mxfp4 quantizer
dequantizes on a CPU); the engine keeps the experts in mxfp4 as released and computes in float32. Sliding window 8
(so prompts longer than it reach the window), YaRN over 64 positions (prompts past it reach the interpolated band),
sinks and biases randomised away from zero."""
import json
import sys

sys.modules.setdefault("fla", None)

import pytest
import torch
from fixtures import (check_greedy, check_logits_and_routes, check_split, oracle_model, prompt, rel_l2, save_release,
                      split_and_whole)
from safetensors.torch import load_file, save_file

import waste
from waste.convert.convert import convert
from waste.errors import WasteError
from waste.layers.yarn import rope_frequencies

ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
KEEP_FLOAT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def gpt_oss_model(seed=0, **over):
    from transformers import GptOssConfig

    kw = dict(vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=256, rope_parameters=dict(ROPE), swiglu_limit=7.0, swiglu_alpha=1.702,
              eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    kw.update(over)
    m = oracle_model(GptOssConfig(**kw), seed)
    return m


def mxfp4_release(src, seed=5):
    """Rewrite a save_pretrained checkpoint the way OpenAI releases gpt-oss: bf16 trunk, every layer's fused experts
    as mxfp4 blocks [E, N, K/32, 16] and E8M0 scales [E, N, K/32] (random codes; scales near 1/sqrt(K))."""
    t = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in t.items():
        if k.endswith(("gate_up_proj", "down_proj")):
            E, K, N = v.shape                         # transformers' layout: [E, in, out]
            out[k + "_blocks"] = torch.randint(0, 256, (E, N, K // 32, 16), generator=g, dtype=torch.uint8)
            out[k + "_scales"] = (122 + torch.randint(0, 2, (E, N, K // 32), generator=g)).to(torch.uint8)
        else:
            out[k] = v.to(torch.bfloat16)
    save_file(out, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(dtype="bfloat16", quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": KEEP_FLOAT})
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def load_oracle(src):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    src = mxfp4_release(save_release(gpt_oss_model(), root / "src"))
    out = convert(src, root / "oss.waste", trunk="bf16", progress=False)
    eng = waste.load(out, dtype="float32")
    yield {"hf": load_oracle(src), "src": src, "out": out, "eng": eng, "root": root}
    eng.close()


def test_experts_are_kept_as_released(oss):
    m = json.loads((oss["out"] / "manifest.json").read_text())
    assert m["family"] == "gpt_oss"
    assert m["experts"]["format"] == "mxfp4" and m["experts"]["kept_as_released"]
    names = {p["name"] for p in m["experts"]["layout"]["parts"]}
    assert names == {"gate.blocks", "gate.scales", "up.blocks", "up.scales", "down.blocks", "down.scales",
                     "gate.bias", "up.bias", "down.bias"}
    # expert 3 of layer 1 in the bank: gate = the release's even rows, up = its odd rows, bytes unchanged
    rel = load_file(str(oss["src"] / "model.safetensors"))
    store = oss["eng"].experts
    list(store.resident(1, [torch.tensor([[3]])]))
    parts = store._slot_parts(store.slot_of[(1, 3)])
    blocks = rel["model.layers.1.mlp.experts.gate_up_proj_blocks"][3]
    assert torch.equal(parts["gate"]["blocks"], blocks[0::2].reshape(64, 32))
    assert torch.equal(parts["up"]["blocks"], blocks[1::2].reshape(64, 32))
    assert torch.equal(parts["down"]["scales"], rel["model.layers.1.mlp.experts.down_proj_scales"][3])
    assert torch.equal(parts["up"]["bias"], rel["model.layers.1.mlp.experts.gate_up_proj_bias"][3][1::2].float())


def test_yarn_frequencies_match_transformers(oss):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](oss["hf"].config)
    ours, our_factor = rope_frequencies(oss["eng"].container.config["gqa"]["rope"], 16)
    assert torch.equal(ours, inv) and our_factor == factor != 1.0


def test_logits_and_routing_match_transformers(oss):
    # past the window (8) and YaRN's original 64 positions; measured 2.5e-7 (the bound is 1e-4)
    check_logits_and_routes(oss["hf"], oss["eng"].model, prompt(100), 3e-6, [0, 1, 2, 3], "gpt_oss", router="router")


def test_prefill_then_decode_equals_one_forward(oss):
    # decode steps cross the window's edge; measured 2.5e-7
    check_split(oss["eng"].model, prompt(40, seed=2), 12, 3e-6, "gpt_oss")


def test_greedy_continuation_matches_transformers(oss):
    check_greedy(oss["hf"], oss["eng"], prompt(8, seed=3))


def test_float_release_converts_to_the_same_model(oss, tmp_path):
    """transformers' own save_pretrained layout ([E, in, out] floats, gate and up interleaved) of the dequantized
    model converts to the same logits, experts stored by the converter (bf16 here: exact), prefill and decode."""
    src = save_release(oss["hf"], tmp_path / "float")
    out = convert(src, tmp_path / "float.waste", experts="bf16", trunk="bf16", progress=False)
    eng = waste.load(out, dtype="float32")
    try:
        ids = prompt(30, seed=4)
        split, got = split_and_whole(eng.model, ids, 6)     # decode: the float kernel's gathered biases
        want = oss["eng"].model.forward(ids, oss["eng"].model.new_state(), 0)
    finally:
        eng.close()
    assert rel_l2(got, want) < 3e-6 and rel_l2(split, want) < 3e-6


def test_missing_or_misshapen_fused_experts_are_named(oss, tmp_path):
    import shutil

    src = tmp_path / "bad"
    shutil.copytree(oss["src"], src)
    t = load_file(str(src / "model.safetensors"))
    t["model.layers.2.mlp.experts.down_proj_scales"] = t["model.layers.2.mlp.experts.down_proj_scales"][:, :-1].contiguous()
    save_file(t, str(src / "model.safetensors"))
    with pytest.raises(WasteError, match=r"down_proj_scales has shape \[8, 63, 2\], expected \[8, 64, 2\]"):
        convert(src, tmp_path / "bad.waste", progress=False)
    del t["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(t, str(src / "model.safetensors"))
    with pytest.raises(WasteError, match="model.layers.2.mlp.experts.down_proj_scales is missing"):
        convert(src, tmp_path / "bad.waste", progress=False)


def test_waste_info_names_the_features(oss, capsys):
    from waste.cli import main

    assert main(["info", str(oss["out"])]) in (0, None)
    out = capsys.readouterr().out
    assert "gpt_oss" in out
    assert "attention sinks: a learned logit per head (4 heads)" in out
    assert "sliding-window attention on 2 of 4 layers (window 8)" in out
    assert "expert GLU: (clamp(up, +-7) + 1) * g * sigmoid(1.702 g)" in out
    assert "rotary: yarn, theta 150000, factor 4 over 64 positions" in out
