"""models/row_graphs.py's group logic against moe.routed_groups on the CPU: the graphs' capture stood in for by an
eager one that writes each replay into the captured output, as a CUDA graph does. The graphs themselves run on
the GPU in tests/test_cuda.py (the cut step's bits against the eager step's)."""
from types import SimpleNamespace

import pytest
import torch

from waste.layers.moe import routed_groups
from waste.models.row_graphs import RowGroups

H, N, E, K = 16, 12, 10, 4


def _kernel(with_total: bool):
    """A weighted_pairs stand-in: weights[t, k] * (W_s x) per pair in float32, pairs with slot -1 zero."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(E, N, H, generator=g)

    def wp(x, s, w, bank, total=None):
        held = (s >= 0)
        y = torch.einsum("knh,h->kn", W[s.clamp(min=0)[0]], x[0].float()).unsqueeze(0) * w.unsqueeze(-1)
        y = torch.where(held.unsqueeze(-1), y, torch.zeros(()))
        return y if total is None else y.sum(1).to(total)
    wp.serves = lambda x, bank: True
    if with_total:
        wp.sum_pairs = lambda y, dt: y.sum(1).to(dt)
    return SimpleNamespace(weighted_pairs=wp)


def _eager_capture(fn):
    out = fn()

    def replay():
        y = fn()
        if y is not out:
            out.copy_(y)
    return SimpleNamespace(replay=replay), out


def _groups(slots: list[int], split: list[list[int]]):
    """The store's groups for one row routed to `slots`: each group holds the pairs at the positions it lists."""
    out = []
    for pos in split:
        s = torch.full((1, len(slots)), -1, dtype=torch.long)
        s[0, pos] = torch.tensor([slots[p] for p in pos], dtype=torch.long)
        out.append(([s], len(pos) == len(slots)))
    return out


@pytest.mark.parametrize("with_total", [True, False])
@pytest.mark.parametrize("split", [[[0, 1, 2, 3]], [[1], [0, 3], [2]], [[], [0, 1, 2, 3]], [[2, 0], [1, 3]]])
def test_row_groups_give_routed_groups_bits(with_total, split):
    kernel, bank = _kernel(with_total), SimpleNamespace(shapes={"down": (N, H)})
    rows = RowGroups(capture=_eager_capture)
    g = torch.Generator().manual_seed(1)
    for step in range(3):          # the same layer's graphs replayed on new rows, weights and slots
        x = torch.randn(1, H, generator=g).to(torch.bfloat16)
        w = torch.rand(1, K, generator=g)
        slots = torch.randperm(E, generator=g)[:K].tolist()
        want = routed_groups([x], [w], iter(_groups(slots, split)), bank, kernel)[0]
        got = rows.run(0, x, w, iter(_groups(slots, split)), bank, kernel)
        assert got.dtype == x.dtype and torch.equal(got, want)
    kinds = set(rows._layers[0].graphs)
    assert kinds == ({"whole"} if len(split) == 1 and with_total else
                     {"first", "total"} | ({"more"} if len(split) > 1 else set()))


def test_row_groups_refuse_a_group_after_a_complete_one():
    kernel, bank = _kernel(True), SimpleNamespace(shapes={"down": (N, H)})
    groups = _groups([1, 2, 3, 4], [[0, 1, 2, 3]]) * 2
    with pytest.raises(RuntimeError, match="after a complete one"):
        RowGroups(capture=_eager_capture).run(0, torch.randn(1, H), torch.rand(1, K), iter(groups), bank, kernel)
