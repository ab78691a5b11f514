"""The fixed-shape decode step a CUDA graph captures (models/graphs.py), checked on the CPU: Qwen3's attention with
the position as a tensor, the row put into the cache buffer and the keys past it masked, gives the eager step's
logits, and leaves a state the eager step continues from."""
import pytest
import torch

import waste
from waste.convert.convert import convert
from waste.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe
from waste.layers.rows import Rows


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    write_random_qwen3_moe(root / "src", qwen3_moe_config(), seed=1)
    return convert(root / "src", root / "m.waste", experts="bf16", trunk="bf16", progress=False)


def test_rows_put_writes_at_the_tensor_position_and_advances():
    r = Rows(torch.zeros(0, 2), capacity=8).append(torch.ones(3, 2))
    assert r.can_put(1) and not r.can_put(6)
    r2 = r.put(torch.full((1, 2), 5.0), torch.tensor([3]))
    assert len(r2) == 4 and torch.equal(r2.data[3], torch.full((2,), 5.0)) and torch.equal(r.data, torch.ones(3, 2))
    assert not r.can_put(1)                  # r is now a branch point: a put from it would overwrite r2's row
    r3 = r2.advance(1)                       # a replayed put wrote row 4: the host-side length follows
    assert len(r3) == 5 and r3.can_put(1)


def test_static_step_matches_eager_and_hands_back_a_state(container):
    with waste.load(container, dtype="float32") as eng:
        m = eng.model
        prompt = torch.arange(3, 20)
        st_s, st_e = m.new_state(), m.new_state()
        m.forward(prompt, st_s, 0)
        m.forward(prompt, st_e, 0)
        pos, tok = len(prompt), 7
        for step in range(6):
            assert m.graph_state(st_s, pos) is not None
            ls = m.step_logits([(torch.tensor([tok]), st_s, pos)], static=(torch.tensor([pos]), 32))[0]
            le = m.forward(torch.tensor([tok]), st_e, pos, last_only=True)
            assert (ls - le).norm() / le.norm() < 1e-5, step
            tok, pos = int(le.argmax()), pos + 1
        assert len(st_s[0]) == len(st_e[0]) == pos
        # the eager step continues from the static steps' state: the same logits as from the eager state
        a = m.forward(torch.tensor([tok, 9]), st_s, pos)
        b = m.forward(torch.tensor([tok, 9]), st_e, pos)
        assert (a - b).norm() / b.norm() < 1e-5
