"""Chunked prefill (`--prefill-chunk N`): a prompt runs through the model N tokens at a time.

Not bit-identical across chunk sizes: a matmul's row gets other last bits when the call has another number of
rows (CPU BLAS blocks by shape; docs/LEARNED.md §3g shows it on a bare F.linear), and a chunk size is a row count.
What holds, and is tested here: every chunk size agrees with transformers as closely as one whole forward does and
routes every token to the same experts; at one chunk size the bits do not depend on the budget, the reader threads
or prefetch; a chunk asks the expert store once per layer, so its tokens share the reads; the plan counts the
chunk's activations and picks the chunk."""
import json
import math
import subprocess
import sys

import pytest
import torch

import waste
from waste.errors import WasteError
from fixtures import assert_same_routes, prompt, rel_l2
from test_oracle import LOGITS, hf_routes

from waste.runtime.plan import MIN_PREFILL_CHUNK, PREFILL_CHUNK, plan_from_sizes

LENGTH = {"qwen3_moe": 40, "kimi_linear": 80}   # 80 crosses KDA's 64-token chunk


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_linear"])
@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_every_chunk_size_matches_transformers(family, chunk, releases):
    hf, _, c = releases[family]
    ids = prompt(LENGTH[family], seed=4)
    ref, ref_routes = hf_routes(hf, ids)
    with waste.load(c, dtype="float32", prefill_chunk=chunk) as eng:
        assert eng.model.prefill_chunk == chunk == eng.plan.prefill_chunk
        m = eng.model
        m.route_trace = []
        logits = m.forward(ids, m.new_state(), 0)
        trace, m.route_trace = m.route_trace, None
    ours = {}
    for layer, idx in trace:        # one entry per chunk and layer, in order
        ours[layer] = torch.cat([ours[layer], idx]) if layer in ours else idx
    assert logits.shape == ref.shape
    assert rel_l2(logits, ref) < LOGITS[family]
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    assert all(len(idx) == len(ids) for idx in ours.values())
    assert_same_routes(ours, ref_routes)


def _chunked_run(c, ids, **kw):
    with waste.load(c, dtype="float32", prefill_chunk=7, **kw) as eng:
        m = eng.model
        st = m.new_state()
        out = [m.forward(torch.tensor(ids), st, 0)]
        pos = len(ids)
        for _ in range(6):
            out.append(m.forward(out[-1][-1:].argmax(-1), st, pos))
            pos += 1
        return torch.cat(out), eng.experts.stats


def test_chunked_prefill_is_bit_identical_across_budgets_threads_and_prefetch(releases):
    c = releases["kimi_linear"][2]
    ids = list(range(5, 45))
    ref, _ = _chunked_run(c, ids, budget="1G", preload=False)
    with waste.load(c, dtype="float32") as probe:
        ws = probe.plan.working_set_bytes
    for kw in (dict(budget=ws, preload=False, threads=1), dict(budget=2 * ws, preload=False, threads=3),
               dict(budget=ws, preload=False, threads=2, prefetch=False)):
        got, stats = _chunked_run(c, ids, **kw)
        assert torch.equal(got, ref), kw
        assert stats.misses > 0 and stats.evictions > 0     # it really streamed


def test_a_chunk_asks_the_store_once_per_layer(releases):
    """Its tokens share one read of each expert they route to: per layer and chunk one residency call, whose
    hits + misses are the chunk's distinct experts."""
    c = releases["qwen3_moe"][2]
    ids, chunk = prompt(LENGTH["qwen3_moe"], seed=5), 16
    with waste.load(c, dtype="float32", prefill_chunk=chunk, budget="1G", preload=False) as eng:
        m, cache = eng.model, eng.experts
        calls = {}
        real = cache.resident

        def counted(layer, idxs, **kw):
            calls[layer] = calls.get(layer, 0) + 1
            return real(layer, idxs, **kw)

        cache.resident = counted
        m.route_trace = []
        m.forward(ids, m.new_state(), 0, last_only=True)
        trace, m.route_trace = m.route_trace, None
    n_chunks = math.ceil(len(ids) / chunk)
    assert calls and all(v == n_chunks for v in calls.values())
    distinct = {}
    for layer, idx in trace:
        assert idx.shape[0] <= chunk
        distinct[layer] = distinct.get(layer, 0) + len(set(idx.reshape(-1).tolist()))
    assert {l: h + mi for l, (h, mi) in cache.stats.per_layer.items()} == distinct


def test_the_plan_counts_the_chunk_and_picks_it(releases):
    """On the fixture's config widened to Qwen3-30B-A3B's widths (6 MoE layers of 128 q4-sized records)."""
    c = releases["qwen3_moe"][2]
    cfg = json.loads((c / "manifest.json").read_text())["config"]
    cfg = {**cfg, "hidden_size": 2048, "gqa": {**cfg["gqa"], "num_heads": 32, "num_kv_heads": 4, "head_dim": 128},
           "moe": {**cfg["moe"], "top_k": 8, "intermediate_size": 768}}
    record, experts, trunk = 2_650_000, [128] * 6, 75_000_000
    ws = 8 * record * 6

    def plan(ram, chunk=None):
        return plan_from_sizes(cfg, record, experts, trunk, torch.float32, 4096, ram, None, prefill_chunk=chunk,
                               baseline=200_000_000)      # fixed: this process's RSS moves between calls

    roomy = plan(64 << 30)
    assert roomy.prefill_chunk == PREFILL_CHUNK and roomy.resident
    small = plan(64 << 30, 64)
    assert small.prefill_chunk == 64 and small.scratch_bytes < roomy.scratch_bytes
    # the activations of a 512-token chunk at these widths: more than a tenth of a working set
    assert roomy.scratch_bytes - plan(64 << 30, MIN_PREFILL_CHUNK).scratch_bytes > ws / 10
    # tight memory: the chunk is halved only until one working set fits beside it; the budget is what is left
    low = plan(64 << 30, MIN_PREFILL_CHUNK)
    ceiling = low.floor_bytes + ws + (roomy.scratch_bytes - low.scratch_bytes) // 2
    tight = plan(ceiling * 4 // 3 + 4)
    assert MIN_PREFILL_CHUNK < tight.prefill_chunk < PREFILL_CHUNK
    assert tight.budget_bytes == ws and tight.floor_bytes + tight.budget_bytes <= tight.ceiling_bytes
    # the next chunk up would not leave room for one working set: a user's chunk is kept, and the plan says so
    with pytest.raises(WasteError, match="not enough memory"):
        plan(tight.usable_bytes, 2 * tight.prefill_chunk)
    # with room for more, the full chunk is kept and the budget is what is left beside it
    roomier = plan(roomy.floor_bytes * 4 // 3 + 4 * ws)
    assert roomier.prefill_chunk == PREFILL_CHUNK and roomier.budget_bytes == 3 * ws


def test_cli_prefill_chunk(releases):
    c = str(releases["qwen3_moe"][2])
    r = subprocess.run([sys.executable, "-m", "waste", "plan", c, "--prefill-chunk", "0"], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "waste: error: --prefill-chunk 0" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "waste", "plan", c, "--prefill-chunk", "48"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "prefill chunk   48 tokens" in r.stdout


def test_route_diff_routes_cover_every_chunk(releases):
    """`waste route-diff` on a prompt longer than the chunk compares every token, not the last chunk's."""
    from waste.runtime.trace import agreement, routes

    c = releases["qwen3_moe"][2]
    ids = prompt(LENGTH["qwen3_moe"], seed=6).tolist()
    with waste.load(c, dtype="float32", prefill_chunk=9) as a, waste.load(c, dtype="float32") as b:
        ra, rb = routes(a, ids), routes(b, ids)
    assert all(v.shape[0] == len(ids) for v in ra.values())
    assert agreement(ra, rb)["set"] == 1.0
