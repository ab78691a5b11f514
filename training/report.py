"""Render a train.py record.json as markdown tables (corpus, loss curve, expert load, cache hit rates).

    python3 training/report.py training/runs/tiny-py-moe-v2/v2.record.json [--every 250]
    python3 training/report.py training/runs/tiny-py-moe-v1/ep10.record.json --every 200
"""
from __future__ import annotations

import json
import math
import sys


def render(r: dict, curve_every: int = 200) -> str:
    t, e = r["training"], r["eval"]
    out = []
    val = {v["step"]: v["val_loss"] for v in t["val_curve"]}
    out.append("| step | tokens (M) | epochs | lr | train loss | val loss |")
    out.append("|---:|---:|---:|---:|---:|---:|")
    tokens_per_epoch = t["tokens_seen"] / t["epochs"] if t["epochs"] else 1
    for h in t["loss_curve"]:
        if h["step"] % curve_every == 0 or h is t["loss_curve"][-1]:
            v = val.get(h["step"])
            out.append(f"| {h['step']} | {h['tokens'] / 1e6:.1f} | {h['tokens'] / tokens_per_epoch:.2f} | "
                       f"{h['lr']:.2e} | {h['train_loss']:.3f} | {'' if v is None else f'{v:.3f}'} |")
    out.append("")
    out.append(f"Chosen weights: step {e['chosen_weights']['step']} ({e['chosen_weights']['why']}). "
               f"Held-out (test split) loss {e['heldout_test_loss']:.4f} nats/token, perplexity "
               f"{e['heldout_test_ppl']:.2f}, {e['heldout_test_bits_per_byte']:.3f} bits/byte; validation loss "
               f"{e['val_loss']:.4f}. Final step: val {e['final_step_val_loss']:.4f}, test {e['final_step_test_loss']:.4f}.")
    out.append("")
    load = e["expert_load_per_layer"]
    n_e = len(load[0])
    out.append("Expert load per layer on the held-out text: percent of routed token-slots per expert "
               f"(uniform = {100 / n_e:.2f} %); max/min and the entropy-based effective number of experts.")
    out.append("")
    out.append("| layer | " + " | ".join(f"e{i}" for i in range(n_e)) + " | max/min | eff. experts |")
    out.append("|---:|" + "---:|" * n_e + "---:|---:|")
    for li, row in enumerate(load):
        ent = -sum(p * math.log(p) for p in row if p > 0)
        mm = max(row) / max(min(row), 1e-9)
        out.append(f"| {li} | " + " | ".join(f"{100 * p:.1f}" for p in row) + f" | {mm:.1f} | {math.exp(ent):.1f} |")
    out.append("")
    k = r["config"]["num_experts_per_tok"]
    for key, what in (("cache_simulation", "the held-out text"),
                      ("cache_simulation_test_stdlib", "the standard-library files of the held-out text (the first corpus's test split)")):
        if key not in e:
            continue
        sim = e[key]
        out.append(f"LRU expert cache per layer over the routing trace of {what} ({sim['tokens']:,} tokens, "
                   f"in text order, cache kept across files): hit rate = lookups found in the cache / all lookups "
                   f"(top-{k} lookups a token a layer).")
        out.append("")
        out.append("| budget (experts/layer) | of experts | mean hit rate | uniform-routing reference | "
                   + " | ".join(f"L{i}" for i in range(len(load))) + " |")
        out.append("|---|---:|---:|---:|" + "---:|" * len(load))
        for b, v in sim["budgets"].items():
            label = f"{b} ({int(b) // k}x top_k)" if int(b) % k == 0 else b
            out.append(f"| {label} | {100 * v['fraction_of_experts']:.1f} % | {v['hit_rate_mean']:.3f} | "
                       f"{v['uniform_random_routing_reference']:.3f} | "
                       + " | ".join(f"{h:.3f}" for h in v["hit_rate_per_layer"]) + " |")
        out.append("")
    cmp = e.get("compare_model")
    if cmp:
        out.append(f"Held-out bits per byte against `{cmp['model']}` (weights sha256 {cmp['weights_sha256'][:12]}..., "
                   f"its own tokenizer; {cmp['dtype']} on {cmp['device']}; windows of {r['args']['ctx']} of each model's own tokens):")
        out.append("")
        out.append("| text | bytes | this model: tokens | loss | bits/byte | other: tokens | loss | bits/byte |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name in ("test", "test_stdlib"):
            if name in cmp:
                c = cmp[name]
                mine_loss = e["heldout_test_loss"] if name == "test" else e["heldout_test_stdlib_loss"]
                out.append(f"| {name} | {r['corpus'][name]['bytes']:,} | {r['tokens'][name]:,} | {mine_loss:.4f} | "
                           f"{c['this_model_bits_per_byte']:.4f} | {c['tokens']:,} | {c['loss']:.4f} | {c['bits_per_byte']:.4f} |")
        out.append("")
    return "\n".join(out)


def render_corpus(r: dict) -> str:
    c = r["corpus"]
    if "per_source" not in c:
        return ""
    out = ["| source | version | licence | files | bytes | sha256 of the sorted `path<TAB>sha256` lines | left out |",
           "|---|---|---|---:|---:|---|---:|"]
    for row in c["per_source"]:
        out.append(f"| {row['source']} | {row.get('version', '')} | {row.get('licence', '')} | {row['files']:,} | "
                   f"{row['bytes']:,} | `{row['sha256_of_path_sha256_list']}` | {row['skipped']} |")
    out.append(f"| **all** | | | **{c['all']['files']:,}** | **{c['all']['bytes']:,}** | "
               f"`{c['all']['sha256_of_path_sha256_list']}` | {len(c['skipped'])} |")
    return "\n".join(out)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record")
    ap.add_argument("--every", type=int, default=250, help="loss-curve rows every N steps")
    ap.add_argument("--corpus", action="store_true", help="also the per-source corpus table")
    a = ap.parse_args()
    rec = json.load(open(a.record))
    if a.corpus:
        print(render_corpus(rec) + "\n")
    print(render(rec, a.every))
