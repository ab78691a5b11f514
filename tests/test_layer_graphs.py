"""The whole-layer decode graphs' body on the CPU (models/graphs.py `layer`; the GPU test replays real graphs):
a KDA layer's `layer_row`, with its state given as fixed tensors (`fixed_state`) copied in and out as the replay
does, gives the step loop's bits for Kimi-Linear and GLM-5.3, and only KDA layers offer themselves."""
import pytest
import torch

import waste


class RowsAsGraphs:
    """Stands in for DecodeGraphs: `layer` runs the captured function eagerly on copies, as a replay would."""

    cutting = None      # never inside a cut step's capture

    def __init__(self, m):
        self.m, self.calls = m, 0

    def step(self, items, last_only):
        return None

    def mlp(self, i, x):
        return None

    def row_groups(self, xs, bank, kernel):     # the groups of experts eager (row_graphs.py is the GPU's)
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


@pytest.fixture(scope="module")
def k3_container(tmp_path_factory):
    from fixtures import TOKENIZER_TEXT
    from k3_release import write_release

    from waste.convert.convert import convert
    from waste.convert.synthetic import write_tokenizer

    root = tmp_path_factory.mktemp("k3_rows")
    src = write_release(root / "src", "mxfp4")
    write_tokenizer(src, TOKENIZER_TEXT, vocab_size=300)
    return convert(src, root / "m.waste", experts="auto", trunk="bf16", progress=False)


@pytest.mark.parametrize("name", ["kimi_linear", "glm5_next", "kimi_k3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_rows_give_the_step_loops_bits(name, dtype, releases, request):
    """Kimi K3 (KDA layers too, but attention-residual streams and its own layer loop) offers no layer."""
    path = {"kimi_linear": lambda: releases["kimi_linear"][2], "glm5_next": lambda: request.getfixturevalue(
        "glm5_container"), "kimi_k3": lambda: request.getfixturevalue("k3_container")}[name]()
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
                kda = 0 if name == "kimi_k3" else sum(k == "kda" for k in m.kinds)
                assert m.graphs.calls == 3 * kda and (kda > 0 or name == "kimi_k3")
                assert all((m.fixed_state(i, s) is None) == (k != "kda" or name == "kimi_k3")
                           for i, (k, s) in enumerate(zip(m.kinds, st)))
    assert torch.equal(out["rows"], out["loop"])
