"""Routing traces for `waste bench`: record which experts a real run routed each token to (and what next-layer
prefetch predicted for it), and replay that routing on another model, scaled to its expert count.

A random-weight model's own router collapses onto a few experts and flatters the cache; uniform routing is the
worst case; a trace recorded from a trained model (the bundled one, on held-out code) is the realistic middle.

File (JSON): {"format": "waste-routing-trace", "version": 1, "num_experts": E, "top_k": k, "source": ...,
"tokens": [[ids of MoE layer 0, ids of MoE layer 1, ...] per token], "predicted": the same shape, the ids the
next-layer prefetch predicted for that layer ([] where none was made)}.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import WasteError

FORMAT = "waste-routing-trace"


class Recorder:
    """Collects a single-sequence run's routing from the model's route_trace / predict_trace lists."""

    def __init__(self, model):
        self.model = model
        model.route_trace, model.predict_trace = [], []

    def finish(self, source: str) -> dict:
        m = self.model
        routed, predicted = m.route_trace, m.predict_trace
        m.route_trace = m.predict_trace = None
        moe = sorted({layer for layer, _ in routed})
        rows: dict[int, list] = {layer: [] for layer in moe}
        for layer, idx in routed:
            rows[layer] += idx.tolist()
        preds: dict[int, list] = {layer: [] for layer in moe}
        for layer, idx in predicted:
            preds[layer] += idx.tolist()
        n = min(len(r) for r in rows.values()) if rows else 0
        tokens = [[rows[layer][t] for layer in moe] for t in range(n)]
        pred = [[(preds[layer][t] if t < len(preds[layer]) else []) for layer in moe] for t in range(n)]
        return {"format": FORMAT, "version": 1, "num_experts": m.moe["num_experts"], "top_k": m.top_k,
                "source": source, "tokens": tokens, "predicted": pred}


def save(trace: dict, path) -> None:
    Path(path).write_text(json.dumps(trace, separators=(",", ":")) + "\n")


def load(path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise WasteError(f"routing trace {p} does not exist: record one with `waste bench --record-trace {p}`")
    try:
        t = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise WasteError(f"routing trace {p} is not JSON ({exc}): record one with `waste bench --record-trace`")
    if not isinstance(t, dict) or t.get("format") != FORMAT or t.get("version") != 1:
        raise WasteError(f"{p} is not a waste routing trace (format {FORMAT!r}, version 1)")
    E, toks = t.get("num_experts"), t.get("tokens")
    if not isinstance(E, int) or E < 1 or not isinstance(toks, list) or not toks or not toks[0]:
        raise WasteError(f"routing trace {p} has no tokens or no expert count")
    width = len(toks[0])
    for tok in toks:
        if len(tok) != width or any(not ids or any(not (isinstance(e, int) and 0 <= e < E) for e in ids)
                                    for ids in tok):
            raise WasteError(f"routing trace {p}: every token needs {width} layers of expert ids in 0..{E - 1}")
    return t


def scale_ids(ids: list[int], e_from: int, e_to: int, k: int) -> list[int]:
    """k distinct experts of e_to for a routed row of e_from: each traced expert stands for a block of e_to / e_from
    experts; the blocks are taken in rank order, first expert of each, then the second ..., then the next free ids."""
    s = e_to / e_from
    blocks = [list(range(int(e * s), max(int((e + 1) * s), int(e * s) + 1))) for e in ids]
    out, seen = [], set()
    for j in range(max(len(b) for b in blocks)):
        for b in blocks:
            if j < len(b) and b[j] not in seen and len(out) < k:
                out.append(b[j])
                seen.add(b[j])
    e = out[-1] if out else 0
    while len(out) < k:
        e = (e + 1) % e_to
        if e not in seen:
            out.append(e)
            seen.add(e)
    return out


def replay(model, trace: dict):
    """(route, predict) stand-ins for model.router and model.predictor: MoE layer m of the model replays layer
    m mod (the trace's layers), token t replays token t mod (its tokens), ids scaled to the model's experts,
    equal weights. Each MoE layer counts the rows it has routed; a prediction reads the same token's row."""
    E, k = model.moe["num_experts"], model.top_k
    moe = [i for i in range(len(model.layers)) if not model.dense[i]]
    col = {layer: c % len(trace["tokens"][0]) for c, layer in enumerate(moe)}
    toks, preds, n, e_from = trace["tokens"], trace.get("predicted"), len(trace["tokens"]), trace["num_experts"]
    count = {layer: 0 for layer in moe}

    def rows(i, T, table):
        ids = [table[t % n][col[i]] for t in range(count[i], count[i] + T)]
        return torch.tensor([scale_ids(r, e_from, E, k) for r in ids if r], dtype=torch.long).view(-1, k)

    def route(i, x):
        idx = rows(i, x.shape[0], toks)
        count[i] += x.shape[0]
        return torch.full(idx.shape, 1.0 / k), idx

    def predict(j, x):   # the prediction recorded with the trace (none where none was made: nothing prefetched)
        return None, rows(j, x.shape[0], preds) if preds else torch.zeros(0, k, dtype=torch.long)

    return route, predict


def routes(engine, ids: list[int]) -> dict[int, torch.Tensor]:
    """One forward of ids: each MoE layer's expert ids [T, k], in the router's rank order."""
    m = engine.model
    m.route_trace = []
    try:
        m.forward(torch.tensor(ids), m.new_state(), 0, last_only=True)
        out: dict[int, list] = {}
        for layer, idx in m.route_trace:      # one entry per prefill chunk and layer, in order
            out.setdefault(layer, []).append(idx)
        return {layer: torch.cat(v) for layer, v in out.items()}
    finally:
        m.route_trace = None


def agreement(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> dict:
    """Per layer: set agreement (the share of a token's experts that both chose, whatever their order: a swap of
    two near-tied experts is no mismatch) and rank agreement (the share of (token, rank) positions with one id)."""
    if sorted(a) != sorted(b):
        raise WasteError(f"the two runs route different layers ({sorted(a)} and {sorted(b)}): not one model")
    layers = {}
    for layer in sorted(a):
        x, y = a[layer], b[layer]
        if x.shape != y.shape:
            raise WasteError(f"layer {layer} routes {tuple(x.shape)} and {tuple(y.shape)}: not one model's top-k")
        common = (x.unsqueeze(-1) == y.unsqueeze(-2)).any(-1).float().mean().item()
        layers[layer] = {"set": common, "rank": (x == y).float().mean().item()}
    n = len(layers) or 1
    return {"layers": layers, "set": sum(v["set"] for v in layers.values()) / n,
            "rank": sum(v["rank"] for v in layers.values()) / n}
