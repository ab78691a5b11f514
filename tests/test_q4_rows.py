"""layers/q4_rows.py (q4 pairs on a GPU from the row layout its slab holds) against each record's own unpack, through
triton's interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET=1), compiled on a GPU; and the layout
itself (quant/int4pack.to_rows) against its definition."""
import pytest
import torch

pytest.importorskip("triton")
from test_moe_triton import DEV, slab_bank  # noqa: E402  (also patches the interpreter for numpy >= 2.4)

from waste.container.bank import RecordLayout  # noqa: E402
from waste.layers import moe_triton, q4_int8_rows, q4_rows  # noqa: E402
from waste.quant.formats import get_format  # noqa: E402
from waste.quant.int4pack import pack_nibbles, to_rows  # noqa: E402


@pytest.fixture(autouse=True)
def float_rows(monkeypatch):
    """These are q4_rows' float kernels: a decode row through weighted_pairs takes them, not q4_int8_rows'."""
    monkeypatch.setattr(q4_int8_rows, "ENABLED", False)


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


@pytest.mark.parametrize("N,K,g", [(128, 256, 64), (96, 64, 32), (80, 48, 16), (24, 16, 8)])
def test_rows_hold_each_groups_halves_in_the_two_nibbles(N, K, g):
    """Row r's byte (k // g) * g/2 + k % (g/2) holds column k: in the low nibble for the group's first half, the
    high one for its second; full 64-row blocks and a tail block alike."""
    gen = torch.Generator().manual_seed(N + K)
    q = torch.randint(0, 16, (3, N, K), generator=gen, dtype=torch.uint8)
    stored = torch.stack([pack_nibbles(q[i]) for i in range(3)])
    rows = to_rows(stored, N, K, g)
    assert rows.shape == (3, N, K // 2) and rows.dtype == torch.uint8
    k = torch.arange(K)
    byte = rows[:, :, (k // g) * (g // 2) + k % (g // 2)]
    nib = torch.where((k % g) < g // 2, byte & 15, byte >> 4)
    assert torch.equal(nib, q)


def test_device_layout_rewrites_only_the_slots_given():
    """The store's rewrite touches only the slots named, and only the nibbles: scales and padding stay as stored."""
    fmt = get_format("q4")
    gen = torch.Generator().manual_seed(3)
    recs = []
    for _ in range(3):
        t = {}
        for m, shape in (("gate", (64, 128)), ("up", (64, 128)), ("down", (128, 64))):
            t.update({f"{m}.{k}": v for k, v in fmt.pack(torch.randn(shape, generator=gen)).items()})
        recs.append(t)
    layout = RecordLayout.from_tensors(recs[0])
    pad = layout.record_bytes - layout.payload_bytes
    rows = torch.stack([torch.nn.functional.pad(torch.from_numpy(layout.pack(r)), (0, pad)) for r in recs])
    before = rows.clone()
    rewrite = q4_rows.device_layout(layout, fmt)
    on = rows.to(DEV, copy=True)      # the rewrite is a launch: the slab on the device its kernels run on
    rewrite(on, [2, 0])
    # (on a GPU a batch this small replays a captured graph: a second slab, then the same graph on new slot ids)
    on2 = before.to(DEV, copy=True)
    rewrite(on2, [1])
    rewrite(on2, [0])
    for got, done, kept in ((on.cpu(), (0, 2), 1), (on2.cpu(), (0, 1), 2)):
        assert torch.equal(got[kept], before[kept])
        for s in done:
            views, was = layout.views(got[s]), layout.views(before[s])
            for m, (N, K) in (("gate", (64, 128)), ("up", (64, 128)), ("down", (128, 64))):
                assert torch.equal(views[f"{m}.sz"], was[f"{m}.sz"])
                g = K // was[f"{m}.sz"].shape[0]
                assert torch.equal(views[f"{m}.q"], to_rows(was[f"{m}.q"][None], N, K, g)[0])
            assert torch.equal(got[s, layout.payload_bytes:], before[s, layout.payload_bytes:])


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


@pytest.mark.parametrize("fmt,h,inter,limit", [("q4", 256, 128, None), ("q4", 192, 96, 0.05), ("q4g32", 128, 64,
                                                                                                 None)])
@pytest.mark.parametrize("gate_up,down", [((16, 1, 4), (8, 1, 4)), ((8, 2, 2), (16, 4, 8)), ((4, 3, 4), (2, 16, 4))])
def test_pairs_and_their_sum_match_unpacked_matrices(fmt, h, inter, limit, gate_up, down):
    """Every tile (rows a program, groups a step, warps; groups a step that do not divide K's groups are masked):
    each weighted pair against the unpacked matrices, a slot twice the same bits, a -1 pair zero."""
    bank, dense = slab_bank(fmt, h, inter, n_slots=5)
    bank.limit = limit
    assert q4_rows.serves(bank)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, h, generator=gen).to(torch.bfloat16).to(DEV)
    slots = torch.tensor([[3, 0, -1, 4, 3]], device=DEV)
    wts = torch.rand(1, 5, generator=gen)
    wts[0, 4] = wts[0, 0]
    wts = wts.to(DEV)
    tune = dict(gate_up=gate_up, down=down)
    y = moe_triton.weighted_pairs(x, slots, wts, bank, **tune)[0]
    assert y.shape == (5, h) and y.dtype == torch.float32
    assert not y[2].any()
    ref = reference(bank, dense, x, slots, wts, limit)
    for j in (0, 1, 3, 4):
        # float32 sums over exact nibbles; the gate and up rows rounded to bf16 on either side (2^-8 each)
        assert rel(y[j], ref[j]) < 1e-2, (j, rel(y[j], ref[j]))
    assert torch.equal(y[0], y[4])

