"""DeepSeek-V3 (`deepseek_v3`, also Kimi-K2) against transformers 5.24.0 (`DeepseekV3ForCausalLM`) on a tiny random
checkpoint written by its own save_pretrained, in float32: MLA with q-LoRA and YaRN rotary (interleaved, mscale
!= mscale_all_dim so both YaRN factors matter), grouped top-k routing, a dense first layer, shared experts; the
release also carries an MTP layer (left out with a note) and, in a second copy, fp8 block weights."""
import json
import shutil
import sys

sys.modules.setdefault("fla", None)

import pytest
import torch
from fixtures import (check_greedy, check_logits_and_routes, check_split, converted, mtp_layer, oracle_model, prompt,
                      rel_l2, save_release)
from safetensors.torch import load_file, save_file

import waste
from waste.convert.convert import convert
from waste.layers.yarn import rope_frequencies, softmax_mscale

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
N_LAYERS = 4


def deepseek_model(seed=0, **over):
    from transformers import DeepseekV3Config

    kw = dict(vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
              n_group=4, topk_group=2, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
              q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
              rope_parameters=dict(YARN), max_position_embeddings=256, routed_scaling_factor=2.5,
              rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=0, tie_word_embeddings=False)
    kw.update(over)
    m = oracle_model(DeepseekV3Config(**kw), seed)
    return m


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    hf = deepseek_model()
    src = save_release(hf, root / "src")
    mtp_layer(src, N_LAYERS, (("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                              ("shared_head.norm.weight", (64,)), ("shared_head.head.weight", (384, 64))),
              {"num_nextn_predict_layers": 1})
    return converted(root, hf, src, "ds")


def test_yarn_frequencies_and_scales_match_transformers(ds):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = ds["hf"]
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf.config)
    rope = ds["eng"].container.config["mla"]["rope"]
    ours, our_factor = rope_frequencies(rope, 16)
    assert torch.equal(ours, inv) and our_factor == factor != 1.0
    attn = hf.model.layers[0].self_attn
    assert ds["eng"].model.mla_cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    assert softmax_mscale(rope) != 1.0


def test_release_config_as_deepseek_writes_it():
    """DeepSeek-V3's own config.json spelling (rope_scaling + rope_theta, topk_method, MTP count): the rotary and
    the softmax scale transformers derives from it."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from waste.convert.adapter_deepseek import DeepseekV3Adapter

    hf = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
              num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
              moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
              n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
              routed_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=1, num_nextn_predict_layers=1,
              max_position_embeddings=163840, rope_theta=10000, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
              rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"})
    cfg = DeepseekV3Adapter(hf).config
    assert [l["mlp"] for l in cfg["layers"][:4]] == ["dense"] * 3 + ["moe"] and cfg["mtp_layers"] == 1
    rope = cfg["mla"]["rope"]
    ref = DeepseekV3Config(**{k: v for k, v in hf.items() if k not in ("model_type", "topk_method", "scoring_func",
                                                                        "moe_layer_freq")})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](ref)
    ours, our_factor = rope_frequencies(rope, 64)
    assert torch.equal(ours, inv) and our_factor == factor == 1.0
    assert softmax_mscale(rope) == pytest.approx(yarn_apply_mscale(ref.rope_parameters, 1.0), rel=1e-12)
    assert softmax_mscale(rope) == pytest.approx((0.1 * __import__("math").log(40) + 1) ** 2, rel=1e-12)


def test_logits_and_routing_match_transformers(ds):
    # past original_max_position_embeddings (64): YaRN's interpolated band; measured 8.2e-7
    check_logits_and_routes(ds["hf"], ds["eng"].model, prompt(100), 8e-6, [1, 2, 3], "deepseek_v3")


def test_prefill_then_decode_equals_one_forward(ds):
    check_split(ds["eng"].model, prompt(40, seed=2), 6, 5e-6, "deepseek_v3")   # absorbed decode; measured 5.1e-7


def test_greedy_continuation_matches_transformers(ds):
    check_greedy(ds["hf"], ds["eng"], prompt(8, seed=3))


def test_mtp_layer_is_left_out_with_a_note(ds):
    m = json.loads((ds["out"] / "manifest.json").read_text())
    assert m["family"] == "deepseek_v3" and m["config"]["num_layers"] == N_LAYERS
    assert m["config"]["mtp_layers"] == 1
    assert not any(k.startswith(f"layers.{N_LAYERS}.") for k in m["trunk"]["crc32"])
    assert str(N_LAYERS) not in m["experts"]["layers"]
    assert any("multi-token-prediction layer 4" in n for n in m["notes"]), m.get("notes")


def test_fp8_block_release_converts_to_the_dequantized_weights(ds, tmp_path):
    """Every matrix but embeddings, head and router stored as fp8 e4m3 with weight_scale_inv blocks (128x128 over
    these small shapes: one ragged block each): the converted model equals transformers on the dequantized weights,
    and no scale companion is ever taken for a weight."""
    from test_convert import quantize_fp8, reference_dequant

    src = tmp_path / "fp8"
    shutil.copytree(ds["src"], src)
    t = load_file(str(src / "model.safetensors"))
    fp8, ref = {}, {}
    for name, w in t.items():
        if w.ndim == 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")) \
                and "layernorm" not in name:
            q, s = quantize_fp8(w.float())
            fp8[name], fp8[name.removesuffix(".weight") + ".weight_scale_inv"] = q, s
            ref[name] = reference_dequant(q, s)
        else:
            fp8[name] = ref[name] = w
    save_file(fp8, str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    out = convert(src, tmp_path / "fp8.waste", experts="f32", trunk="f32", progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert not any("scale_inv" in k for k in manifest["trunk"]["crc32"])
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(ds["src"], ref_dir)
    save_file({k: v for k, v in ref.items() if not k.startswith(f"model.layers.{N_LAYERS}.")},
              str(ref_dir / "model.safetensors"))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ref_dir, attn_implementation="eager", experts_implementation="eager",
                                              dtype=torch.float32).eval()
    eng = waste.load(out, dtype="float32")
    try:
        ids = prompt(24, seed=4)
        with torch.no_grad():
            want = hf(ids[None]).logits[0]
        got = eng.model.forward(ids, eng.model.new_state(), 0)
    finally:
        eng.close()
    print(f"fp8 {rel_l2(got, want):.2e}")
    assert rel_l2(got, want) < 7e-6          # measured 6.8e-7


def test_waste_info_and_run(ds, capsys):
    import os
    import subprocess

    from waste.cli import main

    def run(*args):
        p = subprocess.run([sys.executable, "-m", "waste", *map(str, args)], capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
        assert "Traceback" not in p.stderr and p.returncode == 0, p.stderr
        return p

    assert main(["info", str(ds["out"])]) in (0, None)
    assert "MLA rotary: yarn, theta 10000, interleaved, factor 4 over 64 positions" in capsys.readouterr().out
    default = convert(ds["src"], ds["root"] / "default.waste", progress=False)     # the default (quantized) formats
    r = run("run", default, "def fibonacci(n):", "-n", "8")
    assert "prompt" in r.stderr and "generated" in r.stderr
