"""The CUDA path on every family's oracle fixture (the Qwen3 fixture's own checks are tests/test_cuda.py): the same
tiny random release on the GPU routes every prompt token as the CPU does, gives its logits within float32 rounding
and the same greedy tokens, and a VRAM tier of a few layers' experts over the pinned host slab gives the GPU's
whole-slab bits and text. Skips without a GPU (CI has none): the fixtures are built only where it runs."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (CI has none)")

FAMILIES = ["kimi_linear", "deepseek_v3", "glm5_next", "kimi_k3", "gpt_oss", "qwen3_next", "mixtral", "glm4_moe"]


def _release(name, root):
    """(release directory, experts format to convert to): each family's oracle fixture, as its tests build it."""
    from fixtures import TOKENIZER_TEXT, kimi_linear_model, save_release

    if name == "kimi_k3":
        from k3_release import write_release

        from waste.convert.synthetic import write_tokenizer
        src = write_release(root / name, "mxfp4")
        write_tokenizer(src, TOKENIZER_TEXT, vocab_size=300)
        return src, "auto"
    if name == "gpt_oss":
        from test_oracle_gpt_oss import gpt_oss_model, mxfp4_release
        return mxfp4_release(save_release(gpt_oss_model(), root / name)), "auto"
    build = {"kimi_linear": kimi_linear_model}.get(name)
    if build is None:
        mod, fn = {"deepseek_v3": ("test_oracle_deepseek", "deepseek_model"),
                   "glm5_next": ("test_oracle_glm5", "glm5_model"),
                   "qwen3_next": ("test_oracle_qwen3_next", "qwen3_next_model"),
                   "mixtral": ("test_oracle_mixtral", "mixtral_model"),
                   "glm4_moe": ("test_oracle_glm4_moe", "glm4_moe_model")}[name]
        build = getattr(__import__(mod), fn)
    return save_release(build(), root / name), "bf16"


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from waste.convert.convert import convert

    import transformers
    from packaging.version import Version

    name = request.param
    if name == "glm5_next" and Version(transformers.__version__) < Version("5.24"):
        pytest.skip(f"the glm5_next fixture needs transformers 5.24's config (this has {transformers.__version__})")
    root = tmp_path_factory.mktemp(name)
    try:
        src, experts = _release(name, root)
    except ModuleNotFoundError as e:    # the oracle test module the fixture lives in imports it at the top
        pytest.skip(f"the {name} fixture's module needs {e.name}: pip install it")
    return name, convert(src, root / "m.waste", experts=experts, trunk="bf16", progress=False)


def _run(path, device, vram=None):
    import waste

    ids = list(range(3, 30))
    with waste.load(path, dtype="float32", device=device, vram=vram) as eng:
        eng.experts.wait_fill()
        m = eng.model
        m.route_trace = []
        logits = m.forward(torch.tensor(ids), m.new_state(), 0)
        routes = [(i, idx.cpu()) for i, idx in m.route_trace]
        m.route_trace = None
        toks = eng.generate(ids, max_tokens=12).token_ids
        ex = eng.experts
        return logits, toks, routes, (ex.tiered, ex.tier_copies, ex.n_dev, eng.model.top_k,
                                      eng.container.manifest["experts"]["record_bytes"])


def test_cuda_matches_cpu_and_a_vram_tier_the_whole_slab(family):

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name, path = family
    cpu, gpu = _run(path, "cpu"), _run(path, "cuda")
    assert gpu[0].device.type == "cpu"
    # the same experts for every token (top-k's order may differ between the devices' kernels: each id keeps its
    # weight, so only the weighted sum's order changes)
    same = lambda x, y: torch.equal(x.sort(-1).values, y.sort(-1).values)       # noqa: E731
    assert len(cpu[2]) == len(gpu[2]) and all(i == j and same(x, y)
                                              for (i, x), (j, y) in zip(cpu[2], gpu[2])), f"{name}: routing differs"
    rel = float((cpu[0] - gpu[0]).norm() / cpu[0].norm())
    assert rel < 1e-5, f"{name}: logits {rel:.2e} apart"
    assert cpu[1] == gpu[1], name
    top_k, rec = gpu[3][3], gpu[3][4]
    small = _run(path, "cuda", vram=2 * top_k * rec)       # two layers' experts: copied up and evicted
    assert small[3][0] and small[3][1] > small[3][2], f"{name}: the tier never refilled"
    assert torch.equal(small[0], gpu[0]), name
    assert small[1] == gpu[1], name


@pytest.mark.parametrize("family", ["kimi_linear", "glm5_next"], indirect=True)
def test_kda_layers_replayed_as_graphs_give_the_eager_bits(family):
    """Every expert resident: each KDA layer's whole one-row step (attention, MLP, the residual or mHC streams) is
    replayed from its captured graph (models/graphs.py `layer`), the state copied in and out: the same logits, bit
    for bit, as the eager step over four decode rows, and the same hits counted."""
    import waste

    name, path = family
    ids, res = list(range(3, 20)), {}
    for mode in ("eager", "graphs"):
        with waste.load(path, dtype="float32", device="cuda") as eng:
            eng.experts.wait_fill()
            m = eng.model
            if mode == "eager":
                m.graphs = None
            st = m.new_state()
            m.forward(torch.tensor(ids), st, 0)
            res[mode] = (torch.cat([m.forward(torch.tensor([t]), st, len(ids) + j, last_only=True)
                                    for j, t in enumerate((5, 9, 11, 7))]), eng.experts.stats.hits)
            if mode == "graphs":
                assert len(m.graphs.layers) == sum(k == "kda" for k in m.kinds) > 0, name
    assert torch.equal(res["graphs"][0], res["eager"][0]), name
    assert res["graphs"][1] == res["eager"][1], name
