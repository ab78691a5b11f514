"""`waste bench`: prefill and decode speed with the expert cache's counters, beside the I/O bound."""
from __future__ import annotations

import resource
import time

import torch

from ..errors import WasteError
from ..timing import BUCKETS, NO_TIMER, Timer, count_ops
from . import trace
from ..units import fmt_bytes
from .bankio import measure_direct_bandwidth

BENCH_TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
              "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
              "The expert cache keeps the most useful experts in memory and reads the rest from disk. ")


def bench(engine, n: int = 64, prompt_len: int = 128, bw_seconds: float = 1.0, feed: str = "greedy",
          routing: str = "model", profile: bool = False, text: str | None = None,
          record_trace: str | None = None) -> dict:
    """feed: what each decode step is given, "greedy" (the model's own choice) or "random" (a seeded random token
    sequence: on a model with random weights greedy decoding soon repeats one token, and with it the same
    experts, which flatters the cache).
    routing: "model" (the router's choice) or "uniform" (each token to top_k experts drawn uniformly at random,
    seeded: the cache's worst case for a balanced model; a random-weight model's own router concentrates on a few
    experts per layer in its deeper layers and flatters the cache as much as repeated tokens do), or "trace:FILE"
    (a recorded routing trace replayed, scaled to this model's experts; its recorded predictions drive prefetch).
    text: the prompt and the decode feed are this text's tokens (feed "text"), e.g. held-out code for a trace.
    record_trace: write the run's routing (and prefetch's predictions) to this file (runtime/trace.py).
    profile: also time the decode steps in buckets (timing.BUCKETS, per token) and count the torch operators of one
    more decode step."""
    tok = engine.tokenizer
    model, cache = engine.model, engine.experts
    fed = torch.randint(0, model.embed.shape[0], (n + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    if text is not None:
        ids = tok.encode(text)
        if len(ids) < prompt_len + n + 1:
            raise WasteError(f"the bench text has {len(ids)} tokens; --prompt-len {prompt_len} and -n {n} need "
                             f"{prompt_len + n + 1}: give a longer text or smaller numbers")
        ids, fed, feed = ids[:prompt_len], ids[prompt_len:prompt_len + n + 1], "text"
    else:
        ids = []
        while len(ids) < prompt_len:
            ids += tok.encode(BENCH_TEXT)
        ids = ids[:prompt_len]
    state = model.new_state()

    def counters():
        s = cache.stats
        return (s.hits, s.misses, s.bytes_read, s.read_seconds, s.prefetch_bytes, s.predicted, s.predicted_right,
                s.predicted_needed, s.wait_seconds, s.disk_busy_seconds)

    if routing == "uniform" and getattr(model, "moe", None):
        model.router = _uniform_router(model)         # taken away below
    elif routing.startswith("trace:") and getattr(model, "moe", None):
        model.router, model.predictor = trace.replay(model, trace.load(routing[len("trace:"):]))
    recorder = trace.Recorder(model) if record_trace else None
    # a bank that fits is filled in the background from load on; timing beside the fill would measure the fill's
    # reads and checksums competing for the cores, not the model (on 2 cores: 26 against 66 tok/s, LEARNED §10d),
    # so the phases start once it is done (`--no-preload` measures a cold cache instead)
    tw = time.perf_counter()
    if getattr(cache, "wait_fill", None):
        cache.wait_fill()
    fill_wait = time.perf_counter() - tw
    try:
        c0 = counters()
        cpu0 = time.process_time()        # CPU seconds of the whole process (reader threads too): what load does
        t0 = time.perf_counter()          # not inflate the way it inflates wall time
        logits = model.forward(torch.tensor(ids), state, 0, last_only=True)[-1]
        t1, cpu1 = time.perf_counter(), time.process_time()
        c1 = counters()
        pos = len(ids)
        timer = Timer() if profile else NO_TIMER
        model.timer, wait0 = timer, cache.stats.wait_seconds
        for i in range(n):
            with timer.section("sampling"):
                nxt = int(torch.argmax(logits)) if feed == "greedy" else fed[i]
            logits = model.forward(torch.tensor([nxt]), state, pos, last_only=True)[-1]
            pos += 1
        t2, cpu2 = time.perf_counter(), time.process_time()
        c2 = counters()
        model.timer = NO_TIMER
        if recorder is not None:
            trace.save(recorder.finish(f"waste bench {engine.container.root.name}, {len(ids)} prompt + {n} decode "
                                       f"tokens fed {feed}"), record_trace)
            recorder = None
        prof = None
        if profile:
            timer.move("expert compute", "expert wait", cache.stats.wait_seconds - wait0)
            timer.add("other", (t2 - t1) - sum(timer.seconds.values()))
            nxt = int(torch.argmax(logits)) if feed == "greedy" else fed[n]
            ops, by_op = count_ops(lambda: model.forward(torch.tensor([nxt]), state, pos, last_only=True))
            prof = {"ms_per_token": {b: 1e3 * timer.seconds.get(b, 0.0) / n for b in BUCKETS},
                    "ops_per_step": ops, "ops_by_kind": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}
    finally:
        if recorder is not None:
            model.route_trace = model.predict_trace = None
        model.router = model.predictor = None
        model.timer = NO_TIMER
    banks = list(engine.container.banks.values())
    bw, direct = measure_direct_bandwidth(max(banks, key=lambda b: b.num_experts * b.record_bytes), bw_seconds) \
        if banks else (0.0, False)
    rec = cache.record_bytes

    def phase(a, b, seconds, tokens, cpu):
        hits, misses, nbytes, rsec, pbytes, pred, right, needed, waited, busy = (y - x for x, y in zip(a, b))
        # the bound counts every record read, the prefetch's included (a prefetched expert is then a hit)
        bound = (misses * rec + pbytes) / bw if bw else 0.0
        return {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds if seconds else 0.0,
                "hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
                "bytes_read": nbytes, "read_seconds": rsec, "read_gb_per_s": nbytes / rsec / 1e9 if rsec else 0.0,
                "prefetch_bytes": pbytes, "prefetch_precision": right / pred if pred else None,
                "prefetch_recall": right / needed if needed else None,
                "cpu_seconds": cpu, "wait_seconds": waited,     # blocked on this phase's reads (wall time)
                # the share of the phase with a read in flight: its fraction of the I/O bound at the rate the disk
                # gave this run (the bound above uses a separate one-second measurement, which swings with the disk)
                "disk_busy_seconds": busy, "disk_busy_share": busy / seconds if seconds else 0.0,
                "io_bound_seconds": bound, "io_bound_tok_per_s": tokens / bound if bound else None}

    plan = engine.plan
    return {
        "model": str(engine.container.root), "family": engine.container.family, "dtype": str(engine.dtype),
        "threads": torch.get_num_threads(), "budget_bytes": cache.budget_bytes, "bank_bytes": plan.bank_bytes,
        "working_set_bytes": plan.working_set_bytes, "record_bytes": rec,
        "read_mode": getattr(cache, "read_mode", None) or (
            ("O_DIRECT + Linux AIO" if getattr(cache, "aio", None) else "O_DIRECT") if cache.direct
            else "buffered + FADV_DONTNEED"),
        "disk_bandwidth_gb_per_s": bw / 1e9, "disk_bandwidth_mode": "O_DIRECT" if direct else "buffered (O_DIRECT refused)",
        "background_fill_bytes": cache.fill_bytes, "fill_wait_seconds": fill_wait, "evictions": cache.stats.evictions, "feed": feed,
        "prefetch": cache.prefetch, "prefetch_evictions": cache.stats.prefetch_evictions,
        "routing": routing,
        # the process's peak resident set (ru_maxrss) beside what the memory plan gave it (floor + expert budget)
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "plan_bytes": plan.floor_bytes + plan.budget_bytes,
        "prefill": phase(c0, c1, t1 - t0, len(ids), cpu1 - cpu0), "decode": phase(c1, c2, t2 - t1, n, cpu2 - cpu1),
        **({"profile": prof} if prof else {}),
    }


def _uniform_router(model):
    """A stand-in for model.route: top_k distinct experts per row, uniformly at random, equal weights."""
    g = torch.Generator().manual_seed(0)
    E, k = model.moe["num_experts"], model.top_k

    def route(i, x):
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(x.shape[0])])
        return torch.full(idx.shape, 1.0 / k), idx

    return route


def report_lines(r: dict) -> list[str]:
    out = [f"model        {r['model']} ({r['family']}, {r['dtype']}, {r['threads']} threads)",
           f"cache        budget {fmt_bytes(r['budget_bytes'])} of a {fmt_bytes(r['bank_bytes'])} bank "
           f"({r['budget_bytes'] / r['working_set_bytes']:.2f} working sets); reads: {r['read_mode']}"
           if r["working_set_bytes"] else "cache        no routed experts",
           f"disk         {r['disk_bandwidth_gb_per_s']:.2f} GB/s sequential ({r['disk_bandwidth_mode']}, on the largest bank)"]
    for name in ("prefill", "decode"):
        p = r[name]
        bound = (f"I/O bound {p['io_bound_tok_per_s']:.1f} tok/s (records read, prefetch's too, / disk)"
                 if p["io_bound_tok_per_s"] else "I/O bound: none (no misses)")
        out.append(f"{name:<12} {p['tokens']} tok in {p['seconds']:.2f} s = {p['tok_per_s']:.2f} tok/s | "
                   f"hit {100 * p['hit_rate']:.1f}% ({p['hits']} hit / {p['misses']} miss) | read "
                   f"{fmt_bytes(p['bytes_read'])} at {p['read_gb_per_s']:.2f} GB/s | {bound}"
                   + (f" | disk busy {100 * p['disk_busy_share']:.0f}% of it" if p["disk_busy_seconds"] else ""))
        if p["prefetch_precision"] is not None:
            out.append(f"{'':<12} prefetch read {fmt_bytes(p['prefetch_bytes'])}; next-layer prediction precision "
                       f"{100 * p['prefetch_precision']:.1f}%, recall {100 * p['prefetch_recall']:.1f}%")
    out.append(f"fill         background fill read {fmt_bytes(r['background_fill_bytes'])} (timing waited "
               f"{r['fill_wait_seconds']:.2f} s for it); evictions {r['evictions']}"
               f" (prefetch {'on' if r['prefetch'] else 'off'}, its evictions {r['prefetch_evictions']})")
    if "profile" in r:
        p = r["profile"]
        total = sum(p["ms_per_token"].values())
        out.append(f"profile      {total:.2f} ms per decode token: " + ", ".join(
            f"{b} {ms:.2f}" for b, ms in p["ms_per_token"].items()))
        top = ", ".join(f"{k} {v}" for k, v in list(p["ops_by_kind"].items())[:8])
        out.append(f"ops          {p['ops_per_step']} torch operators per decode step ({top}, ...)")
    return out
