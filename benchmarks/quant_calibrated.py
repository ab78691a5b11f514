"""Would calibrated (activation-aware) rounding make q4 better on the bundled model? (docs/LEARNED.md §5c)

    OPENBLAS_NUM_THREADS=1 python benchmarks/quant_calibrated.py [--tokens 8192] [--methods plain,imp,gptq]

Runs the bf16 container over calibration text from the model's own domain (the json and http packages of this
Python's standard library; the held-out text is waste's own source), keeps each expert's input rows, and forms
per expert matrix H = X^T X / n (gate and up: the layer input routed to the expert; down: silu(gate x) * up x).
Then converts the bundled model to q4 three ways and measures each against the bf16 container on the held-out
text, as benchmarks/quant_quality.py does:
  plain  waste's q4 (per group of 64, the least-squares clip search of waste/quant/intq.py)
  imp    the same search, each column's squared error weighted by H's diagonal (llama.cpp's "imatrix" idea)
  gptq   GPTQ: columns in order, each group's scale and zero fitted on the error-updated weights, every rounding
         error pushed onto the not yet quantized columns through the Cholesky factor of H^-1 (1% damping)
The stored bytes are waste's q4 in all three: only the choice of codes, scales and zeros differs.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import waste  # noqa: E402
from waste.convert.convert import convert  # noqa: E402
from waste.convert.source import Checkpoint  # noqa: E402
from waste.quant import int4pack, intq  # noqa: E402
from waste.quant.formats import get_format  # noqa: E402
from waste.quant.quality import compare  # noqa: E402

BUNDLED = ROOT / "waste" / "bundled" / "tiny-py-moe"
HELDOUT = ROOT / "tests" / "data" / "heldout_waste_source.py.txt"
PROMPTS = ["def fibonacci(n):", "class Cache:\n    def __init__(self"]


def expert_hessians(ref, text_ids: list[int]) -> dict[str, torch.Tensor]:
    rows: dict[tuple[int, int], list[torch.Tensor]] = {}
    apply = ref.model.experts.apply

    def record(layer, x, idx, w):
        for e in torch.unique(idx).tolist():
            rows.setdefault((layer, e), []).append(x[(idx == e).any(-1)].float())
        return apply(layer, x, idx, w)

    ref.model.experts.apply = record
    try:
        with torch.no_grad():
            for i in range(0, len(text_ids), 512):
                ref.model.forward(torch.tensor(text_ids[i:i + 512]), ref.model.new_state(), 0)
    finally:
        ref.model.experts.apply = apply
    ck, H = Checkpoint(BUNDLED), {}
    for (layer, e), xs in rows.items():
        x, p = torch.cat(xs), f"model.layers.{layer}.mlp.experts.{e}."
        a = F.silu(x @ ck.get(p + "gate_proj.weight").float().T) * (x @ ck.get(p + "up_proj.weight").float().T)
        H[p + "gate_proj.weight"] = H[p + "up_proj.weight"] = x.T @ x / len(x)
        H[p + "down_proj.weight"] = a.T @ a / len(a)
    print(f"calibration: {len(text_ids)} tokens; rows per expert {min(len(torch.cat(v)) for v in rows.values())}"
          f"-{max(len(torch.cat(v)) for v in rows.values())}", flush=True)
    return H


def fit_groups(x: torch.Tensor, wgt: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, G, g] -> bf16-rounded scale and zero [N, G]: q4's clip search and least-squares refits, the squared
    error of each column weighted by wgt [G, g] (None: unweighted, exactly waste's q4)."""
    wgt = torch.ones_like(x) if wgt is None else wgt.expand_as(x)

    def err(s, z):
        q = ((x - z[..., None]) / s[..., None] + 8).round().clamp(0, 15)
        return q, ((((q - 8) * s[..., None] + z[..., None] - x) ** 2) * wgt).sum(-1)

    mx, mn = x.amax(-1), x.amin(-1)
    c, h = (mx + mn) / 2, (mx - mn) / 2
    best = None
    for shrink in intq.Q4_SHRINK:
        s = (2 * h * shrink / 15).clamp_min(1e-30).to(torch.bfloat16).float()
        z = (c - h * shrink + 8 * s).to(torch.bfloat16).float()
        q, e = err(s, z)
        if best is None:
            best = [q, s, z, e]
            continue
        b = e < best[3]
        best = [torch.where(b[..., None], q, best[0]), torch.where(b, s, best[1]), torch.where(b, z, best[2]),
                torch.minimum(e, best[3])]
    q, s, z, e = best
    for _ in range(intq.Q4_REFITS):
        cq, tot = q - 8, wgt.sum(-1, keepdim=True)
        cm, xm = (wgt * cq).sum(-1, keepdim=True) / tot, (wgt * x).sum(-1, keepdim=True) / tot
        var = (wgt * (cq - cm) ** 2).sum(-1)
        s2 = torch.where(var > 0, (wgt * (cq - cm) * (x - xm)).sum(-1) / var.clamp_min(1e-30), s)
        s2 = s2.clamp_min(1e-30).to(torch.bfloat16).float()
        z2 = (xm[..., 0] - s2 * cm[..., 0]).to(torch.bfloat16).float()
        q2, e2 = err(s2, z2)
        b = e2 < e
        q, s, z, e = torch.where(b[..., None], q2, q), torch.where(b, s2, s), torch.where(b, z2, z), torch.minimum(e, e2)
    return s, z


def parts(q, s, z, N, K):
    return {"q": int4pack.pack_nibbles(q.reshape(N, K).to(torch.uint8)),
            "sz": torch.stack([s, z], -1).transpose(0, 1).to(torch.bfloat16).contiguous()}


def q4_weighted(w: torch.Tensor, h: torch.Tensor) -> dict:
    N, K = w.shape
    g = intq.group_for(K, 64)
    x = w.float().view(N, K // g, g)
    s, z = fit_groups(x, h.diagonal().view(K // g, g))
    return parts(((x - z[..., None]) / s[..., None] + 8).round().clamp(0, 15), s, z, N, K)


def q4_gptq(w: torch.Tensor, h: torch.Tensor, damp: float = 0.01) -> dict:
    N, K = w.shape
    g = intq.group_for(K, 64)
    W = w.float().clone()
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(
        h + damp * h.diagonal().mean() * torch.eye(K))), upper=True)
    Q, S, Z = torch.zeros(N, K), torch.zeros(N, K // g), torch.zeros(N, K // g)
    for i in range(K):
        if i % g == 0:
            s, z = fit_groups(W[:, i:i + g].reshape(N, 1, g), None)
            S[:, i // g], Z[:, i // g] = s[:, 0], z[:, 0]
        s, z = S[:, i // g], Z[:, i // g]
        Q[:, i] = ((W[:, i] - z) / s + 8).round().clamp(0, 15)
        err = (W[:, i] - ((Q[:, i] - 8) * s + z)) / U[i, i]
        W[:, i + 1:] -= err[:, None] * U[i, i + 1:][None, :]
    return parts(Q, S, Z, N, K)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--methods", default="plain,imp,gptq")
    a = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="waste-calib-"))
    ref = waste.load(convert(BUNDLED, tmp / "ref.waste", experts="bf16", trunk="bf16", progress=False), dtype="float32")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(glob.glob(str(stdlib / "json" / "*.py")) + glob.glob(str(stdlib / "http" / "*.py")))
    H = expert_hessians(ref, ref.encode("".join(Path(f).read_text() for f in files))[:a.tokens])
    ids = ref.encode(HELDOUT.read_text())
    prompts = [ref.encode(p) for p in PROMPTS]
    ck, fmt = Checkpoint(BUNDLED), get_format("q4")
    by_key = {}
    for n in H:                     # the converter hands pack() a tensor, not its name: find it by its bytes
        w = ck.get(n)
        by_key[(tuple(w.shape), w.flatten()[:16].float().numpy().tobytes())] = n
    plain, cache, cache_ci = fmt.pack, {}, {}
    for method in a.methods.split(","):
        def pack(w, _m=method):
            n = by_key.get((tuple(w.shape), w.flatten()[:16].float().numpy().tobytes()))
            if _m == "plain" or n is None:
                return plain(w)
            return q4_weighted(w, H[n]) if _m == "imp" else q4_gptq(w, H[n])
        fmt.pack = pack
        try:
            out = convert(BUNDLED, tmp / f"{method}.waste", experts="q4", trunk="bf16", progress=False, workers=1)
        finally:
            fmt.pack = plain
        with waste.load(out, dtype="float32") as eng:
            q = compare(ref, eng, ids, prompts, ref_cache=cache)
            qc = compare(ref, eng, ids[:1024], prompts, n=16, ref_cache=cache_ci)
        print(f"{method:>5}: KL {q.kl:.3e}  top-1 {q.top1:.4f}  greedy {q.greedy_same}/{q.greedy_total}  "
              f"(first 1024 tokens, as tests/test_quant.py: KL {qc.kl:.3e})", flush=True)


if __name__ == "__main__":
    main()
