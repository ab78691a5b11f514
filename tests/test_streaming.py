"""The expert cache and the memory plan: identical output whatever the budget, counters that add up."""
import json
import subprocess
import sys

import time

import pytest
import torch

import waste
from waste.errors import WasteError
from waste.runtime.plan import plan_memory
from waste.units import parse_size

FAMILY = "kimi_linear"


def run(container, prompt_ids, n=12, **kw):
    with waste.load(container, dtype="float32", **kw) as eng:
        eng.eos_ids = set()
        m = eng.model
        st = m.new_state()
        logits = [m.forward(torch.tensor(prompt_ids), st, 0)]
        toks, pos = [], len(prompt_ids)
        for _ in range(n):
            toks.append(int(logits[-1][-1].argmax()))
            logits.append(m.forward(torch.tensor(toks[-1:]), st, pos))
            pos += 1
        eng.experts.wait_fill()
        return toks, torch.cat(logits), eng.experts.stats, eng.plan, eng.experts


@pytest.fixture(scope="module")
def reference(releases):
    c = releases[FAMILY][2]
    ids = list(range(5, 45))
    return c, ids, run(c, ids, budget="1G", preload=False)


@pytest.mark.parametrize("budget_sets,preload,threads", [
    (1, False, 1), (1, False, 2), (2, False, 4), (2, True, 1), (4, True, 2), (None, True, 4), (None, False, 1)])
def test_output_is_bit_identical_across_budgets_fill_and_reader_threads(reference, budget_sets, preload, threads):
    c, ids, (toks0, logits0, *_) = reference
    plan = reference[2][3]
    budget = None if budget_sets is None else budget_sets * plan.working_set_bytes
    toks, logits, stats, _, cache = run(c, ids, budget=budget, preload=preload, threads=threads)
    assert toks == toks0
    assert torch.equal(logits, logits0)
    if budget_sets == 1:
        assert stats.misses > 0 and stats.evictions > 0   # the small budget really streamed


def test_tokens_identical_with_one_and_two_compute_threads(reference):
    """MKL's sgemm blocks small row counts differently by thread count (docs/LEARNED.md §3), so the last bits of
    a prefill may move; the decisions must not."""
    c, ids, (toks0, logits0, *_) = reference
    saved = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            toks, logits, *_ = run(c, ids, budget=reference[2][3].working_set_bytes, preload=False)
            assert toks == toks0
            assert torch.equal(logits.argmax(-1), logits0.argmax(-1))
    finally:
        torch.set_num_threads(saved)


def test_counters_add_up_under_one_working_set(releases):
    c = releases[FAMILY][2]
    with waste.load(c, dtype="float32", budget="1G", preload=False) as probe:
        ws = probe.plan.working_set_bytes
        record = probe.plan.record_bytes
    ids = list(range(5, 30))
    toks, _, stats, plan, cache = run(c, ids, n=10, budget=ws, preload=False)
    assert cache.n_slots == ws // record and cache.budget_bytes == ws
    # every (layer, call) asks for its distinct experts once: hits + misses is the number of requests
    per_layer = stats.per_layer
    assert sum(h + m for h, m in per_layer.values()) == stats.hits + stats.misses
    assert stats.bytes_read == stats.misses * record
    assert stats.evictions == stats.misses - cache.n_slots      # cold start: the first n_slots misses fill free slots
    assert cache.resident_count() == cache.n_slots
    assert stats.read_seconds > 0 and cache.fill_bytes == 0


def test_background_fill_loads_the_whole_bank_and_counts_apart(releases):
    c = releases[FAMILY][2]
    with waste.load(c, dtype="float32", preload=True) as eng:
        eng.experts.wait_fill()
        cache = eng.experts
        assert cache.resident_count() == cache.n_records
        assert cache.fill_bytes + cache.stats.bytes_read == cache.n_records * cache.record_bytes
        hits0, misses0 = cache.stats.hits, cache.stats.misses
        eng.generate("def f(x):", max_tokens=4)
        assert cache.stats.misses == misses0 and cache.stats.hits > hits0


def test_plan_ladder_and_refusal(releases):
    c = releases[FAMILY][2]
    with waste.load(c, dtype="float32", preload=False) as eng:
        cont, dt = eng.container, eng.dtype
        full = plan_memory(cont, dt, 512)
        assert full.resident and full.budget_bytes == full.bank_bytes
        assert full.working_set_bytes == cont.config["moe"]["top_k"] * full.record_bytes * 4
        # as if the machine had just enough for the floor plus two working sets under the 3/4 ceiling (at the same
        # prefill chunk: left to itself, the plan would shrink the chunk to fit more; tests/test_prefill_chunk.py)
        ram = int((full.floor_bytes + 2 * full.working_set_bytes) / 0.75) + 4096
        chunk = full.prefill_chunk
        two = plan_memory(cont, dt, 512, ram=ram, prefill_chunk=chunk)
        assert two.budget_bytes == 2 * two.working_set_bytes and not two.resident
        assert two.floor_bytes + two.budget_bytes <= two.ceiling_bytes
        with pytest.raises(WasteError, match="not enough memory.*floor.*working set"):
            plan_memory(cont, dt, 512, ram=int(full.floor_bytes / 0.75), prefill_chunk=chunk)
        forced = plan_memory(cont, dt, 512, ram=ram, budget=full.bank_bytes, prefill_chunk=chunk)
        assert forced.budget_bytes == full.bank_bytes and "above 3/4" in forced.warning


def test_parse_size():
    assert parse_size("8G") == 8 << 30 and parse_size("512M") == 512 << 20 and parse_size("1234") == 1234
    assert parse_size("1.5K") == 1536
    with pytest.raises(WasteError):
        parse_size("lots")


def test_plan_and_bench_cli(releases):
    c = releases[FAMILY][2]
    p = subprocess.run([sys.executable, "-m", "waste", "plan", str(c), "--json", "--context", "256"],
                       capture_output=True, text=True, check=True)
    d = json.loads(p.stdout)
    assert {"floor_bytes", "working_set_bytes", "bank_bytes", "budget_bytes", "reason"} <= set(d)
    p = subprocess.run([sys.executable, "-m", "waste", "bench", str(c), "-n", "4", "--prompt-len", "16", "--json",
                        "--budget", str(2 * d["working_set_bytes"])], capture_output=True, text=True, check=True)
    b = json.loads(p.stdout)
    assert b["decode"]["tokens"] == 4 and b["disk_bandwidth_gb_per_s"] > 0
    assert b["plan_bytes"] > b["budget_bytes"] == 2 * d["working_set_bytes"] and b["peak_rss_bytes"] > 0
    assert b["decode"]["bytes_read"] == b["decode"]["misses"] * b["record_bytes"]
    d = b["decode"]       # the disk's busy time: some while records were read, never more than the phase itself
    assert d["misses"] > 0 and 0 < d["disk_busy_seconds"] <= d["seconds"]
    assert d["disk_busy_share"] == d["disk_busy_seconds"] / d["seconds"]


def test_bench_with_random_tokens_and_uniform_routing(releases):
    """--feed random and --routing uniform: the decode steps see seeded random tokens and random experts (every
    token still gets top_k distinct ones), and the model's own router is back afterwards."""
    from waste.runtime.bench import bench

    with waste.load(releases[FAMILY][2], dtype="float32", preload=False) as eng:
        m = eng.model
        seen = []
        m.route_trace = seen
        r = bench(eng, n=6, prompt_len=8, bw_seconds=0.05, feed="random", routing="uniform")
        assert r["feed"] == "random" and r["routing"] == "uniform" and "route" not in vars(m)
        assert seen and all(len(set(row.tolist())) == m.top_k for _, idx in seen for row in idx)
        lookups = r["decode"]["hits"] + r["decode"]["misses"]
        assert lookups == 6 * m.top_k * len(eng.container.banks)


def _groups_run(container, ids, n, wait_fill=False, dtype="float32", **kw):
    """run() with every residency call's groups counted: [(rows of the first sequence, groups yielded)]."""
    with waste.load(container, dtype=dtype, **kw) as eng:
        if wait_fill:
            eng.experts.wait_fill()
        cache, calls = eng.experts, []
        inner = cache.resident

        def counted(layer, idxs, **kw):
            calls.append([idxs[0].shape[0], 0])
            for g in inner(layer, idxs, **kw):
                calls[-1][1] += 1
                yield g
        cache.resident = counted
        m, st = eng.model, eng.model.new_state()
        logits = [m.forward(torch.tensor(ids), st, 0)]
        pos = len(ids)
        for _ in range(n):
            logits.append(m.forward(logits[-1][-1:].argmax(-1), st, pos))
            pos += 1
        _groups_run.spread = eng.model.expert_pool is not None     # decode rows' experts over a pool's threads
        return torch.cat(logits), calls


@pytest.mark.parametrize("experts", ["bf16", "q8", "q4"])
def test_experts_computed_as_their_reads_land_match_all_resident(releases, tmp_path, experts, monkeypatch):
    """Item 1 of issue 15: a cold cache with one reader thread yields each layer's experts in several groups (what
    is resident, then each read as it lands) and the pairs are computed group by group; prefill and decode logits
    are the same bits as with the whole bank resident before the first token (one group per call)."""
    from waste.convert.convert import convert

    _, src, c = releases["qwen3_moe"]
    if experts != "bf16":
        c = convert(src, tmp_path / f"{experts}.waste", experts=experts, trunk="bf16", progress=False)
    ids = list(range(5, 29))
    ref, ref_calls = _groups_run(c, ids, 8, wait_fill=True, preload=True)
    assert all(g == 1 for _, g in ref_calls)
    with waste.load(c, dtype="float32", budget="1G", preload=False) as probe:
        ws = probe.plan.working_set_bytes
    from waste.layers import moe

    numba_spread, ran = moe._spread_numba, []
    monkeypatch.setattr(moe, "_spread_numba", lambda *a: (ran.append(1), numba_spread(*a))[1])
    from waste.layers.moe_cpu import NumbaPairs

    shared_into, shared = NumbaPairs.into_shared, []    # q4: a lone pair's blocks on both threads (§3o)
    monkeypatch.setattr(NumbaPairs, "into_shared", lambda *a: (shared.append(1), shared_into(*a))[1])
    # each read a little slower than a group's compute, so a layer's reads land over time whatever else the machine
    # runs (on a loaded box the one reader could finish a prefill layer's reads before its first group was taken)
    from waste.runtime.cache import ExpertCache

    read, landed = ExpertCache._timed_read, ExpertCache._landed_direct     # a reader thread's, Linux AIO's reaper's
    monkeypatch.setattr(ExpertCache, "_timed_read", lambda self, *a: (time.sleep(0.005), read(self, *a))[1])
    monkeypatch.setattr(ExpertCache, "_landed_direct", lambda self, *a: (time.sleep(0.005), landed(self, *a))[1])
    saved = torch.get_num_threads()
    try:
        for budget, compute in ((ws, 1), (ws, 2), (3 * ws, 2)):
            torch.set_num_threads(compute)   # 2: a decode row's pairs dealt between two threads (layers/moe.py spread)
            ran.clear()
            shared.clear()
            logits, calls = _groups_run(c, ids, 8, budget=budget, preload=False, threads=1)
            assert _groups_run.spread == (compute > 1) and bool(ran) == (compute > 1)   # numba's pairs, one buffer
            assert bool(shared) == (compute > 1 and experts == "q4")
            assert torch.equal(logits, ref)
            assert any(t == 1 and g > 1 for t, g in calls), calls      # decode steps really computed in groups
            assert any(t > 1 and g > 1 for t, g in calls), calls       # and the prefill
    finally:
        torch.set_num_threads(saved)


def test_next_layer_prefetch_is_bit_identical_and_reports_precision_and_recall(releases):
    """Item 2 of issue 15: with prefetch on, the next MoE layer's predicted experts are read ahead (counted apart:
    prefetch bytes, precision, recall) and the logits are the same bits as with it off; a random-weight model's
    next-layer prediction is far better than chance."""
    c = releases["qwen3_moe"][2]
    ids = list(range(5, 29))
    with waste.load(c, dtype="float32", budget="1G", preload=False) as probe:
        ws = probe.plan.working_set_bytes
    out = {}
    for prefetch in (False, True):
        logits, _ = _groups_run(c, ids, 10, budget=3 * ws, preload=False, threads=2, prefetch=prefetch)
        with waste.load(c, dtype="float32", budget=3 * ws, preload=False, prefetch=prefetch) as eng:
            from waste.runtime.bench import bench
            r = bench(eng, n=10, prompt_len=16, bw_seconds=0.05, feed="random")
        out[prefetch] = logits, r
    assert torch.equal(out[True][0], out[False][0])
    off, on = out[False][1]["decode"], out[True][1]["decode"]
    assert off["prefetch_bytes"] == 0 and off["prefetch_precision"] is None
    assert on["prefetch_bytes"] > 0 and on["prefetch_bytes"] % out[True][1]["record_bytes"] == 0
    assert on["bytes_read"] == on["misses"] * out[True][1]["record_bytes"]
    assert 0 < on["prefetch_recall"] <= 1 and 0 < on["prefetch_precision"] <= 1
    E, k = releases["qwen3_moe"][0].config.num_experts, releases["qwen3_moe"][0].config.num_experts_per_tok
    assert on["prefetch_recall"] > k / E       # better than a random guess of k experts


def test_prefetch_never_evicts_what_the_current_call_holds(releases):
    """A prefetch on a full budget of a few records takes only slots the current call does not hold or read, and
    leaves the next layer room for all of its predicted experts."""
    with waste.load(releases["qwen3_moe"][2], dtype="float32", budget="1G", preload=False) as probe:
        rec = probe.plan.record_bytes
    with waste.load(releases["qwen3_moe"][2], dtype="float32", budget=8 * rec, preload=False, threads=1) as eng:
        cache = eng.experts
        l0, l1 = sorted(cache.banks)[:2]
        for layer, e in ((l0, [[4, 5, 6]]), (l1, [[0, 1]])):      # warm some of l0, then a later call
            for _ in cache.resident(layer, [torch.tensor(e)]):
                pass
        want = [1, 2, 5, 7]
        for slots, _ in cache.resident(l0, [torch.tensor([want])], ahead=(l1, [2, 3])):
            for e, s in zip(want, slots[0][0].tolist()):
                if s >= 0:
                    assert cache.key_of[s] == (l0, e)
        assert all(cache.slot_map[l0, e] >= 0 for e in want)
        for f in list(cache.loading.values()):
            f.result()
        # 8 slots full (5 warm, 3 misses): both predicted records evict one of the 4 slots the call does not hold
        assert cache.stats.prefetch_reads == 2 and cache.stats.prefetch_evictions == 2
        assert cache.slot_map[l1, 2] >= 0 and cache.slot_map[l1, 3] >= 0
        assert all(cache.key_of[cache.slot_map[l0, e]] == (l0, e) for e in want)


def test_routing_trace_recorded_then_replayed_scaled(releases, tmp_path):
    """Item 3 of issue 15: --record-trace writes each token's experts per MoE layer as the router chose them (and
    prefetch's predictions); --routing trace:FILE replays them, scaled to another expert count, and a bad file is
    one clear error."""
    from waste.runtime import trace
    from waste.runtime.bench import bench

    c = releases["qwen3_moe"][2]
    path = tmp_path / "t.json"
    with waste.load(c, dtype="float32", preload=False) as eng:
        m = eng.model
        r = bench(eng, n=5, prompt_len=8, bw_seconds=0.05, feed="random", record_trace=str(path))
        t = trace.load(path)
        E, k = m.moe["num_experts"], m.top_k
        assert (t["num_experts"], t["top_k"], len(t["tokens"])) == (E, k, 8 + 5)
        assert len(t["tokens"][0]) == len(eng.container.banks) and m.route_trace is None
        # the recorded rows are the router's own choice on the same input
        from waste.runtime.bench import BENCH_TEXT

        seen = []
        m.route_trace = seen
        m.forward(torch.tensor(eng.tokenizer.encode(BENCH_TEXT)[:8]), m.new_state(), 0)
        m.route_trace = None
        for col, (layer, idx) in enumerate(seen):
            assert idx.tolist() == [tok[col] for tok in t["tokens"][:8]]
        # replayed on the same model: the same experts, per token and layer
        seen = []
        m.route_trace = seen
        r2 = bench(eng, n=5, prompt_len=8, bw_seconds=0.05, feed="random", routing=f"trace:{path}")
        m.route_trace = None
        replayed = {}
        for layer, idx in seen:
            replayed.setdefault(layer, []).extend(idx.tolist())
        for col, layer in enumerate(sorted(replayed)):
            assert replayed[layer][:13] == [tok[col] for tok in t["tokens"]]
        assert r2["routing"] == f"trace:{path}" and m.router is None and m.predictor is None
    assert r["decode"]["tokens"] == 5
    # scaled: every traced expert stands for a block of the larger count, k distinct ids in range
    assert trace.scale_ids([3, 1], 4, 16, 2) == [12, 4]
    assert trace.scale_ids([3, 1], 4, 16, 4) == [12, 4, 13, 5]
    assert trace.scale_ids([7, 6], 8, 4, 2) == [3, 0]          # both map to expert 3: the next free id
    for bad in ("{", json.dumps({"format": "x"}), json.dumps({**t, "tokens": [[[E]] * len(t["tokens"][0])]})):
        path.write_text(bad)
        p = subprocess.run([sys.executable, "-m", "waste", "bench", str(c), "--routing", f"trace:{path}"],
                           capture_output=True, text=True)
        assert p.returncode != 0 and p.stderr.startswith("waste: error: ") and "Traceback" not in p.stderr


def test_route_diff_separates_set_and_rank_agreement(releases, tmp_path):
    """Item 5 of issue 15 (route-diff): a swap of two experts is a rank mismatch, not a set one; a container against
    itself agrees fully; bf16 against q4 experts of one model agrees on most experts (the CLI, end to end)."""
    from waste.convert.convert import convert
    from waste.runtime.trace import agreement

    a = {1: torch.tensor([[3, 5], [1, 2]]), 3: torch.tensor([[0, 1], [4, 6]])}
    b = {1: torch.tensor([[5, 3], [1, 2]]), 3: torch.tensor([[0, 7], [4, 6]])}
    r = agreement(a, b)
    assert r["layers"][1] == {"set": 1.0, "rank": 0.5} and r["layers"][3] == {"set": 0.75, "rank": 0.75}
    with pytest.raises(WasteError, match="different layers"):
        agreement(a, {1: a[1]})
    _, src, c = releases["qwen3_moe"]
    q4 = convert(src, tmp_path / "q4.waste", experts="q4", trunk="bf16", progress=False)

    def diff(x, y):
        p = subprocess.run([sys.executable, "-m", "waste", "route-diff", str(x), str(y), "def f(x): return x * 2",
                            "--json", "--dtype", "float32"], capture_output=True, text=True, check=True)
        return json.loads(p.stdout)
    same, other = diff(c, c), diff(c, q4)
    assert same["set"] == same["rank"] == 1.0 and same["tokens"] > 3
    assert set(other["layers"]) == set(same["layers"]) and other["rank"] <= other["set"] <= 1.0
    assert other["set"] > 0.5


def test_decode_experts_spread_over_threads_are_bit_identical_in_bfloat16(releases, tmp_path):
    """Streaming on the CPU with two torch threads, a decode row's pairs are dealt between this thread and a pool's
    (layers/moe.py spread), here through torch's int4 kernel one pair at a time (bf16 compute); the logits are the
    same bits as with one thread (no pool) and with the whole bank resident."""
    from waste.convert.convert import convert

    _, src, _ = releases["qwen3_moe"]
    c = convert(src, tmp_path / "q4.waste", experts="q4", trunk="bf16", progress=False)
    ids = list(range(5, 29))
    with waste.load(c, dtype="bfloat16", budget="1G", preload=False) as probe:
        ws = probe.plan.working_set_bytes
    saved = torch.get_num_threads()
    out = {}
    try:
        for name, compute, budget in (("resident", 2, None), ("one", 1, ws), ("spread", 2, ws)):
            torch.set_num_threads(compute)
            logits, calls = _groups_run(c, ids, 8, budget=budget, preload=budget is None, wait_fill=budget is None,
                                        dtype="bfloat16", threads=1)
            out[name] = logits, _groups_run.spread
    finally:
        torch.set_num_threads(saved)
    assert out["spread"][1] and not out["one"][1] and not out["resident"][1]
    assert torch.equal(out["spread"][0], out["one"][0]) and torch.equal(out["spread"][0], out["resident"][0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q8_rows_shared_with_the_expert_pool_in_a_streamed_decode_are_bit_identical(tmp_path, dtype, monkeypatch):
    """Streaming on the CPU with two torch threads, the trunk's VNNI q8 rows (this model's q/k/v, o and head, from
    q8_numba.VNNI_MIN weights) share their chunks with the expert pool's thread (numba_ptr.row_helper); the logits are
    the same bits as with one thread and with the whole bank resident."""
    import threading

    from fixtures import qwen3_moe_model, save_release

    from waste.convert.convert import convert
    from waste.quant import q4_vnni, q8_numba

    if not q4_vnni.available():
        pytest.skip("no AVX-512 VNNI: the q8 rows have no shared kernel")
    src = save_release(qwen3_moe_model(hidden_size=256, num_attention_heads=8, head_dim=32), tmp_path / "src")
    c = convert(src, tmp_path / "q4.waste", experts="q4", trunk="q8", progress=False)
    ids = list(range(5, 29))
    with waste.load(c, dtype=dtype, budget="1G", preload=False) as probe:
        ws = probe.plan.working_set_bytes
    calls, shared = [], q8_numba.q8_row_vnni_shared

    def spy(*a):      # (a helper's call, on the main thread)
        calls.append((a[-1], threading.current_thread() is threading.main_thread()))
        return shared(*a)
    monkeypatch.setattr(q8_numba, "q8_row_vnni_shared", spy)
    saved = torch.get_num_threads()
    out = {}
    try:
        for name, compute, budget in (("resident", 2, None), ("one", 1, ws), ("shared", 2, ws)):
            torch.set_num_threads(compute)
            calls.clear()
            logits, _ = _groups_run(c, ids, 8, budget=budget, preload=budget is None, wait_fill=budget is None,
                                    dtype=dtype, threads=1)
            out[name] = logits, _groups_run.spread, (False, True) in calls and (True, False) in calls
    finally:
        torch.set_num_threads(saved)
    assert out["shared"][1:] == (True, True) and out["one"][1:] == (False, False)
    assert out["resident"][1:] == (False, False)
    assert torch.equal(out["shared"][0], out["one"][0]) and torch.equal(out["shared"][0], out["resident"][0])
