"""Qwen3-Next (`qwen3_next`) against transformers 5.24.0 (`Qwen3NextForCausalLM`, its pure-torch Gated DeltaNet:
fla is kept out) on a tiny random checkpoint written by its own save_pretrained, in float32: Gated DeltaNet layers
with more value heads than key heads beside gated full attention (3:1), partial rotary, zero-centred norms, a dense
first layer (`mlp_only_layers`), routed experts with a gated shared expert; the release's MTP weights left out."""
import json
import sys

sys.modules.setdefault("fla", None)

import pytest
import torch
from fixtures import (VOCAB, check_greedy, check_logits_and_routes, check_split, converted, oracle_model, prompt,
                      save_release)
from safetensors.torch import load_file, save_file



def qwen3_next_model(seed=0, **over):
    from transformers import Qwen3NextConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, mlp_only_layers=[0], rms_norm_eps=1e-6, max_position_embeddings=512,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
              tie_word_embeddings=False, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    kw.update(over)
    m = oracle_model(Qwen3NextConfig(**kw), seed)
    with torch.no_grad():       # decays in a range a trained model has (A_log randomised near 1 decays fast)
        g = torch.Generator().manual_seed(seed + 1)
        for layer in m.model.layers:
            if hasattr(layer, "linear_attn"):
                la = layer.linear_attn
                la.A_log.copy_((torch.rand(la.A_log.shape, generator=g) * 2 - 2).to(torch.bfloat16).float())
    return m


@pytest.fixture(scope="module")
def qn(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next")
    hf = qwen3_next_model()
    src = save_release(hf, root / "src")
    t = load_file(str(src / "model.safetensors"))     # the release's MTP weights beside the model's
    t["mtp.fc.weight"] = torch.ones(64, 128)
    t["mtp.norm.weight"] = torch.ones(64)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    d = converted(root, hf, src, "qn")
    yield d
    d["eng"].close()


def test_logits_and_routing_match_transformers(qn):
    # more than one DeltaNet chunk (64); measured 2.1e-6 (the bound is 1e-4)
    check_logits_and_routes(qn["hf"], qn["eng"].model, prompt(100), 2e-5, [1, 2, 3], "qwen3_next")


def test_prefill_then_decode_equals_one_forward(qn):
    check_split(qn["eng"].model, prompt(40, seed=2), 8, 1e-5, "qwen3_next")      # measured 8.9e-7


def test_greedy_continuation_matches_transformers(qn):
    check_greedy(qn["hf"], qn["eng"], prompt(8, seed=3))


def test_mtp_is_left_out_with_a_note_and_info_names_the_features(qn, capsys):
    from waste.cli import main

    m = json.loads((qn["out"] / "manifest.json").read_text())
    assert m["family"] == "qwen3_next" and [l["attn"] for l in m["config"]["layers"]] == ["gdn"] * 3 + ["gqa"]
    assert not any(k.startswith("mtp.") for k in m["trunk"]["crc32"])
    assert any("multi-token-prediction" in n for n in m["notes"]), m.get("notes")
    assert main(["info", str(qn["out"])]) in (0, None)
    out = capsys.readouterr().out
    assert "Gated DeltaNet on 3 of 4 layers (2 q/k heads x 16, 4 value heads x 16" in out
    assert "partial rotary: 4 of 16 channels per head" in out
