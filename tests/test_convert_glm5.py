"""The converter on GLM-5.3-Flash releases: config handling checked against what the release says (seed 0.7.0:
the layer list, eos, learned *_scale parameters, fp8 companions, the wrapper's nesting, the vision tower)."""
import json
import os
import shutil
import subprocess
import sys

sys.modules.setdefault("fla", None)

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_oracle_glm5 import LAYER_TYPES, glm5_model, prompt

import waste
from waste.convert.convert import convert
from waste.errors import WasteError
from fixtures import save_release


@pytest.fixture(scope="module")
def rel(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5conv")
    hf = glm5_model()
    src = save_release(hf, root / "src")
    out = convert(src, root / "nested.waste", experts="bf16", trunk="bf16", progress=False)
    return {"hf": hf, "src": src, "out": out, "root": root}


def manifest(path):
    return json.loads((path / "manifest.json").read_text())


def test_nested_release_manifest(rel):
    m = manifest(rel["out"])
    c = m["config"]
    assert m["family"] == "glm5_next"
    # 0-based, straight from layer_types
    assert [l["attn"] for l in c["layers"]] == ["kda" if t == "linear_attention" else "mla" for t in LAYER_TYPES]
    assert [l["mlp"] for l in c["layers"]] == ["dense", "moe", "moe", "moe", "moe"]
    assert c["dsa"]["indexer_types"] == [None, "full", None, "full", "shared"]
    assert c["eos_token_ids"] == [0, 1, 2]
    assert c["kda"]["gate_lower_bound"] == -5.0 and c["swiglu_limit"] == 1.5
    assert c["mhc"] == {"hc_mult": 4, "sinkhorn_iters": 20, "eps": 1e-6}
    assert c["mla"]["norm_eps"] == c["rms_norm_eps"] == 1e-5 and c["mla"]["rope"] is None
    names = set(m["trunk"]["crc32"])
    f32 = set(m["trunk"]["f32_tensors"])
    for i in range(5):
        for s in ("attn", "ffn"):
            for x in ("fn", "base", "scale"):      # learned *_scale parameters are kept, mHC all in float32
                assert f"layers.{i}.hc_{s}_{x}" in names and f"layers.{i}.hc_{s}_{x}" in f32
    assert "layers.0.self_attn.q_conv1d.weight" in f32
    assert "layers.3.self_attn.indexer.index_kpool_compress_ape" in names
    assert not any(n.startswith("layers.4.self_attn.indexer") for n in names)     # shared: no indexer of its own
    assert "lm_head.weight" in names and "embed_tokens.weight" in names
    assert not any("visual" in n or "language_model" in n for n in names)
    v = m["vision"]
    assert v["file"] == "vision.safetensors" and v["config"]["depth"] == 1
    vt = load_file(str(rel["out"] / "vision.safetensors"))
    assert set(vt) == set(v["crc32"]) and all(k.startswith("visual.") for k in vt)
    assert len(vt) == sum(1 for k in load_file(str(rel["src"] / "model.safetensors")) if k.startswith("model.visual."))


def test_flat_release_converts_to_the_same_container(rel, tmp_path):
    """Text fields at the top level, tensors under model.layers.N: the same trunk, banks and config."""
    flat = tmp_path / "flat"
    shutil.copytree(rel["src"], flat)
    cfg = json.loads((flat / "config.json").read_text())
    text = dict(cfg["text_config"], model_type="glm5_next")
    (flat / "config.json").write_text(json.dumps(text))
    t = load_file(str(flat / "model.safetensors"))
    t = {k.replace("model.language_model.", "model."): v for k, v in t.items() if not k.startswith("model.visual.")}
    save_file(t, str(flat / "model.safetensors"))
    out = convert(flat, tmp_path / "flat.waste", experts="bf16", trunk="bf16", progress=False)
    a, b = manifest(out), manifest(rel["out"])
    assert a["config"] == b["config"] and a["trunk"]["crc32"] == b["trunk"]["crc32"] and "vision" not in a
    for f in sorted((rel["out"] / "experts").iterdir()):
        assert (out / "experts" / f.name).read_bytes() == f.read_bytes()


def test_kda_layers_list_must_agree_0_based(rel, tmp_path):
    """GLM's kda_layers is 0-based (Kimi's is 1-based): a 1-based copy would load fine and answer noise."""
    src = tmp_path / "src"
    shutil.copytree(rel["src"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["linear_attn_config"] = {"kda_layers": [1, 3]}        # 1-based: refused
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WasteError, match=r"kda_layers \[1, 3\] disagrees with layer_types .*\[0, 2\]"):
        convert(src, tmp_path / "bad.waste", progress=False)
    cfg["text_config"]["linear_attn_config"] = {"kda_layers": [0, 2]}        # 0-based: agrees
    (src / "config.json").write_text(json.dumps(cfg))
    out = convert(src, tmp_path / "ok.waste", experts="bf16", trunk="bf16", progress=False)
    assert manifest(out)["config"]["layers"] == manifest(rel["out"])["config"]["layers"]


def test_mtp_layer_after_the_last_layer_is_left_out_with_a_note(rel, tmp_path):
    """GLM releases carry an MTP layer at index num_hidden_layers (transformers ignores `layers.45.`)."""
    src = tmp_path / "mtp"
    shutil.copytree(rel["src"], src)
    t = load_file(str(src / "model.safetensors"))
    last, mtp = "model.language_model.layers.4.", "model.language_model.layers.5."
    t.update({k.replace(last, mtp): v.clone() for k, v in t.items() if k.startswith(last)})
    t[mtp + "eh_proj.weight"] = torch.ones(64, 128)
    t[mtp + "shared_head.norm.weight"] = torch.ones(64)
    save_file(t, str(src / "model.safetensors"))
    out = convert(src, tmp_path / "mtp.waste", experts="bf16", trunk="bf16", progress=False)
    m = manifest(out)
    assert m["trunk"]["crc32"] == manifest(rel["out"])["trunk"]["crc32"] and "5" not in m["experts"]["layers"]
    assert m["notes"] and "multi-token-prediction layer 5" in m["notes"][0]


def test_text_only_runs_never_read_the_vision_file(rel, tmp_path):
    dst = tmp_path / "novision.waste"
    shutil.copytree(rel["out"], dst)
    (dst / "vision.safetensors").unlink()
    eng = waste.load(dst, dtype="float32")
    try:
        assert len(eng.generate(prompt(6).tolist(), max_tokens=3).token_ids) == 3
    finally:
        eng.close()
    from waste.container.verify import verify

    assert any(p.startswith("vision vision.safetensors cannot be read") for p in verify(dst, progress=False))


def test_fp8_release_with_learned_scales(rel, tmp_path):
    """fp8 e4m3 matrices with weight_scale_inv companions next to GLM's learned hc_*_scale parameters: companions
    are never taken for weights, learned scales are never dropped, and the model equals the dequantized one."""
    from test_convert import quantize_fp8, reference_dequant

    src, ref_dir = tmp_path / "fp8", tmp_path / "ref"
    shutil.copytree(rel["src"], src)
    shutil.copytree(rel["src"], ref_dir)
    t = load_file(str(src / "model.safetensors"))
    fp8, ref = {}, {}
    for name, w in t.items():
        if w.ndim == 2 and name.endswith("_proj.weight") and "visual" not in name:
            q, s = quantize_fp8(w.float())
            fp8[name], fp8[name.removesuffix(".weight") + ".weight_scale_inv"] = q, s
            ref[name] = reference_dequant(q, s)
        else:
            fp8[name] = ref[name] = w
    assert sum(k.endswith("weight_scale_inv") for k in fp8) > 40
    save_file(fp8, str(src / "model.safetensors"))
    save_file(ref, str(ref_dir / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    a_path = convert(src, tmp_path / "fp8.waste", experts="f32", trunk="f32", progress=False)
    b_path = convert(ref_dir, tmp_path / "ref.waste", experts="f32", trunk="f32", progress=False)
    names = set(manifest(a_path)["trunk"]["crc32"])
    assert not any("scale_inv" in n for n in names)
    assert sum(n.endswith("_scale") for n in names) == 10
    a, b = waste.load(a_path, dtype="float32"), waste.load(b_path, dtype="float32")
    try:
        ids = prompt(20)
        la, lb = (e.model.forward(ids, e.model.new_state(), 0) for e in (a, b))
    finally:
        a.close()
        b.close()
    assert torch.equal(la, lb)


def _waste(*args, env=None):
    p = subprocess.run([sys.executable, "-m", "waste", *map(str, args)], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), timeout=300)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 0, p.stderr
    return p


def test_waste_info_and_run(rel, capsys):
    """`waste info` names the features; `waste run` on the container converted with the default (quantized)
    formats, so the clamped SwiGLU and the indexer run through the quantized kernels too."""
    from waste.cli import main

    assert main(["info", str(rel["out"])]) in (0, None)
    info = capsys.readouterr().out
    assert "mHC: 4 residual streams" in info and "DSA on 3 MLA layers: index_topk 128 = 32 pools of 4" in info
    assert "clamped SwiGLU" in info and "KDA decay gate with lower bound -5" in info and "vision tower" in info
    from waste.container import open_container
    from waste.container.info import describe

    c = open_container(rel["out"])
    try:
        assert any(f.startswith("DSA") for f in describe(c)["features"])      # what `waste info --json` prints
    finally:
        c.close()
    default = convert(rel["src"], rel["root"] / "default.waste", progress=False)
    r = _waste("run", default, "def fibonacci(n):", "-n", "8")
    assert "prompt" in r.stderr and "generated" in r.stderr      # the stats line
