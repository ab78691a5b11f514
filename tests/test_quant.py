"""Quantized containers: against the oracle and the bf16 container, formats kept as released, routing to fewer
experts, q4 on other torch kernel layouts. Bounds come from docs/LEARNED.md §5. (Kernels: test_quant_kernels.py.)"""
import json
import sys
from pathlib import Path

import pytest
import torch

import waste
from waste.convert.convert import convert
from waste.default_model import BUNDLED
from waste.errors import WasteError
from waste.quant import int4pack
from waste.quant.quality import agreement, compare, greedy

HELDOUT = Path(__file__).parent / "data" / "heldout_waste_source.py.txt"
TIE = 0.05        # a top-2 logit gap below this is a near-tie: either token is a right answer (seed 0.7.0)

# On the bundled trained model (docs/LEARNED.md §5c), first 1024 held-out tokens. q8 and q4 are held to the
# targets (KL <= 1e-3 and <= 1e-2); vq3 and mxfp4 (re-quantized from float) to their measured figure plus 25%.
# Measured on this text: q8/bf16 2.4e-4, q8/q8 7.3e-4, q4/bf16 9.4e-3, q4/q8 9.3e-3, vq3 2.8e-2, mxfp4 2.2e-2.
BOUNDS = {("q8", "bf16"): 1e-3, ("q8", "q8"): 1e-3, ("q4", "bf16"): 1e-2, ("q4", "q8"): 1e-2,
          ("vq3", "bf16"): 3.5e-2, ("mxfp4", "bf16"): 2.75e-2}
TOP1 = {"q8": 0.98, "q4": 0.93, "vq3": 0.89, "mxfp4": 0.90}     # measured 0.992, 0.950, 0.917, 0.921


def test_off_avx512_q4_records_are_repacked_once_per_fill(bundled_ref, monkeypatch):
    """On a torch build whose int4 layout is not the stored one (AVX2, ARM: simulated here), the expert cache
    repacks a q4 record when it fills a slot, not at every matmul, and the output is the native run's."""
    from waste.quant.intq import Q4

    from waste.layers import cpu_prefill

    root, _, ids, _, _ = bundled_ref
    out = convert(BUNDLED, root / "repack.waste", experts="q4", trunk="bf16", progress=False)
    seq = torch.tensor(ids[:24])
    # the native run through torch's int4 kernel, as the repacked records are (the grouped numba prefill kernel
    # reads the stored layout only: layers/cpu_prefill.py)
    monkeypatch.setattr(cpu_prefill, "MAX_WEIGHTS", 0)
    with waste.load(out, dtype="float32", preload=False) as eng:
        want = eng.model.forward(seq, eng.model.new_state(), 0)
        ws = eng.plan.working_set_bytes
    calls = []
    prepare = Q4.prepare
    monkeypatch.setattr(int4pack, "native", lambda: False)
    monkeypatch.setattr(Q4, "prepare", lambda self, parts, shape: calls.append(shape) or prepare(self, parts, shape))
    with waste.load(out, dtype="float32", budget=2 * ws, preload=False) as eng:
        got = eng.model.forward(seq, eng.model.new_state(), 0)
        for f in list(eng.experts.loading.values()):     # a prefetch still reading
            f.result()
        reads = eng.experts.stats.misses + eng.experts.stats.prefetch_reads
    assert torch.equal(got, want)
    assert reads > 0 and len(calls) == 3 * reads        # gate, up and down of each record read, nothing per call


AVX2_CHILD = """
import sys, torch, waste
from waste.quant import int4pack
with waste.load(sys.argv[1], dtype="float32", preload=False) as eng:
    out = eng.model.forward(torch.tensor(eval(sys.argv[2])), eng.model.new_state(), 0)
torch.save(out, sys.argv[3])
print(torch.backends.cpu.get_cpu_capability(), int4pack.kernel_block())
"""


def test_q4_on_torchs_avx2_kernels(bundled_ref, tmp_path):
    """The same q4 container run with torch dispatching to its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, as on most
    laptops): records are reshuffled into AVX2's 32-row blocks at fill, and the logits agree with this build's
    within two bf16 roundings (2^-8; measured 8.4e-4), every argmax the same."""
    import os
    import subprocess

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("needs an AVX-512 machine: elsewhere the default kernels are the AVX2 ones, and the test would "
                    "compare a run with itself")
    root, _, ids, _, _ = bundled_ref
    out = convert(BUNDLED, root / "avx2.waste", experts="q4", trunk="q8", progress=False)
    seq = ids[:64]
    with waste.load(out, dtype="float32", preload=False) as eng:
        want = eng.model.forward(torch.tensor(seq), eng.model.new_state(), 0)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    r = subprocess.run([sys.executable, "-c", AVX2_CHILD, str(out), repr(seq), str(tmp_path / "l.pt")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    capability, block = r.stdout.split()[-2:]
    assert capability == "AVX2" and block == "32"
    got = torch.load(tmp_path / "l.pt")
    assert ((got - want).norm() / want.norm()).item() < 2 ** -8
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _oracle_gap_and_argmax(hf, ids):
    with torch.no_grad():
        logits = hf(torch.tensor(ids)[None]).logits[0]
    top2 = logits.topk(2, -1).values
    return top2[:, 0] - top2[:, 1], logits.argmax(-1)


@pytest.mark.parametrize("family,trunk", [("qwen3_moe", "q8"), ("kimi_linear", "bf16")])
def test_q8_container_follows_the_oracle_except_at_near_ties(family, trunk, releases, tmp_path):
    """Greedy continuation of the q8 container against transformers on the release's weights: equal up to the
    oracle's first near-tie, and teacher-forced top-1 equal wherever the oracle is not tied. Kimi-Linear's random
    fixture keeps a bf16 trunk here: a q8 trunk moves its logits 10% at the first position already (its KDA layers'
    small random q . k, docs/LEARNED.md §5c) and flips 6 of 26 clear positions; q8 experts flip none."""
    hf, src, _ = releases[family]
    out = convert(src, tmp_path / "q8.waste", experts="q8", trunk=trunk, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert m["experts"]["format"] == "q8" and m["trunk"]["format"] == trunk
    assert bool(m["trunk"]["quantized"]) == (trunk == "q8")
    prompt = torch.randint(3, 290, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    gap, _ = _oracle_gap_and_argmax(hf, prompt + ref)
    with waste.load(out, dtype="float32") as eng:
        got = greedy(eng, prompt, 32)
        n = agreement(got, ref)
        assert n == 32 or gap[len(prompt) - 1 + n] < TIE, (n, gap[len(prompt) - 1 + n])
        seq = prompt + ref
        ours = eng.model.forward(torch.tensor(seq), eng.model.new_state(), 0).argmax(-1)
    theirs = torch.tensor(seq[1:] + [-1])
    clear = gap >= TIE
    clear[: len(prompt) - 1] = False
    clear[-1] = False
    assert clear.sum() > 16 and torch.equal(ours[clear], theirs[clear])


@pytest.fixture(scope="module")
def bundled_ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-bundled")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = waste.load(convert(BUNDLED, root / "bf16.waste", experts="bf16", trunk="bf16", progress=False), dtype="float32")
    ids = ref.encode(HELDOUT.read_text())[:1024]
    prompts = [ref.encode("def fibonacci(n):"), ref.encode("class Cache:\n    def __init__(self")]
    yield root, ref, ids, prompts, {}
    ref.close()
    torch.set_num_threads(saved)


@pytest.mark.parametrize("experts,trunk", list(BOUNDS))
def test_quality_on_the_bundled_model(experts, trunk, bundled_ref):
    root, ref, ids, prompts, cache = bundled_ref
    out = convert(BUNDLED, root / f"{experts}-{trunk}.waste", experts=experts, trunk=trunk, progress=False)
    with waste.load(out, dtype="float32") as eng:
        q = compare(ref, eng, ids, prompts, n=16, ref_cache=cache)
    assert q.kl <= BOUNDS[(experts, trunk)], q
    assert q.top1 >= TOP1[experts], q
    if experts == "q8":
        assert q.greedy_same >= q.greedy_total // 2, q


def test_quantized_output_is_identical_across_budgets(bundled_ref):
    root, _, ids, _, _ = bundled_ref
    out = convert(BUNDLED, root / "det.waste", experts="q4", trunk="q8", progress=False, workers=2)
    seq = torch.tensor(ids[:40])
    with waste.load(out, dtype="float32", preload=False) as eng:
        full = eng.model.forward(seq, eng.model.new_state(), 0)
        ws = eng.plan.working_set_bytes
    with waste.load(out, dtype="float32", budget=ws, preload=False) as eng:
        small = eng.model.forward(seq, eng.model.new_state(), 0)
        assert eng.experts.stats.evictions > 0
    assert torch.equal(full, small)


def test_routing_to_fewer_experts(bundled_ref):
    root, ref, ids, prompts, cache = bundled_ref
    path = ref.container.root
    with pytest.raises(WasteError, match="choose 1 to 2"):
        waste.load(path, dtype="float32", experts_per_token=3)
    with waste.load(path, dtype="float32", experts_per_token=1) as eng:
        assert eng.model.top_k == 1
        q = compare(ref, eng, ids, prompts, n=16, ref_cache=cache)
    # a real cost, held to the measured figure plus 25% (docs/LEARNED.md §5e: KL 0.125, top-1 0.829 on this text)
    assert 0.05 < q.kl < 0.156 and 0.78 < q.top1 < 0.9, q


# Releases in compressed-tensors' formats (mxfp4, int4) are checked against compressed-tensors, mlx and
# transformers in test_released_formats.py.


def test_unsupported_expert_shape_is_refused_before_writing(releases, tmp_path):
    src = releases["kimi_linear"][1]        # moe_intermediate 16: mxfp4's groups of 32 do not fit its down_proj
    with pytest.raises(WasteError, match="mxfp4"):
        convert(src, tmp_path / "x.waste", experts="mxfp4", progress=False)
    assert not (tmp_path / "x.waste").exists()


def test_cli_convert_flags_and_info(releases, tmp_path):
    from waste.cli import main

    src = releases["qwen3_moe"][1]
    assert main(["convert", str(src), str(tmp_path / "c.waste"), "--experts", "q4", "--trunk", "q8"]) == 0
    m = json.loads((tmp_path / "c.waste" / "manifest.json").read_text())
    assert (m["experts"]["format"], m["trunk"]["format"]) == ("q4", "q8")
    assert main(["convert", str(src), str(tmp_path / "d.waste"), "--experts", "q5"]) == 1
