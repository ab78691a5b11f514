"""layers/q4_tiled.py (q4 decode pairs read in coalesced tiles, K split over programs) against the torch ops and each
record's own unpack, through triton's interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET=1), compiled
on a GPU."""
import pytest
import torch

pytest.importorskip("triton")
from test_moe_triton import DEV, slab_bank  # noqa: E402  (also patches the interpreter for numpy >= 2.4)

from waste.layers import moe_triton, q4_tiled  # noqa: E402
from waste.layers.moe import routed_experts  # noqa: E402


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def reference(bank, dense, x, slots, wts, limit):
    """Each pair's weight * down(SwiGLU(gate x, up x)) from the unpacked float32 matrices, x and the gate and up rows
    rounded to bf16 as the kernels' rows are."""
    xr = x.to(torch.bfloat16).float().cpu()
    out = torch.zeros(slots.shape[1], bank.shapes["down"][0])
    for j, s in enumerate(slots[0].tolist()):
        if s < 0:
            continue
        d = dense[s]
        g = (d["gate"] @ xr[0]).to(torch.bfloat16).float()
        u = (d["up"] @ xr[0]).to(torch.bfloat16).float()
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        out[j] = float(wts[0, j]) * (d["down"] @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize("fmt,h,inter,limit", [("q4", 256, 128, None), ("q4", 192, 128, 0.05), ("q4g32", 128, 64,
                                                                                                  None)])
@pytest.mark.parametrize("gu,down", [((1, 1, 4), (1, 1, 4)), ((4, 2, 4), (2, 1, 2)), ((3, 3, 8), (3, 2, 4)),
                                     ((1, 1, 4, 1), (1, 1, 8, 1)), ((2, 1, 4, 1), (2, 1, 4, 1))])
def test_tiled_pairs_match_unpacked_matrices(fmt, h, inter, limit, gu, down):
    """Every split and step (the split 1 gate + up launch storing bf16 rows the down launch activates, or float32
    partials summed and activated by their own launch; with and without the next step prefetched), against the
    unpacked matrices; a slot twice, a -1 pair zero; splits that do not divide K shrink (fit)."""
    bank, dense = slab_bank(fmt, h, inter, n_slots=5)
    bank.limit = limit
    assert q4_tiled.serves(bank)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, h, generator=g).to(torch.bfloat16).to(DEV)
    slots = torch.tensor([[3, 0, -1, 4, 3]], device=DEV)
    wts = torch.rand(1, 5, generator=g)
    wts[0, 4] = wts[0, 0]
    wts = wts.to(DEV)
    y = q4_tiled.weighted_pairs(x, slots.reshape(-1), wts.reshape(-1), bank, 5, moe_triton._delta, gu=gu, down=down)
    assert y.shape == (5, h) and y.dtype == torch.float32
    assert not y[2].any()
    ref = reference(bank, dense, x, slots, wts, limit)
    for j in (0, 1, 3, 4):
        # float32 sums over exact nibbles; the gate and up rows rounded to bf16 on either side (2^-8 each)
        assert rel(y[j], ref[j]) < 1e-2, (j, rel(y[j], ref[j]))
    assert torch.equal(y[0], y[4])       # the same pair twice (same weight): the same bits


def test_tiled_is_the_default_where_it_serves(monkeypatch):
    """moe_triton.weighted_pairs takes the tiled kernels for a q4 bank of full blocks and agrees with the untiled
    kernels (and the two-launch torch path) within bf16's rounding; a bank with a tail block keeps the untiled ones."""
    bank, _ = slab_bank("q4", 128, 64, n_slots=4)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)).to(DEV)
    slots = torch.tensor([[2, -1, 0, 3]], device=DEV)
    wts = torch.rand(1, 4, generator=torch.Generator().manual_seed(4)).to(DEV)
    called = []
    real = q4_tiled.weighted_pairs
    monkeypatch.setattr(q4_tiled, "weighted_pairs", lambda *a, **k: called.append(1) or real(*a, **k))
    tiled = moe_triton.weighted_pairs(x, slots, wts, bank)
    assert called and tiled.shape == (1, 4, 128) and not tiled[0, 1].any()
    monkeypatch.setattr(moe_triton, "Q4_TILED", False)
    untiled = moe_triton.weighted_pairs(x, slots, wts, bank)
    assert len(called) == 1 and rel(tiled, untiled) < 1e-2
    ref = routed_experts(x, slots, wts, bank, moe_triton.pairs, complete=False)
    assert rel(tiled.sum(1), ref) < 1e-2
    tail, _ = slab_bank("q4", 128, 96, n_slots=2)
    assert not q4_tiled.serves(tail)


def test_fit_divides_k():
    assert q4_tiled.fit(2048, 64, 4, 2) == (4, 2)
    assert q4_tiled.fit(768, 64, 8, 4) == (3, 4)      # 12 groups: 4 a step, 3 steps
    assert q4_tiled.fit(2304, 64, 4, 4) == (3, 4)     # 36 groups
    assert q4_tiled.fit(128, 64, 4, 2) == (1, 2)      # the step first, then the split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_pairs_matches_torch_sum_and_cast(dtype):
    """moe_triton.sum_pairs (routed_groups' sum over k of the weighted pairs, and the cast, in one launch) against
    torch's: float32 in order, so within float32 rounding of it; the bf16 result within one bf16 rounding."""
    y = torch.randn(3, 8, 300, generator=torch.Generator().manual_seed(5)).to(DEV)
    out = moe_triton.sum_pairs(y, dtype)
    ref = y.sum(1)
    assert out.shape == (3, 300) and out.dtype == dtype
    assert rel(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert moe_triton.weighted_pairs.sum_pairs is moe_triton.sum_pairs
