"""The whole-layer decode graphs' body on the CPU (models/graphs.py `layer`; the GPU test replays real graphs):
a KDA layer's `layer_row`, with its state given as fixed tensors (`fixed_state`) copied in and out as the replay
does, gives the step loop's bits for Kimi-Linear and GLM-5.3, and only KDA layers offer themselves."""
import pytest
import torch

import waste


class RowsAsGraphs:
    """Stands in for DecodeGraphs: `layer` runs the captured function eagerly on copies, as a replay would."""

    def __init__(self, m):
        self.m, self.calls = m, 0

    def step(self, items, last_only):
        return None

    def mlp(self, i, x):
        return None

    def layer(self, i, h, st):
        fixed = self.m.fixed_state(i, st)
        if fixed is None or h.shape[0] != 1:
            return None
        ins, rebuild = fixed
        self.calls += 1
        h2, st2 = self.m.layer_row(i, h.clone(), rebuild([t.clone() for t in ins]))
        return h2.clone(), rebuild([t.clone() for t in self.m.fixed_state(i, st2)[0]])


@pytest.fixture(scope="module")
def glm5_container(tmp_path_factory):
    pytest.importorskip("transformers")
    from fixtures import save_release
    from test_oracle_glm5 import glm5_model

    from waste.convert.convert import convert

    root = tmp_path_factory.mktemp("glm5_rows")
    return convert(save_release(glm5_model(), root / "src"), root / "m.waste", experts="bf16", trunk="bf16",
                   progress=False)


@pytest.mark.parametrize("name", ["kimi_linear", "glm5_next"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_rows_give_the_step_loops_bits(name, dtype, releases, request):
    path = releases["kimi_linear"][2] if name == "kimi_linear" else request.getfixturevalue("glm5_container")
    ids, out = list(range(3, 20)), {}
    for mode in ("loop", "rows"):
        with waste.load(path, dtype=dtype) as eng:
            m = eng.model
            if mode == "rows":
                m.graphs = RowsAsGraphs(m)
            st = m.new_state()
            m.forward(torch.tensor(ids), st, 0)
            out[mode] = torch.cat([m.forward(torch.tensor([t]), st, len(ids) + j, last_only=True)
                                   for j, t in enumerate((5, 9, 11))])
            if mode == "rows":
                kda = sum(k == "kda" for k in m.kinds)
                assert kda > 0 and m.graphs.calls == 3 * kda
                assert all((m.fixed_state(i, s) is None) == (k != "kda") for i, (k, s) in enumerate(zip(m.kinds, st)))
    assert torch.equal(out["rows"], out["loop"])
