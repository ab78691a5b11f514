"""How far q8 rounding of one class of matrices moves the random oracle fixtures' logits (docs/LEARNED.md §5c).

    python benchmarks/quant_fixture_sensitivity.py

For each fixture of tests/fixtures.py (Qwen3-MoE, Kimi-Linear) and each class of 2-D weights (the same name in
every layer), replaces those weights in transformers' own model by q8's unpack(pack(W)) and prints the relative
L2 change of the logits over 40 random tokens. Then converts the Kimi-Linear fixture with q8 experts (bf16 trunk)
and with a q8 trunk (bf16 experts) and prints, against the bf16 container, the relative logit change at each
position and how many tokens each MoE layer routes differently. Needs the test extra (transformers).
"""
from __future__ import annotations

import copy
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from fixtures import kimi_linear_model, qwen3_moe_model  # noqa: E402

import waste  # noqa: E402
from waste.convert.convert import convert  # noqa: E402
from waste.quant.formats import get_format  # noqa: E402


def main() -> None:
    q8 = get_format("q8")
    ids = torch.randint(3, 290, (1, 40), generator=torch.Generator().manual_seed(3))
    for build in (qwen3_moe_model, kimi_linear_model):
        hf = build()
        with torch.no_grad():
            base = hf(ids).logits
        classes: dict[str, list[str]] = {}
        for n, w in hf.state_dict().items():
            if w.dim() == 2 and "embed" not in n and "norm" not in n:
                classes.setdefault(re.sub(r"\d+\.", "", n), []).append(n)
        for cls, names in sorted(classes.items()):
            m = copy.deepcopy(hf)
            sd = m.state_dict()
            for n in names:
                sd[n].copy_(q8.unpack(q8.pack(sd[n].float()), tuple(sd[n].shape), sd[n].dtype))
            with torch.no_grad():
                out = m(ids).logits
            print(f"{build.__name__:>18}  {cls:<55} {((out - base).norm() / base.norm()).item():.4f}", flush=True)
    from fixtures import save_release

    root = Path(tempfile.mkdtemp(prefix="waste-fixture-q8-"))
    src = save_release(kimi_linear_model(), root / "src")
    runs = {}
    for experts, trunk in (("bf16", "bf16"), ("q8", "bf16"), ("bf16", "q8")):
        with waste.load(convert(src, root / f"{experts}-{trunk}.waste", experts=experts, trunk=trunk, progress=False),
                        dtype="float32") as eng:
            m = eng.model
            m.route_trace = []
            logits = m.forward(ids[0], m.new_state(), 0)
            runs[experts, trunk] = logits, [idx.sort(-1).values for _, idx in m.route_trace]
    ref, ref_routes = runs["bf16", "bf16"]
    for key in (("q8", "bf16"), ("bf16", "q8")):
        logits, routes = runs[key]
        per_pos = ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
        flips = [int((a != b).any(-1).sum()) for a, b in zip(ref_routes, routes)]
        print(f"kimi_linear experts {key[0]} trunk {key[1]}: tokens routed differently per MoE layer {flips}; "
              f"relative logit change per position {[round(v, 3) for v in per_pos]}", flush=True)


if __name__ == "__main__":
    main()
