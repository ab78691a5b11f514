"""How evenly expert-parallel placement spreads the routed pairs, out of sample: each placement is made from the
first half of a routing trace's tokens and judged on the second half (the busiest rank per MoE layer against an
even share, averaged over layers: 1.00 is an even split; a layer's exchange waits for its busiest rank).

    python benchmarks/expert_placement.py [--trace benchmarks/traces/tiny-py-moe-heldout.json] [--experts 128]
    python benchmarks/expert_placement.py --fit OTHER.json     # placed from another trace, judged on all of --trace

--experts E scales the trace to E experts per layer (as `waste bench --routing trace:` replays it onto a larger
model). Nothing here is a test.
"""
from __future__ import annotations

import argparse

from waste.runtime import parallel, trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="benchmarks/traces/tiny-py-moe-heldout.json")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--fit", default=None, help="place from this trace (same model) and judge on the whole of --trace")
    a = ap.parse_args()
    t = trace.load(a.trace)
    E = a.experts or t["num_experts"]
    layers = {i: E for i in range(len(t["tokens"][0]))}
    half = len(t["tokens"]) // 2
    fit, judge = {**t, "tokens": t["tokens"][:half]}, {**t, "tokens": t["tokens"][half:]}
    where = f"placed on tokens 0..{half - 1}, judged on {half}..{len(t['tokens']) - 1}"
    if a.fit:
        fit, judge = trace.load(a.fit), t
        where = f"placed from {a.fit} ({len(fit['tokens'])} tokens), judged on all of it"
    k = t["top_k"]
    fit_count, judge_count = parallel.frequencies(layers, fit, k), parallel.frequencies(layers, judge, k)
    print(f"{a.trace}: {len(t['tokens'])} tokens x {len(layers)} MoE layers, {E} experts, top-{k}; {where}")
    print("ranks  blocks of ids  from the trace  (busiest rank per layer / even share; in sample in brackets)")
    for n in (2, 4, 8):
        if n > E:
            break
        total = [0] * n
        by_trace = {l: parallel.balance(fit_count[l], n, total) for l in layers}
        by_id = parallel.place(layers, n, "id")
        _, peak_id = parallel.shares(by_id, judge_count, n)
        _, peak_tr = parallel.shares(by_trace, judge_count, n)
        _, fit_tr = parallel.shares(by_trace, fit_count, n)
        print(f"{n:>5}  {peak_id:13.2f}  {peak_tr:14.2f}  ({fit_tr:.2f})")


if __name__ == "__main__":
    main()
