"""Quality of every storage format on the bundled trained model (docs/LEARNED.md, "Quantized formats").

    OPENBLAS_NUM_THREADS=1 python benchmarks/quant_quality.py [--pairs q4:q8,...] [--experts-per-token 1] [--decode] [--json out.json]

Converts waste/bundled/tiny-py-moe once per (experts, trunk) pair into a temporary directory and compares it
with the bf16 container, both computing in float32: mean KL and top-1 agreement of the next-token
distributions over the held-out text (tests/data/heldout_waste_source.py.txt, waste's own source, which the
model never saw: it was trained on the CPython standard library), and greedy agreement over 4 prompts x 32
tokens. Also the per-matrix relative error of each format on the model's own expert matrices. --experts-per-token K
also measures routing each token to K experts (waste run --experts-per-token) on the bf16 container.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import waste  # noqa: E402
from waste.convert.convert import convert  # noqa: E402
from waste.convert.source import Checkpoint  # noqa: E402
from waste.quant.formats import get_format  # noqa: E402
from waste.quant.quality import compare, rel_error  # noqa: E402

BUNDLED = ROOT / "waste" / "bundled" / "tiny-py-moe"
HELDOUT = ROOT / "tests" / "data" / "heldout_waste_source.py.txt"
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():\n", "class Cache:\n    def __init__(self", "    for i in range("]
PAIRS = [("q8", "bf16"), ("bf16", "q8"), ("q8", "q8"), ("q4g32", "bf16"), ("q4", "bf16"), ("q4g128", "bf16"),
         ("q4", "q8"), ("q4", "q4"), ("vq3", "bf16"), ("vq3", "q8"), ("mxfp4", "bf16")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", default=None, help="experts:trunk,... (default: all of PAIRS)")
    ap.add_argument("--experts-per-token", default="1", help="experts per token (comma-separated counts) to measure on "
                    "the bf16 container")
    ap.add_argument("--json", default=None)
    ap.add_argument("--decode", action="store_true", help="KL over logits of tokens fed one at a time (the decode "
                    "rows' kernels) instead of whole windows (prefill's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: immune to a busy machine's spinning)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    pairs = [tuple(p.split(":")) for p in a.pairs.split(",")] if a.pairs else PAIRS
    tmp = Path(tempfile.mkdtemp(prefix="waste-quality-"))
    rows = []
    ref = waste.load(convert(BUNDLED, tmp / "ref.waste", experts="bf16", trunk="bf16", progress=False), dtype="float32")
    ids = ref.encode(HELDOUT.read_text())
    prompts = [ref.encode(p) for p in PROMPTS]
    cache: dict = {}
    print(f"held-out text: {len(ids)} tokens; greedy: {len(prompts)} prompts x 32 tokens", flush=True)
    ck = Checkpoint(BUNDLED)
    mats = [n for n in ck.weight_names() if ".experts." in n][:48]
    for experts, trunk in pairs:
        t0 = time.perf_counter()
        c = convert(BUNDLED, tmp / f"{experts}-{trunk}.waste", experts=experts, trunk=trunk, progress=False)
        tc = time.perf_counter() - t0
        with waste.load(c, dtype="float32") as eng:
            q = compare(ref, eng, ids, prompts, ref_cache=cache, decode=a.decode)
            m = eng.container.manifest
        errs = [rel_error(get_format(experts), ck.get(n)) for n in mats] if experts != "bf16" else [0.0]
        row = {"experts": experts, "trunk": trunk, **q.row(), "expert_rel_err": sum(errs) / len(errs),
               "bank_bytes": m["experts"]["bytes"], "trunk_bytes": m["trunk"]["bytes"], "convert_s": tc}
        rows.append(row)
        print(f"{experts:>7} {trunk:>5}  KL {q.kl:.2e}  top1 {q.top1:.4f}  greedy {q.greedy_same}/{q.greedy_total}  "
              f"expert rel err {row['expert_rel_err']:.4f}  bank {row['bank_bytes'] / 1e6:.2f} MB  "
              f"trunk {row['trunk_bytes'] / 1e6:.2f} MB  convert {tc:.1f} s", flush=True)
    for k in [int(v) for v in a.experts_per_token.split(",") if v]:
        ref.model.top_k = k
        try:
            q = compare(ref, ref, ids, prompts, ref_cache=dict(cache))
        finally:
            ref.model.top_k = ref.container.config["moe"]["top_k"]
        # compare() ran the reference memo against the engine at top-k: the memo holds the full-top-k outputs
        rows.append({"experts": "bf16", "trunk": "bf16", "experts_per_token": k, **q.row()})
        print(f"experts per token {k} (of {ref.container.config['moe']['top_k']}), bf16: KL {q.kl:.2e}  top1 {q.top1:.4f}  "
              f"greedy {q.greedy_same}/{q.greedy_total}", flush=True)
    ref.close()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
