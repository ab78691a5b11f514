"""The numba prefill kernels (quant/q4_rows.py, layers/cpu_prefill.py) against float64 products with the unpacked
matrices, and the rules that keep their bits fixed: a row's result depends neither on the thread count nor on the
rows beside it (other tokens, other pairs of its expert, a budget group that holds only some of its experts)."""
import numpy as np
import pytest
import torch

from waste.layers.mlp import swiglu_act
from waste.layers.moe import Bank, expert_pairs, kernel_for
from waste.quant.formats import get_format


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
    S, T, k = 6, 40, 2
    bank, ws = _bank(S, h, inter, limit)
    assert bank.rows_kernel() is not None
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
def test_q4_prefill_rows_are_the_unpacked_float32_product(shape):
    """Q4.linear of float32 rows above one: the matrix unpacked exactly, then one sgemm (no bf16 rounding of x)."""
    fmt, g = get_format("q4"), torch.Generator().manual_seed(2)
    w = torch.randn(shape, generator=g) / shape[1] ** 0.5
    parts = fmt.pack(w)
    d = fmt.unpack(parts, shape, torch.float64)
    for T in (2, 7, 128):
        x = torch.randn(T, shape[1], generator=g)
        ref = x.double() @ d.T
        assert ((fmt.linear(x, parts, shape).double() - ref).norm() / ref.norm()).item() < 1e-6
