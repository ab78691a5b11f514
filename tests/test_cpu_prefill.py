"""The numba prefill kernels (quant/q4_rows.py, quant/q4_vnni.py, layers/cpu_prefill.py) against float64 products
(the unpacked matrices; for the int8 rows, tests/rowref.py's definition) and the rules that keep their bits fixed: a
row's result depends neither on the thread count nor on the rows beside it (other tokens, other pairs of its
expert, a budget group that holds only some of its experts); the int8 rows also have the decode row's bits."""
import numpy as np
import pytest
import torch
from rowref import row_product

from waste.layers.mlp import swiglu_act
from waste.layers.moe import Bank, expert_pairs, kernel_for
from waste.quant import q4_vnni
from waste.quant.formats import get_format

vnni = pytest.mark.skipif(not q4_vnni.available(), reason="needs AVX-512 VNNI (this host's CPU lacks it)")


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _matmul_rows(x, parts, shape):
    from waste.numba_ptr import follow_torch_threads
    from waste.quant import q4_rows

    (N, K), T = shape, x.shape[0]
    out = np.empty((T, N), np.float32)
    follow_torch_threads()
    q4_rows.matmul_rows(x.data_ptr(), T, parts["q"].data_ptr(), parts["sz"].data_ptr(), N, K, parts["sz"].shape[0],
                        4, out)
    return torch.from_numpy(out)


def _at_threads(f) -> dict:
    """f() at one and at two threads (numba's launch must leave torch's count as it was)."""
    got = {}
    for n in (1, 2):
        torch.set_num_threads(n)
        got[n] = f()
        assert torch.get_num_threads() == n
    return got


@pytest.mark.parametrize("shape", [(320, 96), (96, 320), (80, 64), (16, 6)])
def test_q4_rows_are_the_float32_product_and_each_rows_alone(shape, threads):
    fmt, g = get_format("q4"), torch.Generator().manual_seed(0)
    parts = fmt.pack(torch.randn(shape, generator=g) / shape[1] ** 0.5)
    x = torch.randn(11, shape[1], generator=g)
    got = _at_threads(lambda: _matmul_rows(x, parts, shape))
    ref = x.double() @ fmt.unpack(parts, shape, torch.float64).T
    assert ((got[1].double() - ref).norm() / ref.norm()).item() < 1e-6
    assert torch.equal(got[1], got[2])
    for i in (0, 5, 10):                                  # a row alone (and in another group of four) is the same
        assert torch.equal(_matmul_rows(x[i:i + 1].contiguous(), parts, shape), got[1][i:i + 1])
        assert torch.equal(_matmul_rows(x[i:].contiguous(), parts, shape)[0], got[1][i])


def _bank(S, h, inter, limit=None, seed=0):
    fmt, g = get_format("q4"), torch.Generator().manual_seed(seed)
    parts, ws = {}, {}
    for m, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
        packed = [fmt.pack(torch.randn(shape, generator=g) / shape[1] ** 0.5) for _ in range(S)]
        parts[m] = {k: torch.stack([p[k] for p in packed]) for k in ("q", "sz")}
        ws[m] = torch.stack([fmt.unpack(p, shape, torch.float64) for p in packed])
    bank = Bank(parts, {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}, fmt, limit=limit)
    return bank, ws


def _reference(x, slots, ws, limit):
    T, k = slots.shape
    out = torch.zeros(T, k, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            s = int(slots[t, j])
            if s >= 0:
                xr = x[t].double()
                out[t, j] = ws["down"][s] @ swiglu_act(ws["gate"][s] @ xr, ws["up"][s] @ xr, limit)
    return out


@pytest.mark.parametrize("h,inter,limit", [(320, 96, None), (128, 160, 7.0)])
def test_grouped_q4_pairs_match_the_unpacked_experts_and_keep_their_bits(h, inter, limit, threads):
    from waste.layers import cpu_prefill

    S, T, k = 6, 40, 2
    bank, ws = _bank(S, h, inter, limit)
    assert bank.rows_kernel() is not None
    bank.rows_kernel().fn = cpu_prefill.pairs_q4_rows     # the float tiles (small records, or no VNNI)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, h, generator=g)
    slots = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)])
    slots[3, 1] = -1                                      # a pair another group computes: left zero
    kernel = kernel_for(bank.fmt, "cpu")
    got = _at_threads(lambda: kernel(x, slots, bank))
    ref = _reference(x, slots, ws, limit)
    assert ((got[1].double() - ref).norm() / ref.norm()).item() < 1e-6
    assert torch.equal(got[1][3, 1], torch.zeros(h))
    assert torch.equal(got[1], got[2])
    # rows alone, a chunk of them, and a budget group holding only some experts: each pair the same bits
    assert torch.equal(kernel(x[7:9], slots[7:9], bank), got[1][7:9])
    held = torch.where(slots % 2 == 0, slots, -1)
    part = expert_pairs(x, held, bank, kernel, complete=False)
    assert torch.equal(part[held >= 0], got[1][held >= 0]) and not part[held < 0].any()


@pytest.mark.parametrize("shape", [(320, 320), (96, 320), (80, 64), (720, 2048)])
def test_q4_prefill_rows_are_the_unpacked_float32_product(shape, monkeypatch):
    """Q4.linear of float32 rows above one without the VNNI rows: the matrix unpacked exactly, then one sgemm (no
    bf16 rounding of x)."""
    monkeypatch.setattr(q4_vnni, "available", lambda: False)
    fmt, g = get_format("q4"), torch.Generator().manual_seed(2)
    w = torch.randn(shape, generator=g) / shape[1] ** 0.5
    parts = fmt.pack(w)
    d = fmt.unpack(parts, shape, torch.float64)
    for T in (2, 7, 128):
        x = torch.randn(T, shape[1], generator=g)
        ref = x.double() @ d.T
        assert ((fmt.linear(x, parts, shape).double() - ref).norm() / ref.norm()).item() < 1e-6


@vnni
@pytest.mark.parametrize("shape", [(320, 320), (160, 320), (96, 320), (80, 64), (720, 2048)])
def test_q4_vnni_rows_are_the_decode_rows(shape, threads):
    """The int8 rows by VNNI (what Q4.linear takes above q4_vnni.MIN_WEIGHTS): each row within 1e-6 of the product
    the decode row defines (rowref.row_product) and with the decode row's bits, at 1 and 2 threads, whatever rows
    share the call; tail blocks (160, 96, 80 rows) included."""
    fmt, g = get_format("q4"), torch.Generator().manual_seed(3)
    parts = fmt.pack(torch.randn(shape, generator=g) / shape[1] ** 0.5)
    x = torch.randn(70, shape[1], generator=g)          # a task of 64 rows and one of 6
    got = _at_threads(lambda: q4_vnni.linear(x, parts, shape))
    assert torch.equal(got[1], got[2])
    rows = torch.cat([fmt.linear(x[i:i + 1], parts, shape) for i in range(x.shape[0])])
    assert torch.equal(got[1], rows)
    for i in (0, 33, 69):
        ref = row_product(fmt, x[i:i + 1], parts, shape)
        assert ((got[1][i].double() - ref[0]).norm() / ref.norm()).item() < 1e-6
    assert torch.equal(q4_vnni.linear(x[5:8], parts, shape), got[1][5:8])
    if q4_vnni.serves(*shape):                            # Q4.linear takes it, for bf16 rows too (widened, rounded)
        assert torch.equal(fmt.linear(x, parts, shape), got[1])
        xb = x.bfloat16()
        assert torch.equal(fmt.linear(xb, parts, shape), q4_vnni.linear(xb.float(), parts, shape).bfloat16())


@vnni
@pytest.mark.parametrize("h,inter,limit", [(320, 96, None), (128, 160, 7.0), (256, 192, None)])
def test_grouped_q4_vnni_pairs_are_the_decode_pairs(h, inter, limit, threads):
    """The grouped int8 pairs (layers/cpu_prefill.pairs_q4_i8): each pair the decode row's kernel's bits (that kernel
    is held to rowref's product in tests/test_cpu_kernels.py), at 1 and 2 threads, alone, in a chunk and in a budget
    group; a skipped pair left zero."""
    from waste.layers import cpu_prefill

    S, T, k = 6, 40, 2
    bank, ws = _bank(S, h, inter, limit)
    bank.rows_kernel().fn = cpu_prefill.pairs_q4_i8
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, h, generator=g)
    slots = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)])
    slots[3, 1] = -1
    kernel = kernel_for(bank.fmt, "cpu")
    got = _at_threads(lambda: kernel(x, slots, bank))
    assert torch.equal(got[1], got[2])
    rows = torch.cat([expert_pairs(x[t:t + 1], slots[t:t + 1], bank, kernel, False) for t in range(T)])
    assert torch.equal(got[1], rows)
    assert torch.equal(got[1][3, 1], torch.zeros(h))
    ref = _reference(x, slots, ws, limit)                 # and near the float64 experts (int8 rows: ~1% of q4's)
    assert ((got[1].double() - ref).norm() / ref.norm()).item() < 2e-2
    assert torch.equal(kernel(x[7:9], slots[7:9], bank), got[1][7:9])
    held = torch.where(slots % 2 == 0, slots, -1)
    part = expert_pairs(x, held, bank, kernel, complete=False)
    assert torch.equal(part[held >= 0], got[1][held >= 0]) and not part[held < 0].any()
    xb = x.bfloat16()                                     # bf16 compute: widened, the pairs rounded back, as a row
    got_b = kernel(xb, slots, bank)
    assert got_b.dtype == torch.bfloat16 and torch.equal(got_b, kernel(xb.float(), slots, bank).bfloat16())
    assert torch.equal(got_b, torch.cat([expert_pairs(xb[t:t + 1], slots[t:t + 1], bank, kernel, False)
                                         for t in range(T)]))


@vnni
@pytest.mark.parametrize("shape", [(640, 512), (5120, 256), (1024, 288)])
def test_q8_trunk_rows_by_vnni(shape, threads):
    """A prefill chunk through a q8 trunk matrix (quant/linear.py -> quant/q8_rows.py): each row within 1e-6 of the
    product with the row rounded to int8 in blocks of 32 (tests/rowref.py), the same bits at 1 and 2 threads and
    whatever rows share the call, bf16 rows widened and rounded back; Q8.linear itself (the experts' pairs) stays
    the float32 product with the unrounded row."""
    from waste.quant import q8_rows
    from waste.quant.linear import QuantWeight, linear
    from rowref import q8_row_product

    fmt, g = get_format("q8"), torch.Generator().manual_seed(5)
    parts = fmt.pack(torch.randn(shape, generator=g) / shape[1] ** 0.5)
    w = QuantWeight(fmt, parts, shape)
    assert q8_rows.serves(*shape)
    x = torch.randn(70, shape[1], generator=g)
    got = _at_threads(lambda: linear(x, w))
    assert torch.equal(got[1], got[2])
    for i in (0, 37, 69):
        ref = q8_row_product(fmt, x[i:i + 1], parts, shape)
        assert ((got[1][i].double() - ref[0]).norm() / ref.norm()).item() < 1e-6
    assert torch.equal(linear(x[3:9], w), got[1][3:9])
    xb = x.bfloat16()
    assert torch.equal(linear(xb, w), linear(xb.float(), w).bfloat16())
    exact = x.double() @ fmt.unpack(parts, shape, torch.float64).T
    assert ((fmt.linear(x, parts, shape).double() - exact).norm() / exact.norm()).item() < 1e-6
