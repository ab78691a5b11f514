"""LFRU against plain LRU on a recorded routing trace (docs/LEARNED.md).

Records which experts every token routes to, token by token, while the model reads a text (teacher
forcing), then replays that trace through the cache's own eviction policy (waste/runtime/policy.py) at
several budgets, counting hits the way ExpertCache does (one slab shared by all MoE layers, a layer's
experts pinned while it runs).

    python benchmarks/cache_policy.py MODEL.waste --text FILE [--tokens 1500]
Nothing here is a test.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import waste
from waste.runtime.policy import LFRU


def record_trace(model_path: str, text: str, n_tokens: int) -> tuple[list, dict]:
    with waste.load(model_path, preload=False) as eng:
        ids = eng.encode(text)[:n_tokens]
        m = eng.model
        m.route_trace = []
        st = m.new_state()
        for t, tok in enumerate(ids):
            m.forward(torch.tensor([tok]), st, t, last_only=True)
        trace = [(layer, sorted(set(idx[0].tolist()))) for layer, idx in m.route_trace]
        info = {"moe_layers": len(eng.container.banks), "top_k": m.top_k,
                "experts": eng.container.config["moe"]["num_experts"], "tokens": len(ids)}
    return trace, info


def simulate(trace, n_slots: int, half_life: float, n_layers: int) -> float:
    pol = LFRU(n_slots, half_life)
    slot_of, key_of = {}, [None] * n_slots
    free = list(range(n_slots))
    hits = misses = 0
    for layer, experts in trace:
        pinned = {slot_of[(layer, e)] for e in experts if (layer, e) in slot_of}
        new = [e for e in experts if (layer, e) not in slot_of]
        hits += len(experts) - len(new)
        misses += len(new)
        slots = [free.pop() for _ in range(min(len(new), len(free)))]
        if len(slots) < len(new):
            cand = np.array([s for s in range(n_slots) if s not in pinned and key_of[s] is not None])
            for s in pol.victims(cand, len(new) - len(slots)).tolist():
                del slot_of[key_of[s]]
                slots.append(s)
        for e, s in zip(new, slots):
            slot_of[(layer, e)], key_of[s] = s, (layer, e)
            pol.reset(s)
        for e in experts:
            pol.touch(slot_of[(layer, e)])
        pol.advance(1.0 / n_layers)
    return hits / (hits + misses)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=1500)
    a = ap.parse_args()
    trace, info = record_trace(a.model, open(a.text).read(), a.tokens)
    L, k, E = info["moe_layers"], info["top_k"], info["experts"]
    ws = k * L
    rows = []
    print(f"{info['tokens']} tokens, {L} MoE layers, top-{k} of {E}; working set = {ws} records, bank = {E * L}")
    print("budget (working sets) | LRU | " + " | ".join(f"LFRU h={h}" for h in (2, 8, 32, 1e9)))
    for mult in sorted({1, 1.5, 2, 3, 4, E / k / 2}):
        n = int(mult * ws)
        if n >= E * L:
            continue
        res = {"LRU": simulate(trace, n, 0, L)}
        for h in (2, 8, 32, 1e9):
            res[f"LFRU h={h:g}"] = simulate(trace, n, h, L)
        rows.append({"working_sets": mult, "slots": n, **res})
        print(f"{mult:.2f} ({n} slots) | " + " | ".join(f"{100 * v:.1f}%" for v in res.values()))
    print(json.dumps({"info": info, "rows": rows}))


if __name__ == "__main__":
    main()
