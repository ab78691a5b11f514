"""Microseconds of the small operators a decode step of the bundled model is made of (docs/LEARNED.md §10): one row
against trunk-sized matrices in each stored format, fused attention with and without a batch dimension, rms_norm.

    python benchmarks/small_ops.py [--threads 1]

Every figure is the min (and median) over 15 rounds of 200 calls, the arms interleaved round by round.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from waste.layers.attention import causal_softmax_attend  # noqa: E402
from waste.quant.formats import get_format  # noqa: E402


def bench(fns: dict, n: int = 200, rounds: int = 15) -> None:
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(n):
                f()
            res[k].append((time.perf_counter() - t) / n * 1e6)
    for k, v in res.items():
        print(f"  {k:28s} min {min(v):8.1f} us   median {sorted(v)[len(v) // 2]:8.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    torch.set_num_threads(ap.parse_args().threads)
    with torch.inference_mode():
        for N, K in ((1024, 320), (8192, 320), (320, 320)):
            print(f"1 x {K} against {N} x {K}")
            W = torch.randn(N, K)
            q8, q4 = get_format("q8"), get_format("q4")
            p8, p4 = q8.prepare(q8.pack(W), (N, K)), q4.prepare(q4.pack(W), (N, K))
            x, Wb = torch.randn(1, K), W.bfloat16()
            xb = x.bfloat16()
            bench({"f32 F.linear": lambda: F.linear(x, W), "bf16 F.linear": lambda: F.linear(xb, Wb),
                   "q8 float32 path": lambda: q8.linear(x, p8, (N, K)),
                   "q8 int8 kernel (bf16 x)": lambda: q8.linear(xb, p8, (N, K)),
                   "q4 int4 kernel (bf16 x)": lambda: q4.linear(xb, p4, (N, K))})
        H, G, d, S = 10, 5, 32, 60
        q, k, v = torch.randn(1, H, d), torch.randn(S, G, d), torch.randn(S, G, d)
        print(f"attention: {H} heads over {S} positions of {G} KV heads")
        bench({"fused, batch dim": lambda: F.scaled_dot_product_attention(
                   q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], enable_gqa=True),
               "fused, no batch dim": lambda: F.scaled_dot_product_attention(
                   q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True),
               "einsum pair": lambda: causal_softmax_attend(q, k, v, d ** -0.5, S - 1)})
        xr, w = torch.randn(1, 320), torch.randn(320)
        print("rms_norm, 320 wide")
        bench({"F.rms_norm": lambda: F.rms_norm(xr, (320,), w, 1e-6),
               "written out": lambda: xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * w})


if __name__ == "__main__":
    main()
