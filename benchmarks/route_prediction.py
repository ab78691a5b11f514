"""How well could a layer's experts be predicted one layer early? (docs/LEARNED.md §3e, prefetching)

    python benchmarks/route_prediction.py [--tokens 512]

On the bundled trained model (bf16 container, float32), runs the held-out text layer by layer and, for each MoE
layer i > 0, applies layer i's router to two earlier states: the residual stream before layer i-1's MLP (when a
prefetch of layer i's experts could start, overlapping layer i-1's expert compute) and layer i's own input (before
its attention). Prints the share of the experts actually chosen that each prediction names.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import waste  # noqa: E402
from waste.convert.convert import convert  # noqa: E402
from waste.layers.norm import rms_norm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    a = ap.parse_args()
    out = convert(ROOT / "waste" / "bundled" / "tiny-py-moe", Path(tempfile.mkdtemp()) / "b.waste", experts="bf16",
                  trunk="bf16", progress=False)
    with waste.load(out, dtype="float32") as eng, torch.no_grad():
        m = eng.model
        ids = torch.tensor(eng.encode((ROOT / "tests" / "data" / "heldout_waste_source.py.txt").read_text())[:a.tokens])
        x, state, pos = F.embedding(ids, m.embed), m.new_state(), torch.arange(len(ids))
        before_attn, before_mlp, chosen = [], [], {}
        for i, lw in enumerate(m.layers):
            before_attn.append(x)
            att, state[i] = m.attend(i, rms_norm(x, lw["input_layernorm.weight"], m.eps), state[i], pos)
            x = x + att
            before_mlp.append(x)
            h = rms_norm(x, lw["post_attention_layernorm.weight"], m.eps)
            if m.cfg["layers"][i]["mlp"] != "dense":
                chosen[i] = m.route(i, h)[1]
            x = x + m.mlp(i, h)

        def named(i, xs):
            guess = m.route(i, rms_norm(xs, m.layers[i]["post_attention_layernorm.weight"], m.eps))[1]
            return sum(len(set(g.tolist()) & set(c.tolist())) for g, c in zip(guess, chosen[i])) / chosen[i].numel()

        for i in sorted(chosen):
            if i > 0:
                print(f"layer {i}: from before layer {i - 1}'s MLP {named(i, before_mlp[i - 1]):.2f}; "
                      f"from layer {i}'s input {named(i, before_attn[i]):.2f}")


if __name__ == "__main__":
    main()
