"""Batching across requests keeps the determinism rule: a request's tokens and logits are bit-identical whether it
is served alone or batched with others (scheduler and model level), one expert read serves every request routed
to that expert, and a cancelled request stops within one decode step."""
import queue
import time

import pytest
import torch

import waste
from waste.layers.moe import routed_groups
from waste.engine import Decoding, Generation
from waste.runtime.sampling import SamplingParams
from waste.serve.scheduler import Done, Job, QueueFull, Scheduler, batch_limit


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)      # a tiny model on a loaded 2-core box (docs/LEARNED.md §2)
    yield
    torch.set_num_threads(n)


def _glm5_container(root):
    """GLM-5.3: its mHC streams run through the shared step's block hooks, so it batches like every family."""
    from fixtures import save_release
    from test_oracle_glm5 import glm5_model

    from waste.convert.convert import convert

    return convert(save_release(glm5_model(), root / "src"), root / "glm5.waste", experts="bf16", trunk="bf16",
                   progress=False)


@pytest.fixture(scope="module", params=["qwen3_moe", "kimi_linear", "glm5_next"])
def eng(request, releases, tmp_path_factory):
    path = (_glm5_container(tmp_path_factory.mktemp("glm5")) if request.param == "glm5_next"
            else releases[request.param][2])
    e = waste.load(path, dtype="float32", preload=False)
    e.eos_ids = set()             # every request runs to its max_tokens
    yield e
    e.close()


def _job(eng, prompt, n, events, **sampling):
    g = Generation(eng, prompt, n, SamplingParams(**sampling), [])
    job = Job(g.prompt_ids, g.decoding, events.put)
    job.logits = []
    return job


def _drain(events, jobs):
    done = 0
    while done < len(jobs):
        if isinstance(events.get(timeout=120), Done):
            done += 1


PROMPTS = [list(range(5, 17)), list(range(40, 47)), [7, 3, 9, 200, 11, 13, 250, 17, 19, 23, 29, 31, 37, 41, 43]]


def test_step_batch_is_bit_identical_to_forward(eng):
    m = eng.model

    def alone(p, n=6):
        st, out = m.new_state(), []
        lg = m.forward(torch.tensor(p), st, 0, last_only=True)
        out.append(lg)
        for k in range(n):
            lg = m.forward(torch.tensor([int(lg[-1].argmax())]), st, len(p) + k, last_only=True)
            out.append(lg)
        return out

    ref = [alone(p) for p in PROMPTS]
    states = [m.new_state() for _ in PROMPTS]
    outs = [[lg] for lg in m.step([(torch.tensor(p), s, 0) for p, s in zip(PROMPTS, states)])]
    for k in range(6):
        items = [(torch.tensor([int(o[-1][-1].argmax())]), s, len(p) + k) for o, s, p in zip(outs, states, PROMPTS)]
        for o, lg in zip(outs, m.step(items)):
            o.append(lg)
    for r, o in zip(ref, outs):
        assert all(torch.equal(a, b) for a, b in zip(r, o))


def test_scheduler_alone_or_batched_gives_the_same_tokens_and_logits(eng):
    """Request A alone; then A batched with B and C from its first step, and with D joining half way (its
    prefill in the same step as A's decode). A's tokens and every logit are bit-identical, and its tokens are
    what Engine.generate makes."""
    kw = dict(temperature=0.9, top_p=0.95, seed=11)
    s = Scheduler(eng, max_batch=8)
    try:
        ev = queue.Queue()
        a = _job(eng, PROMPTS[0], 10, ev, **kw)
        s.submit(a)
        _drain(ev, [a])
        ev_a, ev_rest = queue.Queue(), queue.Queue()
        a2 = _job(eng, PROMPTS[0], 10, ev_a, **kw)
        b = _job(eng, PROMPTS[1], 14, ev_rest, **kw)
        c = _job(eng, PROMPTS[2], 6, ev_rest, temperature=0.0)
        s.submit(a2, b, c)
        t0 = time.monotonic()
        while len(a2.decoding.token_ids) < 4:
            assert time.monotonic() - t0 < 120, "the scheduler made no progress"
            time.sleep(0.001)
        d = _job(eng, PROMPTS[2][:9], 8, ev_rest, seed=3, temperature=1.0)
        s.submit(d)
        _drain(ev_a, [a2])
        _drain(ev_rest, [b, c, d])
        assert max(s.batch_sizes) >= 3, s.batch_sizes          # it really was batched
    finally:
        s.close()
    assert a2.decoding.token_ids == a.decoding.token_ids and len(a.logits) == 10
    assert all(torch.equal(x, y) for x, y in zip(a.logits, a2.logits))
    assert eng.generate(PROMPTS[0], max_tokens=10, **kw).token_ids == a.decoding.token_ids
    # and the others are what they would be alone
    for job, prompt, n, k in ((b, PROMPTS[1], 14, kw), (c, PROMPTS[2], 6, dict(temperature=0.0)),
                              (d, PROMPTS[2][:9], 8, dict(seed=3, temperature=1.0))):
        assert eng.generate(prompt, max_tokens=n, **k).token_ids == job.decoding.token_ids


def _routed(m, cache, layer, calls):
    """The routed experts of each call [(x, idx, weights)] through the store's residency and layers/moe.py."""
    return routed_groups([x for x, _, _ in calls], [w for _, _, w in calls],
                         cache.resident(layer, [idx for _, idx, _ in calls]), m.bank, m.kernel)


def test_one_read_serves_every_request_routed_to_an_expert(releases):
    """One residency call on a cold cache: each expert of the union is read once, however many sequences route to
    it; each sequence's output equals its output alone."""
    with waste.load(releases["qwen3_moe"][2], dtype="float32", preload=False) as e:
        cache, layer, m = e.experts, next(iter(e.experts.banks)), e.model
        g = torch.Generator().manual_seed(0)
        h = e.model.cfg["hidden_size"]
        calls = [(torch.randn(1, h, generator=g), torch.tensor([[0, 3]]), torch.tensor([[0.6, 0.4]])),
                 (torch.randn(1, h, generator=g), torch.tensor([[3, 5]]), torch.tensor([[0.7, 0.3]])),
                 (torch.randn(2, h, generator=g), torch.tensor([[5, 0], [3, 6]]), torch.tensor([[0.5, 0.5], [0.9, 0.1]]))]
        outs = _routed(m, cache, layer, calls)
        st = cache.stats
        assert (st.misses, st.hits, st.bytes_read) == (4, 0, 4 * cache.record_bytes)   # experts 0, 3, 5, 6
        for call, out in zip(calls, outs):
            assert torch.equal(out, _routed(m, cache, layer, [call])[0])
        assert cache.stats.misses == 4                                                   # all hits now


def test_cancel_stops_within_one_step(releases):
    with waste.load(releases["qwen3_moe"][2], dtype="float32") as e:
        e.eos_ids = set()
        s = Scheduler(e)
        try:
            ev = queue.Queue()
            job = _job(e, PROMPTS[0], 1000, ev)
            s.submit(job)
            while len(job.decoding.token_ids) < 3:
                ev.get(timeout=120)
            job.cancel()
            at_cancel = len(job.decoding.token_ids)
            while not isinstance(last := ev.get(timeout=120), Done):
                pass
            assert last.finish_reason == "cancelled" and last.completion_tokens <= at_cancel + 1
            assert s.active == 0 and job.state is None
        finally:
            s.close()


def test_queue_bound(releases):
    with waste.load(releases["qwen3_moe"][2], dtype="float32") as e:
        e.eos_ids = set()
        s = Scheduler(e, max_queue=1, max_batch=1)
        try:
            ev = queue.Queue()
            a, b = _job(e, PROMPTS[0], 1000, ev), _job(e, PROMPTS[1], 2, ev)
            s.submit(a, b)            # a starts, b waits
            with pytest.raises(QueueFull):
                s.submit(_job(e, PROMPTS[2], 2, ev))
            a.cancel()
            _drain(ev, [a, b])
            assert a.decoding.finish_reason is None and b.decoding.finish_reason == "length"
        finally:
            s.close()


def test_decoding_is_what_generation_does(releases):
    """The steppable Decoding fed by hand reproduces Generation: text deltas, stop string, finish reason."""
    with waste.load(releases["qwen3_moe"][2], dtype="float32") as e:
        e.eos_ids = set()
        g = e.generate("hello", max_tokens=20, temperature=1.0, seed=3)
        stop = g.text[6:9]
        ref = e.generate("hello", max_tokens=20, temperature=1.0, seed=3, stop=[stop])
        d = Decoding(e.tokenizer, 20, SamplingParams(temperature=1.0, seed=3), [stop])
        text = ""
        for t in g.token_ids:
            text += d.feed(t)
            if d.finish_reason:
                break
        text += d.finish()
        assert text == ref.text and d.finish_reason == ref.finish_reason == "stop"


def test_batch_limit_keeps_a_step_within_the_cache(releases):
    """When the bank does not fit, no more requests run at once than the cache holds tokens' working sets."""
    c = releases["qwen3_moe"][2]
    with waste.load(c, dtype="float32", preload=False) as e:
        assert batch_limit(e, 8) == 8                       # the whole bank fits: no cap
        per_token = e.model.top_k * len(e.experts.banks)
        record = e.experts.record_bytes
    with waste.load(c, dtype="float32", preload=False, budget=2 * per_token * record) as e:
        assert batch_limit(e, 8) == 2 and batch_limit(e, 1) == 1
