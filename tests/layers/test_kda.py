"""KDA layer against transformers' Kimi-Linear modules (float32 as shipped, float64 by a dtype-substituted copy)."""

import sys

sys.modules["fla"] = None  # keep transformers on its pure-torch fallbacks (fla's Triton kernels fail on CPU)

import pytest
import torch
from transformers import DynamicCache

from kimi_linear_hf import TOL, attention_weights, f64_oracle_module, tiny_checkpoint
from waste.layers.kda import KDAConfig, KDAState, kda_chunked, kda_forward, kda_recurrent

KDA_LAYERS = (0, 1, 2)


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """O(1) activations, decays from ~0.25 to ~0.999 per step, varied betas and gates."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            u = torch.rand(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("A_log"):
                v = -3 + 3.5 * u
            elif name.endswith("dt_bias"):
                v = -3 + 4 * u
            elif "norm" in name:
                v = 1 + 0.2 * r
            elif "conv1d" in name:
                v = 0.5 * r
            else:
                v = r * p.shape[-1] ** -0.5
            p.copy_(v)


@pytest.fixture(scope="module")
def tiny():
    cfg, model, ckpt = tiny_checkpoint(randomize_, seed=1)
    f64 = f64_oracle_module()
    layers = {}
    for i in KDA_LAYERS:
        w = attention_weights(ckpt, i)
        ref32 = model.model.layers[i].self_attn
        ref64 = f64.KimiLinearDeltaAttention(cfg, i).double()
        ref64.load_state_dict(ref32.state_dict())
        layers[i] = {torch.float32: (w, ref32), torch.float64: ({k: v.double() for k, v in w.items()}, ref64)}
    kcfg = KDAConfig(num_heads=4, head_dim=16, conv_kernel=4, eps=cfg.rms_norm_eps)
    return cfg, kcfg, layers


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_checkpoint_names_and_shapes(tiny):
    _, _, layers = tiny
    w, _ = layers[1][torch.float32]
    assert sorted(w) == sorted([
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
        "A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "g_a_proj.weight",
        "g_b_proj.weight", "o_norm.weight", "o_proj.weight",
    ])
    assert w["q_conv1d.weight"].shape == (64, 1, 4) and w["A_log"].shape == (1, 1, 4, 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 64, 130])
def test_matches_transformers(tiny, dtype, T):
    _, kcfg, layers = tiny
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T), dtype=dtype)
    for i in KDA_LAYERS:
        w, ref = layers[i][dtype]
        with torch.no_grad():
            expect = ref(x[None])[0]
        out, state = kda_forward(x, w, kcfg)
        assert out.dtype == dtype and out.shape == (T, 64)
        assert state.S.dtype == torch.promote_types(dtype, torch.float32)
        assert rel(out, expect) < TOL[dtype], (i, rel(out, expect))


def oracle_in_pieces(ref, cfg, i, x, pieces):
    cache = DynamicCache(config=cfg)
    outs, s = [], 0
    with torch.no_grad():
        for n in pieces:
            outs.append(ref(x[None, s : s + n], cache=cache)[0])
            s += n
    return torch.cat(outs), cache.layers[i]


def mine_in_pieces(x, w, kcfg, pieces, state=None):
    outs, s = [], 0
    for n in pieces:
        out, state = kda_forward(x[s : s + n], w, kcfg, state)
        outs.append(out)
        s += n
    return torch.cat(outs), state


# prefill then decode; prefill continuing a state (with pieces shorter than the conv window); across chunk edges
PIECES = [[5, 3, 1, 1, 1], [2, 1, 1, 7], [64, 66, 1, 1], [1] * 9 + [70]]


@pytest.mark.parametrize("pieces", PIECES, ids=lambda p: "-".join(map(str, p)))
def test_pieces_equal_full_forward_and_oracle_cache(tiny, pieces):
    cfg, kcfg, layers = tiny
    dtype = torch.float64
    T = sum(pieces)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(100 + T), dtype=dtype)
    for i in (1,):
        w, ref = layers[i][dtype]
        full, full_state = kda_forward(x, w, kcfg)
        out, state = mine_in_pieces(x, w, kcfg, pieces)
        assert rel(out, full) < 1e-10
        assert rel(state.S, full_state.S) < 1e-10
        expect, hf_layer = oracle_in_pieces(ref, cfg, i, x, pieces)
        assert rel(out, expect) < 1e-10
        assert rel(state.S, hf_layer.recurrent_states[0][0]) < 1e-10
        conv = hf_layer.conv_states[0][0, :, 1:].t()  # transformers keeps the last K inputs of q|k|v, channels first
        assert torch.equal(torch.cat([state.conv_q, state.conv_k, state.conv_v], dim=1), conv)


def test_pieces_float32(tiny):
    _, kcfg, layers = tiny
    w, _ = layers[2][torch.float32]
    x = torch.randn(75, 64, generator=torch.Generator().manual_seed(7))
    full, _ = kda_forward(x, w, kcfg)
    out, _ = mine_in_pieces(x, w, kcfg, [5, 3, 1, 1, 65])
    assert rel(out, full) < 1e-5


def test_chunked_equals_recurrence_from_a_state():
    g = torch.Generator().manual_seed(3)
    T, H, d, dv = 150, 3, 8, 5
    q = torch.nn.functional.normalize(torch.randn(T, H, d, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, d, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(T, H, dv, generator=g, dtype=torch.float64)
    gate = -torch.rand(T, H, d, generator=g, dtype=torch.float64) * 0.3
    gate[30:50] = -100.0  # cumulative log-decay down to -2000 inside a chunk: exp(-G) would overflow float64
    beta = torch.rand(T, H, generator=g, dtype=torch.float64)
    S0 = torch.randn(H, d, dv, generator=g, dtype=torch.float64)
    o_r, S_r = kda_recurrent(q, k, v, gate, beta, S0)
    for chunk, sub in ((64, 8), (64, 16), (64, 64), (16, 4), (7, 3)):
        o_c, S_c = kda_chunked(q, k, v, gate, beta, S0, chunk=chunk, sub=sub)
        assert torch.isfinite(o_c).all()
        assert rel(o_c, o_r) < 1e-12 and rel(S_c, S_r) < 1e-12


def test_state_is_not_modified_and_A_log_may_be_flat(tiny):
    _, kcfg, layers = tiny
    w, _ = layers[0][torch.float64]
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    _, state = kda_forward(x[:6], w, kcfg)
    before = [t.clone() for t in (state.conv_q, state.conv_k, state.conv_v, state.S)]
    a, _ = kda_forward(x[6:], w, kcfg, state)
    b, _ = kda_forward(x[6:], w, kcfg, state)
    assert torch.equal(a, b)
    assert all(torch.equal(t0, t1) for t0, t1 in zip(before, (state.conv_q, state.conv_k, state.conv_v, state.S)))
    flat = dict(w, A_log=w["A_log"].reshape(-1))
    assert torch.equal(kda_forward(x, flat, kcfg)[0], kda_forward(x, w, kcfg)[0])


def test_empty_state_shapes():
    kcfg = KDAConfig(num_heads=4, head_dim=16, conv_kernel=4, eps=1e-5)
    s = KDAState.empty(kcfg, torch.bfloat16)
    assert s.conv_q.shape == (3, 64) and s.conv_q.dtype == torch.bfloat16
    assert s.S.shape == (4, 16, 16) and s.S.dtype == torch.float32
    assert KDAState.empty(kcfg, torch.float64).S.dtype == torch.float64


def test_decode_takes_the_recurrent_form(tiny, monkeypatch):
    import waste.layers.kda as kda

    _, kcfg, layers = tiny
    w, _ = layers[0][torch.float64]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    _, state = kda_forward(x[:2], w, kcfg)
    monkeypatch.setattr(kda, "kda_chunked", None)
    kda_forward(x[2:], w, kcfg, state)


def test_bfloat16_runs_with_a_float32_state(tiny):
    _, kcfg, layers = tiny
    w, _ = layers[1][torch.float64]
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(70), dtype=torch.float64)
    expect, _ = kda_forward(x, w, kcfg)
    wb = {k: v.bfloat16() for k, v in w.items()}
    out, state = mine_in_pieces(x.bfloat16(), wb, kcfg, [66, 1, 1, 1, 1])
    assert out.dtype == torch.bfloat16 and state.S.dtype == torch.float32 and state.conv_q.dtype == torch.bfloat16
    assert rel(out, expect) < 3e-2  # bf16 weights and activations: a few ulps of 2^-8
