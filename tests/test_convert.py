"""The converter: layouts, fp8 blocks, refusals, and no half-written container."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import waste
from waste.convert.convert import convert
from waste.convert.source import dequant_fp8_blocks
from waste.errors import WasteError

FP8_MAX = 448.0


def reference_dequant(q, s, block=128):
    """Independent of the converter: an explicit loop over 128x128 blocks, ragged edges included."""
    out = torch.empty(q.shape, dtype=torch.float32)
    m, n = q.shape
    for bi in range(-(-m // block)):
        for bj in range(-(-n // block)):
            r, c = slice(bi * block, (bi + 1) * block), slice(bj * block, (bj + 1) * block)
            out[r, c] = q[r, c].float() * s[bi, bj]   # one float32 rounding, as the checkpoint's own code
    return out


def quantize_fp8(w, block=128):
    m, n = w.shape
    s = torch.empty(-(-m // block), -(-n // block))
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            r, c = slice(bi * block, (bi + 1) * block), slice(bj * block, (bj + 1) * block)
            s[bi, bj] = w[r, c].abs().max().clamp(min=1e-8) / FP8_MAX
            q[r, c] = (w[r, c] / s[bi, bj]).to(torch.float8_e4m3fn)
    return q, s


def test_fp8_dequant_matches_reference_on_ragged_blocks():
    w = torch.randn(300, 200)
    q, s = quantize_fp8(w)
    assert torch.equal(dequant_fp8_blocks(q, s, (128, 128)), reference_dequant(q, s))
    assert ((reference_dequant(q, s) - w).norm() / w.norm()) < 0.05   # it is a real quantization


def test_fp8_release_converts_to_the_reference_weights(tmp_path):
    """An fp8 Kimi-Linear release (ragged 128-blocks) against the same weights dequantized by the reference."""
    from fixtures import kimi_linear_model, save_release

    m = kimi_linear_model(seed=5, hidden_size=160, moe_intermediate_size=80, intermediate_size=144)
    src = save_release(m, tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    fp8, ref = {}, {}
    for name, t in tensors.items():
        quantizable = t.ndim == 2 and "embed" not in name and "lm_head" not in name and not name.endswith("gate.weight")
        if quantizable:
            q, s = quantize_fp8(t.float())
            fp8[name], fp8[name.removesuffix(".weight") + ".weight_scale_inv"] = q, s
            ref[name] = reference_dequant(q, s)
        else:
            fp8[name] = ref[name] = t
    ref_dir = tmp_path / "ref"
    shutil.copytree(src, ref_dir)
    save_file(ref, str(ref_dir / "model.safetensors"))
    save_file(fp8, str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    a = waste.load(convert(src, tmp_path / "fp8.waste", experts="f32", trunk="f32", progress=False), dtype="float32")
    b = waste.load(convert(ref_dir, tmp_path / "ref.waste", experts="f32", trunk="f32", progress=False), dtype="float32")
    ids = torch.arange(3, 40)
    la = a.model.forward(ids, a.model.new_state(), 0)
    lb = b.model.forward(ids, b.model.new_state(), 0)
    assert torch.equal(la, lb)


def test_sharded_index_and_nested_text_config(tmp_path, releases):
    """A release split across two shards with an index, its config nested under text_config."""
    src = releases["qwen3_moe"][1]
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    wm = {}
    for i, part in enumerate((names[:half], names[half:])):
        f = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(dst / f))
        wm.update({k: f for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "text_config": cfg}))
    out = convert(dst, tmp_path / "sharded.waste", experts="bf16", trunk="bf16", progress=False)
    ref = releases["qwen3_moe"][2]
    for f in ["trunk.safetensors"] + [p.name for p in (ref / "experts").iterdir()]:
        sub = "" if f.endswith("safetensors") else "experts/"
        assert (out / sub / f).read_bytes() == (ref / sub / f).read_bytes(), f


def test_missing_and_unexpected_tensors_are_named_before_writing(tmp_path, releases):
    src = tmp_path / "broken"
    shutil.copytree(releases["qwen3_moe"][1], src)
    t = load_file(str(src / "model.safetensors"))
    del t["model.layers.2.mlp.experts.5.up_proj.weight"]
    t["model.layers.2.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(t, str(src / "model.safetensors"))
    with pytest.raises(WasteError) as e:
        convert(src, tmp_path / "out.waste", progress=False)
    msg = str(e.value)
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in msg and "model.layers.2.mlp.extra.weight" in msg
    assert not any(tmp_path.glob("out.waste*"))


@pytest.mark.parametrize("name", [
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.2.mlp.experts.3.down_proj.weight"])
def test_shape_mismatch_is_refused_by_name_before_writing(tmp_path, releases, name):
    """A tensor whose shape the config does not give (a trunk matrix, an expert matrix): one error naming it and both
    shapes, from the API and from the CLI, and nothing written."""
    from waste.cli import main

    src = tmp_path / "broken"
    shutil.copytree(releases["qwen3_moe"][1], src)
    t = load_file(str(src / "model.safetensors"))
    good = list(t[name].shape)
    t[name] = torch.zeros(good[0], good[1] + 8, dtype=t[name].dtype)
    save_file(t, str(src / "model.safetensors"))
    with pytest.raises(WasteError) as e:
        convert(src, tmp_path / "out.waste", progress=False)
    msg = str(e.value)
    assert name in msg and str(good[1] + 8) in msg and str(good[1]) in msg, msg
    assert main(["convert", str(src), str(tmp_path / "cli.waste")]) == 1
    assert not any(tmp_path.glob("out.waste*")) and not any(tmp_path.glob("cli.waste*"))


def test_unsupported_family_lists_supported(tmp_path, releases):
    src = tmp_path / "other"
    shutil.copytree(releases["qwen3_moe"][1], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WasteError, match="unsupported model_type 'mamba'.*kimi_linear.*qwen3_moe"):
        convert(src, tmp_path / "o.waste", progress=False)


def test_interrupted_conversion_leaves_nothing_that_opens(tmp_path, releases, monkeypatch):
    from waste.container import bank

    calls = {"n": 0}
    real = bank.BankWriter.write

    def dying(self, e, t):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        real(self, e, t)

    monkeypatch.setattr(bank.BankWriter, "write", dying)
    with pytest.raises(KeyboardInterrupt):
        convert(releases["qwen3_moe"][1], tmp_path / "cut.waste", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_not_overwritten_without_force(tmp_path, releases):
    out = tmp_path / "x.waste"
    out.mkdir()
    with pytest.raises(WasteError, match="already exists"):
        convert(releases["qwen3_moe"][1], out, progress=False)
