"""The CUDA path (`--device cuda`): the same model on the GPU gives the CPU's logits within float32 rounding and
the same greedy tokens, with every expert resident and with a budget that makes the GPU mirror refill. Skips
without a GPU (CI has none); run on the GPU machine (docs/LEARNED.md §10)."""
import pytest
import torch

import waste
from waste.convert.convert import convert
from waste.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (CI has none)")


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    cfg = qwen3_moe_config()
    write_random_qwen3_moe(root / "src", cfg, seed=0)
    return {fmt: convert(root / "src", root / f"m-{fmt}.waste", experts=fmt, trunk="bf16", progress=False)
            for fmt in ("bf16", "q8", "q4")}


@pytest.mark.parametrize("fmt", ["bf16", "q8", "q4"])
@pytest.mark.parametrize("small", [False, True])
def test_cuda_logits_and_tokens_match_cpu(container, fmt, small):
    """float32 compute: bf16 / q8 experts match the CPU within float32 rounding and give the same tokens; q4 (float32
    rows through the fused triton kernel and the CPU's grouped prefill kernel; the CPU's decode rows round to int8)
    routes every token of the prompt the same and matches within bf16 rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    budget = None
    if small:        # one working set: the GPU mirror is refilled as layers evict each other's experts
        with waste.load(container[fmt], dtype="float32") as eng:
            budget = eng.plan.working_set_bytes
    ids = list(range(3, 40))
    out = {}
    for device in ("cpu", "cuda"):
        with waste.load(container[fmt], dtype="float32", device=device, budget=budget) as eng:
            m = eng.model
            m.route_trace = []
            logits = m.forward(torch.tensor(ids), m.new_state(), 0)
            routes = [(i, idx.cpu()) for i, idx in m.route_trace]
            m.route_trace = None
            out[device] = (logits, eng.generate(ids, max_tokens=16).token_ids, eng.experts.stats.misses, routes)
    a, b = out["cpu"][0], out["cuda"][0]
    assert b.device.type == "cpu"                    # logits come back to the host, where sampling runs
    assert all(i == j and torch.equal(x, y) for (i, x), (j, y) in zip(out["cpu"][3], out["cuda"][3]))
    assert (a - b).norm() / a.norm() < (1e-5 if fmt != "q4" else 2e-2)
    if fmt != "q4":
        assert out["cpu"][1] == out["cuda"][1]
    if small:
        assert out["cuda"][2] > 0                    # the mirror did refill


@pytest.mark.parametrize("fmt", ["bf16", "q4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_graphs_match_eager(container, fmt, dtype):
    """Every expert resident: a decode step replays CUDA graphs (slots looked up on the GPU). MoE layers alone
    graphed: the same bits as the eager step. The whole step graphed (attention over a masked fixed-size key
    buffer): float32 logits within float32 rounding of the eager step's and the same greedy text. Hits are
    counted the same on every path."""
    ids = list(range(3, 20))
    res = {}
    for mode in ("eager", "mlp", "whole"):
        with waste.load(container[fmt], dtype=dtype, device="cuda") as eng:
            eng.experts.wait_fill()
            m = eng.model
            assert m.graphs is not None
            if mode == "eager":
                m.graphs = None
            elif mode == "mlp":
                m.graphs.whole = False
            toks = eng.generate(ids, max_tokens=12).token_ids
            st = m.new_state()
            m.forward(torch.tensor(ids), st, 0)
            lasts = [m.forward(torch.tensor([t]), st, len(ids) + j, last_only=True) for j, t in enumerate(toks[:4])]
            res[mode] = (toks, torch.cat(lasts), eng.experts.stats.hits)
            if mode == "mlp":
                assert len(m.graphs.mlps) == sum(not d for d in m.dense) and not m.graphs.steps
            if mode == "whole":
                assert len(m.graphs.steps) >= 1
    assert res["mlp"][2] == res["eager"][2] == res["whole"][2]
    assert torch.equal(res["mlp"][1], res["eager"][1])
    assert res["mlp"][0] == res["eager"][0]
    if dtype == "float32":
        a, b = res["whole"][1], res["eager"][1]
        assert (a - b).norm() / b.norm() < 1e-5
        assert res["whole"][0] == res["eager"][0]


@pytest.mark.parametrize("fmt", ["bf16", "q4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("vram", [False, True])
def test_a_streamed_step_cut_into_graphs_matches_eager(container, fmt, dtype, vram):
    """Experts stream (a budget of one working set, or a VRAM tier of three layers' experts below the whole bank):
    a decode step replays graphs cut at its MoE layers, whose MLPs run eagerly between them (reads and all), each
    group of a layer's experts replayed as a graph of its own (row_graphs.py). The same bits as the same
    fixed-shape step run eagerly (models/graphs.py's static path, groups eager), in either dtype; against the
    eager step, float32 logits within float32 rounding and the same greedy text (in bfloat16 the static path's
    rounding flips near-tied routing of this tiny model: 0.7-19% apart on the CPU, no graph involved). Records
    move on every path; a chain holds one graph more than the model's MoE layers."""
    from waste.models.graphs import BUCKET
    ids = list(range(3, 20))
    with waste.load(container[fmt], dtype="float32") as eng:
        rec = eng.container.manifest["experts"]["record_bytes"]
        budget, tier = (None, 3 * eng.model.top_k * rec) if vram else (eng.plan.working_set_bytes, None)
    res = {}
    for mode in ("eager", "static", "cut"):
        with waste.load(container[fmt], dtype=dtype, device="cuda", budget=budget, vram=tier) as eng:
            m = eng.model
            assert m.graphs is not None and m.graphs.cut_usable() and not m.graphs.usable()
            m.graphs.cut_on = m.graphs.rows.on = mode == "cut"
            toks = eng.generate(ids, max_tokens=12).token_ids if mode != "static" else None
            feed = toks if mode == "eager" else res["eager"][0]     # every path's logits over the same tokens
            st = m.new_state()
            m.forward(torch.tensor(ids), st, 0)
            lasts = []
            for j, t in enumerate(feed[:6]):
                pos = len(ids) + j
                if mode == "static":
                    L = min(-(-(pos + 1) // BUCKET) * BUCKET, min(b.shape[0] for s in st for b in s.buffers()))
                    at = torch.tensor([pos], device="cuda")
                    with torch.inference_mode():        # as step() runs it
                        lasts.append(m.step_logits([(torch.tensor([t]), st, pos)], static=(at, L))[0].cpu())
                else:
                    lasts.append(m.forward(torch.tensor([t]), st, pos, last_only=True))
            moved = eng.experts.tier_copies if vram else eng.experts.stats.misses
            res[mode] = (toks, torch.cat(lasts), moved)
            if mode == "cut":
                chains = list(m.graphs.steps.values())
                assert chains and all(len(c[2]) == sum(not d for d in m.dense) + 1 for c in chains)
                # each MoE layer's expert groups replayed as graphs (row_graphs.py), partial groups among them
                kinds = {k for b in m.graphs.rows._layers.values() for k in b.graphs}
                assert len(m.graphs.rows._layers) == sum(not d for d in m.dense)
                assert kinds >= ({"whole"} if vram else {"first", "total"})    # (the tier holds every record)
            else:
                assert not m.graphs.steps and not m.graphs.rows._layers
    assert all(r[2] > 0 for r in res.values())          # records did move on every path
    assert torch.equal(res["cut"][1], res["static"][1])
    if dtype == "float32":
        a, b = res["cut"][1], res["eager"][1]
        assert (a - b).norm() / b.norm() < 1e-5
        assert res["cut"][0] == res["eager"][0]


@pytest.mark.parametrize("fmt", ["bf16", "q4"])
@pytest.mark.parametrize("whole", [False, True])
def test_dependent_and_fast_launches_give_the_jits_bits(container, fmt, whole):
    """The decode kernels launched dependent on the one before (triton_launch.pdl: their programs start early and
    read weights ahead of the wait) and through the fast launch give the bits of plain launches through triton's
    JIT, eager and in a whole-step graph: the same greedy text and the same decode logits."""
    from waste import triton_launch
    ids = list(range(3, 20))
    res = {}
    for fast in (False, True):
        triton_launch.PDL = triton_launch.ENABLED = fast
        try:
            with waste.load(container[fmt], dtype="bfloat16", device="cuda") as eng:
                eng.experts.wait_fill()
                m = eng.model
                if not whole:
                    m.graphs = None
                toks = eng.generate(ids, max_tokens=12).token_ids
                st = m.new_state()
                m.forward(torch.tensor(ids), st, 0)
                lasts = [m.forward(torch.tensor([t]), st, len(ids) + j, last_only=True)
                         for j, t in enumerate(toks[:6])]
                res[fast] = (toks, torch.cat(lasts))
        finally:
            triton_launch.PDL = triton_launch.ENABLED = True
    assert res[True][0] == res[False][0]
    assert torch.equal(res[True][1], res[False][1])


@pytest.mark.parametrize("fmt", ["bf16", "q4"])
def test_a_vram_tier_below_the_host_budget_gives_the_same_bits(container, fmt):
    """--vram of three layers' experts over the whole bank in pinned host memory: records copied up and evicted
    as layers need them, and the same logits, bit for bit, and text as the GPU slab that holds every record."""
    ids = list(range(3, 30))
    res = {}
    for small in (False, True):
        vram = None
        if small:
            with waste.load(container[fmt], dtype="float32") as eng:
                vram = 3 * eng.model.top_k * eng.container.manifest["experts"]["record_bytes"]
        with waste.load(container[fmt], dtype="float32", device="cuda", vram=vram) as eng:
            eng.experts.wait_fill()
            m = eng.model
            logits = m.forward(torch.tensor(ids), m.new_state(), 0)
            ex = eng.experts
            toks = eng.generate(ids, max_tokens=12).token_ids
            res[small] = (logits, toks, (ex.tiered, ex.pinned, ex.tier_copies if ex.tiered else 0, ex.n_dev))
    tiered, pinned, copies, n_dev = res[True][2]
    assert tiered and pinned and copies > n_dev
    assert torch.equal(res[True][0], res[False][0])
    assert res[True][1] == res[False][1]


def test_rms_norm_bf16_on_gpu_within_bf16_rounding():
    """On a GPU rms_norm is torch's one fused op for bf16 rows too: within two bf16 roundings (2^-8 each) of the
    float64 norm, as the CPU's float32-then-round lines are."""
    from waste.layers.norm import rms_norm
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 2048, generator=g) * 3).to(torch.bfloat16)
    w = (1 + torch.randn(2048, generator=g) * 0.1).to(torch.bfloat16)
    ref = rms_norm(x.double(), w.double(), 1e-6)
    gpu = rms_norm(x.cuda(), w.cuda(), 1e-6).cpu().double()
    cpu = rms_norm(x, w, 1e-6).double()
    err = lambda y: float(((y - ref).abs() / ref.abs().clamp_min(1e-3)).max())    # noqa: E731
    assert err(cpu) <= 2 ** -7
    assert err(gpu) <= 2 ** -7
