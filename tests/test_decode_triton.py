"""The fused decode-row kernels (layers/decode_triton.py; moe_triton.weighted_pairs) against the torch ops they replace.
Through triton's interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET=1), compiled on a GPU."""
import pytest
import torch

pytest.importorskip("triton")
from test_moe_triton import DEV, slab_bank  # noqa: E402  (also patches the interpreter for numpy >= 2.4)

from waste.layers import decode_triton, moe_triton, q4_int8_rows  # noqa: E402
from waste.layers.moe import MATRICES, routed_experts, routed_groups  # noqa: E402
from waste.layers.attention import masked_attend  # noqa: E402
from waste.layers.norm import rms_norm  # noqa: E402
from waste.layers.rope import RopeTable, apply_rope_table  # noqa: E402


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


@pytest.mark.parametrize("dtype,norm", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_qk_rope_put_matches_norm_rope_and_cache_write(dtype, norm):
    H, KV, d, cap, pos, eps = 4, 2, 32, 16, 5, 1e-6
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, (H + 2 * KV) * d, generator=g).to(dtype).to(DEV)
    qn, kn = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEV), (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEV)
    rope = RopeTable(d, 1e6, cap, dtype, DEV)
    kb = torch.full((cap, KV, d), 7.0, dtype=dtype, device=DEV)     # poisoned: the row must be written
    vb = kb.clone()
    q = decode_triton.qk_rope_put(qkv, H, KV, d, qn if norm else None, kn if norm else None, eps, rope.cos, rope.sin,
                                  torch.tensor([pos], device=DEV), kb, vb)
    rq, rk, rv = qkv.view(1, H + 2 * KV, d).split((H, KV, KV), dim=1)
    if norm:
        rq, rk = rms_norm(rq, qn, eps), rms_norm(rk, kn, eps)
    cos, sin = rope.at(pos, 1)
    rq, rk = apply_rope_table(rq, cos, sin, rope.R), apply_rope_table(rk, cos, sin, rope.R)
    tol = 1e-6 if dtype == torch.float32 else 1e-2      # bf16: the torch path rounds between its ops, this once
    assert q.shape == (1, H, d) and q.dtype == dtype
    assert rel(q, rq) < tol and rel(kb[pos], rk[0]) < tol
    assert torch.equal(vb[pos], rv[0])
    others = torch.ones(cap, dtype=torch.bool)
    others[pos] = False
    assert (kb[others] == 7.0).all() and (vb[others] == 7.0).all()      # no other row touched


@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize("pos", [0, 70, 200])
def test_attend_row_matches_masked_attention(pos, split, monkeypatch):
    """Grouped-query attention of one row over cache rows 0 .. pos (more than one 64-row block at 70), the rows past
    it poisoned: they must not count. split: the rows in shares (None: split_of's, 16 at 4 heads: empty shares at
    0 and 70; 3: several 32-row steps a share at 200) or one program a head (1)."""
    if split is not None:
        monkeypatch.setattr(decode_triton, "split_of", lambda H: split)
    H, KV, d, cap = 4, 2, 32, 224
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, H, d, generator=g).to(DEV)
    kb, vb = torch.randn(cap, KV, d, generator=g).to(DEV), torch.randn(cap, KV, d, generator=g).to(DEV)
    kb[pos + 1:], vb[pos + 1:] = 1e4, float("nan")
    o = decode_triton.attend_row(q, kb, vb, torch.tensor([pos], device=DEV))
    ref = masked_attend(q.cpu(), kb[:pos + 1].cpu(), vb[:pos + 1].cpu(), torch.ones(1, pos + 1, dtype=torch.bool))
    assert o.shape == (1, H, d) and rel(o, ref) < 1e-5


def test_softmax_topk_tail_matches_torch():
    g = torch.Generator().manual_seed(3)
    for E, k, norm in ((128, 8, True), (60, 6, False), (16, 2, True)):
        logits = torch.randn(3, E, generator=g).to(DEV)
        w, idx = decode_triton.softmax_topk_tail(logits, k, norm)
        pw, pidx = torch.topk(torch.softmax(logits.cpu(), -1), k, dim=-1)
        if norm:
            pw = pw / pw.sum(-1, keepdim=True)
        assert torch.equal(idx.cpu(), pidx), (E, k)
        assert torch.allclose(w.cpu(), pw, rtol=1e-5, atol=1e-7) and w.dtype == torch.float32


@pytest.mark.parametrize("fmt,h,inter,limit", [("bf16", 64, 32, None), ("q8", 64, 32, None), ("q4", 128, 96, None),
                                               ("q4", 128, 64, 0.05)])
def test_weighted_pairs_match_pairs_and_weighted_sum(fmt, h, inter, limit, monkeypatch):
    """The down launch with the activation applied (q4: by the gate and up launch) and the routing weight applied,
    against the two-launch pairs and the separate weighted sum; a -1 pair stays zero; and a layer's pairs arriving
    in two groups (a small cache) sum to the same bits as in one. q4 in float32 rows (q4_rows; the int8 rows of
    q4_int8_rows are checked against their own rounding in tests/test_q4_int8_rows.py)."""
    monkeypatch.setattr(q4_int8_rows, "ENABLED", False)
    bank, _ = slab_bank(fmt, h, inter, n_slots=5)
    bank.limit = limit
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, h, generator=g).to(DEV)
    slots = torch.tensor([[3, 0, -1, 4]], device=DEV)
    wts = torch.rand(1, 4, generator=g).to(DEV)
    assert moe_triton.serves(x, bank)
    yp = moe_triton.weighted_pairs(x, slots, wts, bank)
    assert yp.shape == (1, 4, h) and yp.dtype == torch.float32 and not yp[0, 2].any()
    y = yp.sum(1)
    ref = routed_experts(x, slots, wts, bank, moe_triton.pairs, complete=False)
    # float / q8: float32 throughout; q4: the torch path rounds the activation and each pair's output to bf16
    tol = 1e-5 if fmt != "q4" else 1e-2
    assert rel(y, ref) < tol, fmt
    full = torch.tensor([[3, 0, 1, 4]], device=DEV)
    one = routed_groups([x], [wts], [([full], True)], bank, moe_triton.pairs)[0]
    two = routed_groups([x], [wts], [([torch.tensor([[3, -1, 1, -1]], device=DEV)], False),
                                     ([torch.tensor([[-1, 0, -1, 4]], device=DEV)], False)], bank, moe_triton.pairs)[0]
    assert torch.equal(one, two)
    assert rel(one, routed_experts(x, full, wts, bank, moe_triton.pairs)) < tol


def test_weighted_pairs_declines_what_it_does_not_compute():
    bank, _ = slab_bank("bf16", 64, 32, n_slots=3)
    x = torch.randn(2, 64).to(DEV)
    assert moe_triton.serves(x[:1], bank) and not moe_triton.serves(x, bank)   # float prefill: moe.segments
    bank.act = ("oai_glu", 1.7, 7.0)
    assert not moe_triton.serves(x[:1], bank)
    assert set(MATRICES) == {"gate", "up", "down"}


@pytest.mark.parametrize("dtype,N", [(torch.bfloat16, 2048), (torch.float32, 300), (torch.bfloat16, 96)])
def test_add_rms_is_the_add_then_the_norm(dtype, N):
    """add_rms: the residual add with torch's bits (a bf16 add widens, adds and rounds once), the norm of its result
    within one rounding of torch's rms_norm with the weight cast; rms_rows the same norm without the add, the same
    bits as add_rms's norm of the same rows."""
    g = torch.Generator().manual_seed(11)
    h = torch.randn(3, N, generator=g).to(dtype).to(DEV)
    y = torch.randn(3, N, generator=g).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(DEV)          # float32, as the trunk keeps its norms
    oh, x = decode_triton.add_rms(h, y, w, 1e-6)
    assert oh.dtype == x.dtype == dtype
    if torch.cuda.is_available() or dtype == torch.float32:
        assert torch.equal(oh, h + y)
    else:       # triton 3.6's interpreter truncates a float32 stored as bf16 (the GPU rounds): one bf16 step at most
        assert ((oh.float() - (h + y).float()).abs() <= (h + y).float().abs() * 2 ** -7).all()
    ref = torch.nn.functional.rms_norm((h + y).float(), (N,), w, 1e-6)
    assert rel(x, ref) < (1e-6 if dtype == torch.float32 else 5e-3)
    assert torch.equal(decode_triton.rms_rows(oh, w, 1e-6), x)


@pytest.mark.parametrize("E,H,k,norm,wdtype,xdtype", [(128, 256, 8, True, torch.float32, torch.bfloat16),
                                                       (60, 96, 6, False, torch.float32, torch.float32),
                                                       (16, 3000, 2, True, torch.bfloat16, torch.bfloat16)])
def test_router_row_is_the_logits_then_the_tail(E, H, k, norm, wdtype, xdtype):
    """router_row: float32 logits of x widened (H past one 2048-column step at 3000), then softmax_topk_tail's
    choice; called three times on other rows, so the count its last program resets must be zero each time."""
    g = torch.Generator().manual_seed(E)
    r = (torch.randn(E, H, generator=g) / H ** 0.5).to(wdtype).to(DEV)
    for _ in range(3):
        x = torch.randn(1, H, generator=g).to(xdtype).to(DEV)
        w, idx = decode_triton.router_row(x, r, k, norm)
        logits = x.double().cpu() @ r.double().cpu().T
        pw, pidx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
        if norm:
            pw = pw / pw.sum(-1, keepdim=True)
        assert torch.equal(idx.cpu(), pidx) and w.dtype == torch.float32 and w.shape == (1, k)
        assert torch.allclose(w.cpu().double(), pw, rtol=1e-5, atol=1e-7)
    assert not decode_triton.counts(r.device, 1, "router_row").any()
