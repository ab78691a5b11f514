"""layers/moe.py: every registered kernel, and the per-expert segments path, against float64 SwiGLU on the
dequantized weights; partial groups add up to the whole."""
import pytest
import torch

from waste.layers.moe import Bank, kernel_for, routed_experts, segments
from waste.quant.formats import get_format
from rowref import row_product

H, I, E, K = 64, 32, 6, 2


def make_bank(fmt_name: str, seed: int = 0):
    """A slab of E records in the format, as [E, ...] part tensors, and the float64 matrices they hold."""
    fmt = get_format(fmt_name)
    g = torch.Generator().manual_seed(seed)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    parts = {m: {} for m in shapes}
    dense = {m: [] for m in shapes}
    for _ in range(E):
        for m, sh in shapes.items():
            p = fmt.prepare(fmt.pack(torch.randn(sh, generator=g) * 0.1), sh)
            for k, v in p.items():
                parts[m].setdefault(k, []).append(v)
            dense[m].append(fmt.unpack(p, sh, torch.float64))
    parts = {m: {k: torch.stack(v) for k, v in p.items()} for m, p in parts.items()}
    return Bank(parts, shapes, fmt), {m: torch.stack(v) for m, v in dense.items()}


def reference(x, slots, weights, dense):
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(slots.shape[1]):
            s = int(slots[t, j])
            xd = x[t].double()
            h = torch.nn.functional.silu(dense["gate"][s] @ xd) * (dense["up"][s] @ xd)
            out[t] += weights[t, j].double() * (dense["down"][s] @ h)
    return out


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8", "q4"])
@pytest.mark.parametrize("T", [1, 5])
def test_kernels_match_float64(fmt, T):
    bank, dense = make_bank(fmt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    slots = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    got = routed_experts(x, slots, w, bank, kernel_for(bank.fmt, "cpu"))
    want = reference(x, slots, w, dense)
    # q4 multiplies bf16 activations (docs/LEARNED.md §5b); the others are float32 arithmetic
    tol = 2e-2 if fmt == "q4" else 1e-5
    assert (got.double() - want).norm() / want.norm() < tol


@pytest.mark.parametrize("fmt", ["f32", "q8"])
def test_gather_and_segments_agree(fmt):
    bank, _ = make_bank(fmt)
    x = torch.randn(1, H)
    slots = torch.tensor([[4, 1]])
    a = kernel_for(bank.fmt, "cpu")(x, slots, bank)
    b = segments(x, slots, bank)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_partial_groups_add_up_to_the_whole():
    """A layer that needs more experts than the budget has slots is computed in groups; every pair in one group."""
    bank, _ = make_bank("f32")
    x = torch.randn(3, H)
    slots = torch.tensor([[0, 1], [2, 3], [1, 4]])
    w = torch.rand(3, K)
    whole = routed_experts(x, slots, w, bank, kernel_for(bank.fmt, "cpu"))
    first = torch.where(slots < 2, slots, -1)
    second = torch.where(slots >= 2, slots, -1)
    parts = (routed_experts(x, first, w, bank, None, complete=False)
             + routed_experts(x, second, w, bank, None, complete=False))
    assert torch.allclose(whole, parts, rtol=1e-6, atol=1e-7)



@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8", "q4"])
@pytest.mark.parametrize("limit", [None, 0.05])
def test_decode_row_kernel_matches_float64(fmt, limit):
    """One float32 row on the CPU goes through layers/moe_cpu.py's numba kernel (the records read in place, the row
    kept in float32; q4's full blocks take it rounded to int8, tests/rowref.py), with and without the clamped
    SwiGLU."""
    bank, dense = make_bank(fmt)
    bank.limit = limit
    assert bank.row_kernel() is not None
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, H, generator=g)
    slots = torch.tensor([[5, 2]])
    y = kernel_for(bank.fmt, "cpu")(x, slots, bank)
    for j in range(K):
        s = int(slots[0, j])

        def mv(m, v):                                    # the kernel's product of record s's matrix m with row v
            if fmt != "q4":
                return dense[m][s] @ v.double()
            rec = {k: t[s] for k, t in bank.parts[m].items()}
            return row_product(bank.fmt, v.float()[None], rec, bank.shapes[m])[0]

        gt, up = mv("gate", x[0]), mv("up", x[0])
        if limit is not None:
            gt, up = gt.clamp(max=limit), up.clamp(-limit, limit)
        want = mv("down", torch.nn.functional.silu(gt) * up)
        assert (y[0, j].double() - want).norm() / want.norm() < 1e-5


@pytest.mark.parametrize("fmt", ["bf16", "q4"])
def test_decode_row_kernel_is_exact_per_pair(fmt):
    """A pair's output is the same bits alone, beside another pair, or beside a pair another group holds (-1,
    left zero): what bit-identity across budgets and cache warmth rests on."""
    bank, _ = make_bank(fmt)
    kern = kernel_for(bank.fmt, "cpu")
    x = torch.randn(1, H)
    both = kern(x, torch.tensor([[3, 1]]), bank)
    alone = kern(x, torch.tensor([[1]]), bank)
    held = kern(x, torch.tensor([[-1, 1]]), bank)
    assert torch.equal(both[0, 1], alone[0, 0]) and torch.equal(held[0, 1], both[0, 1])
    assert not held[0, 0].any()
