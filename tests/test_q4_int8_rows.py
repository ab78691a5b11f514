"""layers/q4_int8_rows.py: q4 decode rows on a GPU with x rounded to int8 per scale group, against the CPU's own
rounding (quant/q4_int8.quantize_rows) and float64 products of the unpacked matrices with the rounded rows. Through
triton's interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET=1), compiled on a GPU."""
import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from test_moe_triton import DEV, slab_bank  # noqa: E402  (also patches the interpreter for numpy >= 2.4)

from waste.layers import moe_triton, q4_int8_rows, q4_rows  # noqa: E402
from waste.layers.moe import routed_groups  # noqa: E402
from waste.quant.q4_int8 import quantize_rows  # noqa: E402


def cpu_rounding(x: torch.Tensor, g: int):
    """The CPU decode row's int8 rows and (d, 8 d sum(xq), sum(x)) of float32 rows x [R, K]."""
    xq, d, d8, sx = quantize_rows(np.ascontiguousarray(x.float().cpu().numpy()), x.shape[1] // g)
    return torch.from_numpy(xq).int(), torch.from_numpy(d), torch.from_numpy(d8), torch.from_numpy(sx)


def unpack_words(w: torch.Tensor) -> torch.Tensor:
    """int32 words [R, K/4] -> their signed bytes [R, K] in memory order."""
    return w.cpu().contiguous().view(torch.int8).int()


def rounded_product(bank, m: str, slot: int, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """W x as the CPU's int8 decode row computes it, in float64: each group's s (q - 8) times x rounded to int8, its
    zero point z times the group's sum of x itself (not of the rounded x): W x^ + z (sum x - sum x^)."""
    G = bank.parts[m]["sz"].shape[1]
    g = x.shape[1] // G
    xq, d, _, _ = cpu_rounding(x, g)
    xr = xq.double().view(G, g) * d.double().view(G, 1)
    z = bank.parts[m]["sz"][slot, :, :, 1].double().cpu()              # [G, N]
    return w.double() @ xr.view(-1) + z.T @ (x.double().cpu().view(G, g).sum(1) - xr.sum(1))


@pytest.mark.parametrize("K,g,dtype", [(256, 64, torch.bfloat16), (96, 32, torch.float32), (2048, 64, torch.float32)])
def test_quantize_is_the_cpu_rounding(K, g, dtype):
    """The same int8 values (round half to even after the same float32 divide and multiply), the same scale and
    offset bits; the group's float sum within float32 summation order. A zero group stays zero."""
    gen = torch.Generator().manual_seed(K)
    x = (torch.randn(3, K, generator=gen) * torch.rand(3, 1, generator=gen) * 4).to(dtype)
    x[1, :g] = 0.0
    w, sc = q4_int8_rows.quantize(x.to(DEV), g)
    xq, d, d8, sx = cpu_rounding(x, g)
    assert torch.equal(unpack_words(w), xq)
    assert torch.equal(sc[:, 0].cpu(), d) and torch.equal(sc[:, 1].cpu(), d8)
    assert torch.allclose(sc[:, 2].cpu(), sx, rtol=1e-5, atol=1e-5)
    assert not xq[1, :g].any() and sc[1, 0, 0] == 0


@pytest.mark.parametrize("h,inter,limit,tiles", [(128, 96, None, None), (256, 64, 0.05, ((16, 1, 4), (8, 1, 4))),
                                                 (64, 32, None, ((4, 3, 4), (2, 16, 4))),
                                                 (256, 128, None, ((8, 2, 2), (16, 4, 8)))])
def test_pairs_are_the_matrices_times_the_rounded_rows(h, inter, limit, tiles):
    """Each pair's SwiGLU(gate x, up x) from x rounded to int8 (the CPU's rounding), then down times its activation
    rounded the same way, weighted: against float64 products of the unpacked matrices with the rounded rows (only
    float32's summation order between them); -1 pairs zero; the float kernels' pairs within int8's rounding; the
    pairs summed by the down launch in sum_pairs' order. tiles: (gate + up, down) rows a program, groups a step (3: a
    step past K's groups, masked), warps."""
    bank, dense = slab_bank("q4", h, inter, n_slots=5)
    bank.limit = limit
    assert q4_int8_rows.serves(bank)
    gen = torch.Generator().manual_seed(h)
    x = torch.randn(1, h, generator=gen)     # float32: no bf16 rounding of gate and up (the interpreter truncates)
    slots = torch.tensor([3, 0, -1, 4], device=DEV)
    wt = torch.rand(4, generator=gen).to(DEV)
    gu, dn = tiles or (None, None)
    got = q4_int8_rows.gate_up_act(x.to(DEV), 4, slots, bank, moe_triton._delta, gu)
    a = got[0]
    y = q4_int8_rows.down(got, slots, wt, bank, dn)
    # the activation's int8 rows, made by each pair's last program, are quantize's of the same rows (the groups'
    # float sums within float32's summation order: a reduction's tree follows the launch's layout)
    aw, asc = q4_int8_rows.quantize(a, inter // bank.parts["down"]["sz"].shape[1])
    assert torch.equal(got[1][0], aw) and torch.equal(got[1][1][:, :2], asc[:, :2])
    assert torch.allclose(got[1][1][:, 2], asc[:, 2], rtol=1e-5, atol=1e-5)
    summed = q4_int8_rows.down(got, slots, wt, bank, dn, total=torch.float32)
    in_order = torch.zeros_like(y[0])
    for j in range(4):          # moe_triton.sum_pairs' order: float32, pair 0 first
        in_order += y[j]
    assert summed.shape == (1, h) and torch.equal(summed[0], in_order)
    for j, s in enumerate(slots.tolist()):
        if s < 0:
            assert not a[j].any() and not y[j].any()
            continue
        g, u = (rounded_product(bank, mm, s, dense[s][mm], x) for mm in ("gate", "up"))
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        act = g * torch.sigmoid(g) * u
        assert ((a[j].cpu().double() - act).abs() <= 1e-5 * act.abs().max()).all()
        ref = wt[j].double().cpu() * rounded_product(bank, "down", s, dense[s]["down"], a[j:j + 1].cpu())
        assert ((y[j].cpu().double() - ref).norm() / ref.norm()) < 1e-5
    yf = q4_rows.down(q4_rows.gate_up_act(x.to(DEV), 4, slots, bank, moe_triton._delta), slots, wt, bank)
    assert ((y - yf).norm() / yf.norm()) < 2e-2


def test_weighted_pairs_takes_int8_for_a_decode_row_only():
    bank, _ = slab_bank("q4", 128, 64, n_slots=4)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 128, generator=gen).to(DEV)
    slots, wts = torch.tensor([[1, 2], [0, 3]], device=DEV), torch.rand(2, 2, generator=gen).to(DEV)
    one = moe_triton.weighted_pairs(x[:1], slots[:1], wts[:1], bank)
    q4_int8_rows.ENABLED = False
    try:
        flt = moe_triton.weighted_pairs(x[:1], slots[:1], wts[:1], bank)
        rows = moe_triton.weighted_pairs(x, slots, wts, bank)
    finally:
        q4_int8_rows.ENABLED = True
    assert not torch.equal(one, flt) and ((one - flt).norm() / flt.norm()) < 2e-2
    assert torch.equal(moe_triton.weighted_pairs(x, slots, wts, bank), rows)    # prefill rows: float32 both ways


def test_a_layers_pairs_in_two_groups_sum_to_one_groups_bits():
    """Exact per pair: the pairs computed in two groups (a small cache's reads landing) are one group's bits."""
    bank, _ = slab_bank("q4", 128, 64, n_slots=5)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 128, generator=gen).to(torch.bfloat16).to(DEV)
    wts = torch.rand(1, 4, generator=gen).to(DEV)
    full = torch.tensor([[3, 0, 1, 4]], device=DEV)
    one = routed_groups([x], [wts], [([full], True)], bank, moe_triton.pairs)[0]
    two = routed_groups([x], [wts], [([torch.tensor([[3, -1, 1, -1]], device=DEV)], False),
                                     ([torch.tensor([[-1, 0, -1, 4]], device=DEV)], False)], bank, moe_triton.pairs)[0]
    assert torch.equal(one, two) and one.any()
