"""MLA layer against transformers' Kimi-Linear attention (float32 as shipped, float64 by a dtype-substituted copy)."""

import sys

sys.modules["fla"] = None  # keep transformers on its pure-torch fallbacks (fla's Triton kernels fail on CPU)

import pytest
import torch
from transformers import DynamicCache, KimiLinearConfig

from kimi_linear_hf import TOL, attention_weights, f64_oracle_module, tiny_checkpoint, tiny_config
from waste.layers.mla import MLACache, MLAConfig, mla_forward

MLA_LAYER = 3


def randomize_(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1 + 0.2 * r if "norm" in name else r * p.shape[-1] ** -0.5)


def mla_config(cfg: KimiLinearConfig, rope=None) -> MLAConfig:
    # transformers builds kv_a_layernorm / q_a_layernorm with its RMSNorm default eps (1e-6), not rms_norm_eps
    return MLAConfig(
        num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        eps=1e-6, softmax_scale=(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5, rope=rope,
    )


@pytest.fixture(scope="module")
def tiny():
    cfg, model, ckpt = tiny_checkpoint(randomize_, seed=2)
    w = attention_weights(ckpt, MLA_LAYER)
    ref32 = model.model.layers[MLA_LAYER].self_attn
    f64 = f64_oracle_module()
    ref64 = f64.KimiLinearAttention(cfg, MLA_LAYER).double()
    ref64.load_state_dict(ref32.state_dict())
    layer = {torch.float32: (w, ref32), torch.float64: ({k: v.double() for k, v in w.items()}, ref64)}
    return cfg, layer, f64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def causal_mask(T: int, past: int, dtype) -> torch.Tensor:
    """transformers' additive mask: query t (at position past + t) sees keys 0 .. past + t."""
    blocked = torch.ones(T, past + T, dtype=torch.bool).triu(past + 1)
    return torch.zeros(T, past + T, dtype=dtype).masked_fill(blocked, float("-inf"))[None, None]


def test_checkpoint_names(tiny):
    _, layer, _ = tiny
    w, _ = layer[torch.float32]
    assert sorted(w) == sorted(
        ["q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 64, 130])
@pytest.mark.parametrize("absorb", [None, True, False])
def test_matches_transformers(tiny, dtype, T, absorb):
    cfg, layer, _ = tiny
    w, ref = layer[dtype]
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T), dtype=dtype)
    with torch.no_grad():
        expect = ref(x[None], attention_mask=causal_mask(T, 0, dtype))[0][0]
    out, cache = mla_forward(x, w, mla_config(cfg), absorb=absorb)
    assert out.dtype == dtype and out.shape == (T, 64)
    assert cache.c_kv.shape == (T, 32) and cache.k_pe.shape == (T, 8)
    assert rel(out, expect) < TOL[dtype], rel(out, expect)


PIECES = [[5, 3, 1, 1, 1], [64, 66, 1, 1], [1, 1, 1, 7]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pieces", PIECES, ids=lambda p: "-".join(map(str, p)))
def test_pieces_equal_full_forward_and_oracle_cache(tiny, dtype, pieces):
    cfg, layer, _ = tiny
    w, ref = layer[dtype]
    mcfg = mla_config(cfg)
    T = sum(pieces)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(100 + T), dtype=dtype)
    full, full_cache = mla_forward(x, w, mcfg)

    hf_cache = DynamicCache(config=cfg)
    cache, outs, expect, s = None, [], [], 0
    for n in pieces:
        out, cache = mla_forward(x[s : s + n], w, mcfg, cache)  # decode steps (n == 1) take the absorbed path
        outs.append(out)
        with torch.no_grad():
            expect.append(ref(x[None, s : s + n], attention_mask=causal_mask(n, s, dtype), cache=hf_cache)[0][0])
        s += n
    out, expect = torch.cat(outs), torch.cat(expect)
    assert rel(out, full) < TOL[dtype]
    assert rel(out, expect) < TOL[dtype]
    assert len(cache) == T
    assert rel(cache.c_kv, full_cache.c_kv) < TOL[dtype]
    assert rel(cache.c_kv, hf_cache.layers[MLA_LAYER].keys[0, 0]) < TOL[dtype]
    assert torch.equal(cache.k_pe, hf_cache.layers[MLA_LAYER].values[0, 0])


def test_q_lora(tiny):
    cfg, _, f64 = tiny
    qcfg = tiny_config(q_lora_rank=24)
    ref = f64.KimiLinearAttention(qcfg, MLA_LAYER).double()
    randomize_(ref, seed=5)
    w = dict(ref.state_dict())  # MLA's module names are the checkpoint names
    assert {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"} <= set(w) and "q_proj.weight" not in w
    mcfg = mla_config(qcfg)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    with torch.no_grad():
        expect = ref(x[None], attention_mask=causal_mask(12, 0, torch.float64))[0][0]
    out, cache = mla_forward(x[:9], w, mcfg)
    for t in range(9, 12):
        o, cache = mla_forward(x[t : t + 1], w, mcfg, cache)
        out = torch.cat([out, o])
    assert rel(out, expect) < 1e-10


def rotate_half_rope(q_pe, k_pe, positions, theta=10000.0):
    r = k_pe.shape[-1]
    inv = theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = positions.to(torch.float64)[:, None] * inv  # [T, r/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(q_pe.dtype), torch.cat([ang.sin()] * 2, -1).to(q_pe.dtype)

    def rot(x, c, s):
        x1, x2 = x[..., : r // 2], x[..., r // 2 :]
        return x * c + torch.cat([-x2, x1], -1) * s

    return rot(q_pe, cos[:, None], sin[:, None]), rot(k_pe, cos, sin)


def test_rope_hook(tiny):
    cfg, layer, _ = tiny
    w, _ = layer[torch.float64]
    seen = []

    def rope(q_pe, k_pe, positions):
        seen.append(positions.tolist())
        return rotate_half_rope(q_pe, k_pe, positions)

    mcfg = mla_config(cfg, rope=rope)
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    full, _ = mla_forward(x, w, mcfg)
    assert seen == [list(range(10))]
    assert rel(full, mla_forward(x, w, mla_config(cfg))[0]) > 1e-3  # the hook is applied
    assert rel(mla_forward(x, w, mcfg, absorb=True)[0], full) < 1e-10
    out, cache = mla_forward(x[:6], w, mcfg)
    out2, cache = mla_forward(x[6:8], w, mcfg, cache)
    out3, cache = mla_forward(x[8:9], w, mcfg, cache)
    out4, cache = mla_forward(x[9:], w, mcfg, cache, positions=torch.tensor([9]))
    assert seen[-4:] == [list(range(6)), [6, 7], [8], [9]]
    assert rel(torch.cat([out, out2, out3, out4]), full) < 1e-10


def test_cache_is_not_modified(tiny):
    cfg, layer, _ = tiny
    w, _ = layer[torch.float64]
    mcfg = mla_config(cfg)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    _, cache = mla_forward(x[:6], w, mcfg)
    a, c1 = mla_forward(x[6:7], w, mcfg, cache)
    b, c2 = mla_forward(x[6:7], w, mcfg, cache)
    assert len(cache) == 6 and len(c1) == len(c2) == 7 and torch.equal(a, b)
    assert len(MLACache.empty(mcfg, torch.float64)) == 0


def test_decode_takes_the_absorbed_form(tiny, monkeypatch):
    import waste.layers.mla as mla

    cfg, layer, _ = tiny
    w, _ = layer[torch.float64]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    _, cache = mla_forward(x[:2], w, mla_config(cfg))
    monkeypatch.setattr(mla, "_attend_naive", None)
    mla_forward(x[2:], w, mla_config(cfg), cache)


def test_bfloat16_runs(tiny):
    cfg, layer, _ = tiny
    w, _ = layer[torch.float64]
    mcfg = mla_config(cfg)
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(70), dtype=torch.float64)
    expect, _ = mla_forward(x, w, mcfg)
    wb = {k: v.bfloat16() for k, v in w.items()}
    out, cache = mla_forward(x[:66].bfloat16(), wb, mcfg)
    outs = [out]
    for t in range(66, 70):
        out, cache = mla_forward(x[t : t + 1].bfloat16(), wb, mcfg, cache)
        outs.append(out)
    assert outs[-1].dtype == cache.c_kv.dtype == torch.bfloat16
    assert rel(torch.cat(outs), expect) < 3e-2  # bf16 weights and activations: a few ulps of 2^-8
