"""Kimi K3 (`kimi_k3`) against mlx-lm 0.32.2's `kimi_k3` on Linux CPU (mlx 0.32.4), on tiny random releases in the
release's own layout (tests/k3_release.py): routed experts in compressed-tensors mxfp4 and in bf16.

The oracle loads each release through mlx-lm's own loader (`load_model`, which applies its `sanitize`: stacked
experts, fused q/k/v and convs, split kv_b_proj, mxfp4 kept packed), then runs in float32 like the engine.
Logits within 1e-4 relative L2, routing identical per layer and token, prefill + decode equal to one forward,
greedy continuations identical.
"""
import json

import pytest
import torch

mx = pytest.importorskip("mlx.core", reason='the K3 oracle is not installed: pip install "mlx[cpu]==0.32.4" '
                                            '"mlx-lm==0.32.2" (pyproject test extra)')
mlx_k3 = pytest.importorskip("mlx_lm.models.kimi_k3", reason="mlx-lm 0.32.2 (the K3 oracle) is not installed")

import numpy as np  # noqa: E402
from fixtures import TOKENIZER_TEXT, prompt, rel_l2, split_and_whole  # noqa: E402
from k3_release import MLA_LAYERS, TEXT, VISION, write_release  # noqa: E402

import waste  # noqa: E402
from waste.convert.convert import convert  # noqa: E402
from waste.convert.synthetic import write_tokenizer  # noqa: E402
from waste.layers.attn_res import inv_rms, res_key, res_mix  # noqa: E402
from waste.layers.mlp import situ_act  # noqa: E402
from waste.quant.quality import greedy  # noqa: E402

KINDS = ("mxfp4", "bf16")


def mlx_load(src):
    from mlx_lm.utils import load_model

    model, _ = load_model(src)
    model.set_dtype(mx.float32)        # float parameters only: packed experts and E8M0 scales stay as they are
    return model


@pytest.fixture(scope="module", params=KINDS)
def k3(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"k3_{kind}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # a tiny model on a busy 2-core box is many times slower with two (LEARNED.md §3c)
    src = write_release(root / "src", kind)
    write_tokenizer(src, TOKENIZER_TEXT, vocab_size=300)
    out = convert(src, root / "k3.waste", experts="auto" if kind == "mxfp4" else "bf16", trunk="bf16", progress=False)
    eng = waste.load(out, dtype="float32")
    yield {"kind": kind, "src": src, "out": out, "eng": eng, "mlx": mlx_load(src)}
    eng.close()
    torch.set_num_threads(threads)


def to_torch(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(mx.float32)))


def mlx_forward(model, ids):
    """The oracle's logits [T, V] and, per MoE layer in order, its routed experts [T, k]."""
    routes, real = [], mlx_k3._group_expert_select

    def spy(*args):
        inds, w = real(*args)
        routes.append(torch.from_numpy(np.array(inds))[0])
        return inds, w

    mlx_k3._group_expert_select = spy
    try:
        logits = to_torch(model(mx.array(ids.numpy())[None]))[0]
    finally:
        mlx_k3._group_expert_select = real
    return logits, routes


def mlx_greedy(model, ids, n):
    """The oracle's greedy continuation through its own caches: a prefill, then one token per step."""
    cache = model.make_cache()
    logits = model(mx.array(ids.numpy())[None], cache)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache)
    return out


def test_release_is_recognised_and_kept_as_released(k3):
    m = json.loads((k3["out"] / "manifest.json").read_text())
    assert m["family"] == "kimi_k3"
    c = m["config"]
    assert [l["attn"] for l in c["layers"]] == ["mla" if i in MLA_LAYERS else "kda" for i in range(6)]
    assert [l["mlp"] for l in c["layers"]] == ["dense"] + ["moe"] * 5
    assert c["moe"]["expert_hidden"] == TEXT["routed_expert_hidden_size"] != c["hidden_size"]
    assert c["moe"]["expert_act"] == "situ_glu" and c["attn_res_block_size"] == 2
    assert m["vision"]["tensors"] == len(VISION)     # the tower is set aside, not in the trunk
    if k3["kind"] == "mxfp4":
        assert m["experts"]["format"] == "mxfp4" and m["experts"]["kept_as_released"]
        # a record holds the release's bytes: each matrix's E2M1 pairs and E8M0 scales, nothing re-quantized
        from safetensors import safe_open

        from waste.container import open_container

        ctr = open_container(k3["out"])
        try:
            bank = ctr.banks[3]
            buf = torch.empty(bank.record_bytes, dtype=torch.uint8)
            bank.read_into(5, buf)
            views = bank.layout.views(buf)
        finally:
            ctr.close()
        idx = json.loads((k3["src"] / "model.safetensors.index.json").read_text())["weight_map"]
        for w, mat in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            for comp, part in (("weight_packed", "blocks"), ("weight_scale", "scales")):
                name = f"language_model.model.layers.3.block_sparse_moe.experts.5.{w}.{comp}"
                with safe_open(str(k3["src"] / idx[name]), "pt") as f:
                    assert torch.equal(views[f"{mat}.{part}"], f.get_tensor(name)), name
    else:
        assert m["experts"]["format"] == "bf16"


def test_logits_and_routing_match_mlx(k3):
    ids = prompt(70)                  # crosses KDA's 64-token chunk
    ref, ref_routes = mlx_forward(k3["mlx"], ids)
    m = k3["eng"].model
    m.route_trace = []
    try:
        logits = m.forward(ids, m.new_state(), 0)
        ours = m.route_trace
    finally:
        m.route_trace = None
    err = rel_l2(logits, ref)
    print(f"kimi_k3 ({k3['kind']} experts) logits rel L2 {err:.2e}")
    assert err < 1e-4
    assert [i for i, _ in ours] == [1, 2, 3, 4, 5] and len(ref_routes) == 5
    for (layer, idx), r in zip(ours, ref_routes):
        for t in range(len(ids)):
            assert set(idx[t].tolist()) == set(r[t].tolist()), (layer, t)


def test_prefill_then_decode_equals_one_forward(k3):
    split, full = split_and_whole(k3["eng"].model, prompt(40, seed=2), 8)
    assert rel_l2(split, full) < 1e-5
    assert torch.equal(split.argmax(-1), full.argmax(-1))


def test_greedy_continuation_matches_mlx(k3):
    ids = prompt(8, seed=3)
    ref = mlx_greedy(k3["mlx"], ids, 32)
    assert greedy(k3["eng"], ids.tolist(), 32) == ref and len(ref) == 32


def test_mlx_loader_reads_the_experts_as_released(k3):
    """mlx-lm's own loader took the writer's release: packed mxfp4 experts stay quantized in its model."""
    sw = k3["mlx"].language_model.model.layers[1].mlp.switch_mlp
    if k3["kind"] == "mxfp4":
        assert sw.gate_proj.mode == "mxfp4" and sw.gate_proj.weight.dtype == mx.uint32
    else:
        assert not hasattr(sw.gate_proj, "scales")


# -- the new layers against the oracle's own functions --------------------------------------------------------

def test_situ_matches_mlx():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(64, 40, generator=g) * 6, torch.randn(64, 40, generator=g) * 30
    for beta, lb in ((4.0, 25.0), (1.5, None)):
        ref = to_torch(mlx_k3._situ(mx.array(up.numpy()), mx.array(gate.numpy()), beta, lb))
        ours = situ_act(gate, up, beta, lb)
        assert rel_l2(ours, ref) < 1e-6
        assert (ours.abs() < (beta * (lb or 1e9) * 1.0001)).all()


def test_attention_residual_mix_matches_mlx():
    g = torch.Generator().manual_seed(1)
    D, T, eps = 48, 5, 1e-5
    blocks = [torch.randn(T, D, generator=g) * s for s in (1.0, 3.0, 0.5)]
    partial = torch.randn(T, D, generator=g)
    norm_w, proj = 1 + 0.2 * torch.randn(D, generator=g), torch.randn(1, D, generator=g)
    rb = mlx_k3.ResidualBlocks(eps)
    for b in blocks:
        rb.append(mx.array(b.numpy()))
    key = res_key(norm_w, proj)
    ref = to_torch(mlx_k3._attn_res_mix(rb, mx.array(partial.numpy()), mx.array(key.numpy()), eps, False))
    ours = res_mix(blocks, [inv_rms(b, eps) for b in blocks], partial, key, eps)
    assert rel_l2(ours, ref) < 1e-6
    assert res_mix([], [], partial, key, eps) is partial
