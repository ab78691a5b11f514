"""Released low-bit formats against implementations we did not write: the packed tensors are made by
compressed-tensors' own compressors (as llm-compressor writes a release), decoded by its own decompressors and by
mlx, and the whole model runs in transformers on those decoded weights. Our converter and engine must agree:
each matrix bit for bit, the logits as closely as two float32 runs of the same weights (docs/LEARNED.md §2e)."""
import json

import pytest
import torch
from fixtures import greedy_pair, prompt, qwen3_moe_model, rel_l2, save_release
from safetensors.torch import load_file, save_file

import waste
from waste.convert.convert import convert
from waste.convert.source import Checkpoint
from waste.errors import WasteError
from waste.quant.quality import logits_over

ct_quant = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

FORMAT = {"MXFP4": "mxfp4-pack-quantized", "W4A16": "pack-quantized", "W4A16_ASYM": "pack-quantized",
          "NVFP4A16": "nvfp4-pack-quantized", "W8A16": "pack-quantized"}
# float32 against float32 on identical weights (measured 1.7e-7 to 2.0e-7), and q4 kept as released, whose kernel takes
# bf16 activations (measured 2.8e-3; docs/ARCHITECTURE.md "Compute dtype")
BOUND, Q4_BOUND = 2e-6, 1e-2


def scheme(preset: str, group: int | None):
    s = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    if group:
        s.weights.group_size = group
    return s


def ct_compress(w: torch.Tensor, preset: str, group: int | None = 32) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' packed tensors for one matrix, and its own decompression of them."""
    s = scheme(preset, group)
    comp = BaseCompressor.get_value_from_registry(FORMAT[preset])
    N, K = w.shape
    gs = s.weights.group_size
    g = w.view(N, K // gs, gs)
    glob = None
    if preset.startswith("NVFP4"):
        from compressed_tensors.quantization.utils.helpers import generate_gparam

        glob = generate_gparam(w.float().amin(), w.float().amax())
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), s.weights, global_scale=glob)
    sd = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    if glob is not None:
        sd["weight_global_scale"] = glob
    packed = comp.compress(sd, s)
    return packed, comp.decompress(dict(packed), s)["weight"]


def ct_release(hf, dst, preset: str, group: int | None = 32):
    """The fixture's release with its routed experts as compressed-tensors writes them (config included), and
    beside it (`dst`-dense) the same release with those experts replaced by compressed-tensors' decompression."""
    src, dense = save_release(hf, dst), save_release(hf, dst.parent / (dst.name + "-dense"))
    f = next(src.glob("*.safetensors"))
    tensors = load_file(f)
    decoded = dict(tensors)
    for name in [n for n in tensors if ".experts." in n and n.endswith("_proj.weight")]:
        packed, w = ct_compress(tensors.pop(name).bfloat16(), preset, group)
        for k, v in packed.items():
            tensors[name[:-len("weight")] + k] = v
        decoded[name] = w.float()
    save_file(tensors, str(f), metadata={"format": "pt"})
    save_file(decoded, str(next(dense.glob("*.safetensors"))), metadata={"format": "pt"})
    qc = ct_quant.QuantizationConfig(config_groups={"group_0": scheme(preset, group)}, format=FORMAT[preset],
                                     ignore=["lm_head"])
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc.to_dict()}))
    return src, dense


def one_matrix_release(tmp_path, packed: dict):
    # the keys every config needs (convert/source.py check_config); the checkpoint reader reads nothing else here
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 16, "hidden_size": 16,
                                                      "num_hidden_layers": 1, "num_attention_heads": 1}))
    save_file({f"m.{k}": v.contiguous() for k, v in packed.items()}, str(tmp_path / "model.safetensors"))
    return Checkpoint(tmp_path)


@pytest.mark.parametrize("preset,group", [("MXFP4", 32), ("W4A16", 32), ("W4A16", 128), ("W4A16_ASYM", 32),
                                          ("W4A16_ASYM", 128)])
def test_each_matrix_decodes_as_compressed_tensors_does(preset, group, tmp_path):
    """Nibble order, E8M0 bias, group layout, zero-point packing: our reading of compressed-tensors' bytes equals
    its own decompression (which rounds to bf16; ours is float32 and exact, so it is compared after one rounding)."""
    w = (torch.randn(48, 256, generator=torch.Generator().manual_seed(7)) * 0.05).bfloat16()
    packed, want = ct_compress(w, preset, group)
    ckpt = one_matrix_release(tmp_path, packed)
    got = ckpt.get("m.weight")
    assert got.dtype == torch.float32 and got.shape == w.shape
    assert torch.equal(got.to(want.dtype), want)
    assert (got - w.float()).norm() / w.float().norm() < 0.2      # and it is the matrix, not a permutation of it
    if preset != "W4A16_ASYM":
        fmt, parts = ckpt.released_parts("m.weight")
        from waste.quant.formats import get_format

        assert fmt == ("mxfp4" if preset == "MXFP4" else f"q4g{group}")
        assert torch.equal(get_format(fmt).unpack(parts, tuple(w.shape), torch.float32), got)
    else:
        assert ckpt.released_parts("m.weight") is None     # q4's bf16 zero cannot hold -zero_point * scale exactly


def test_mxfp4_decodes_as_mlx_does(tmp_path):
    """A second outside reading of the same bytes: mlx's mxfp4 dequantization (uint8 pairs, low nibble first)."""
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(8)).bfloat16()
    packed, _ = ct_compress(w, "MXFP4")
    got = one_matrix_release(tmp_path, packed).get("m.weight")
    ref = mx.dequantize(mx.array(packed["weight_packed"].numpy()).view(mx.uint32),
                        scales=mx.array(packed["weight_scale"].numpy()), group_size=32, bits=4, mode="mxfp4",
                        dtype=mx.float32)
    assert np.array_equal(np.array(ref), got.numpy())


@pytest.fixture(scope="module")
def qwen():
    return qwen3_moe_model()


@pytest.mark.parametrize("preset,experts,stored,bound", [
    ("MXFP4", "auto", "mxfp4", BOUND), ("W4A16", "bf16", "bf16", BOUND), ("W4A16_ASYM", "bf16", "bf16", BOUND),
    ("W4A16", "auto", "q4g32", Q4_BOUND)])
def test_released_model_runs_as_transformers_does(preset, experts, stored, bound, qwen, tmp_path):
    """The converted release against transformers running compressed-tensors' decompression of the same bytes:
    logits over 24 tokens, and 32 greedy tokens. mxfp4 is kept as released and exact; int4 decoded and stored in
    bf16 holds compressed-tensors' bf16 decompression as it is, so it is exact too; int4 kept as released (q4 nibbles,
    the default) is held to Q4_BOUND, since q4 multiplies bf16-rounded activations."""
    from transformers import AutoModelForCausalLM

    src, dense = ct_release(qwen, tmp_path / preset, preset)
    out = convert(src, tmp_path / "o.waste", experts=experts, trunk="bf16", progress=False)
    m = json.loads((out / "manifest.json").read_text())["experts"]
    assert m["format"] == stored and m["kept_as_released"] == (experts == "auto")
    oracle = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32, attn_implementation="eager",
                                                  experts_implementation="eager").eval()
    ids = prompt(24)
    with torch.no_grad():
        ref = oracle(ids[None]).logits[0]
    with waste.load(out, dtype="float32") as eng:
        got = logits_over(eng, ids.tolist())
        print(preset, experts, 'rel L2', rel_l2(got, ref))
        assert rel_l2(got, ref) < bound
        theirs, ours = greedy_pair(oracle, eng, prompt(8, seed=3))
    if bound == BOUND:
        assert ours == theirs and len(ours) == 32


@pytest.mark.parametrize("preset,group,match", [
    ("NVFP4A16", None, r"model\.layers\.1\.mlp\.experts\.0\.\w+_proj\.weight is NVFP4"),
    ("W8A16", 32, r"model\.layers\.1\.mlp\.experts\.0\.\w+_proj\.weight packs .* not 4-bit")])
def test_formats_we_do_not_read_are_refused_by_name(preset, group, match, qwen, tmp_path, capsys):
    from waste.cli import main

    src, _ = ct_release(qwen, tmp_path / preset, preset, group)
    with pytest.raises(WasteError, match=match):
        convert(src, tmp_path / "x.waste", progress=False)
    assert not (tmp_path / "x.waste").exists()
    assert main(["convert", str(src), str(tmp_path / "y.waste")]) == 1
    err = capsys.readouterr().err
    assert "waste: error: " in err and "Traceback" not in err and not (tmp_path / "y.waste").exists()
