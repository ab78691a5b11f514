"""A GPU decode row's trunk matvecs alone: quant/gemv_triton.py's tiles (rows a program, columns a step, warps)
against cuBLAS (F.linear) on the Qwen3-30B-A3B shape's q/k/v (5120 x 2048), o (2048 x 4096) and head
(151936 x 2048) in bf16, and the router (128 x 2048 float32) as decode_triton.router_row against cuBLAS's float32
gemv + the row's cast + softmax_topk_tail:

    python benchmarks/gemv_tiles.py [--best FILE]

Each arm: 16 calls on 16 weight copies (the q/k/v and o copies exceed the L2: the reads come from HBM; the head is
311 MB alone) captured in one CUDA graph, replayed 20 times; the median replay / 16 is a call's time, its bytes /
that time its rate beside a 2 GiB device copy's. --best writes {"N,K": [bn, bk, warps]} of the fastest tiles for
gpu_profile.py --gemv-tiles. Not a test; docs/LEARNED.md §10k has the figures.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from expert_parallel_gpu import hbm_rate  # noqa: E402
from q4_tiles import time_arm  # noqa: E402
from waste.layers import decode_triton  # noqa: E402
from waste.quant import gemv_triton  # noqa: E402

SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "head": (151936, 2048)}
TILES = [(bn, bk, w) for bn in (1, 2, 4, 8, 16) for bk in (256, 512, 1024, 2048) for w in (4, 8) if bn * bk <= 16384]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--best", type=Path)
    a = ap.parse_args()
    rate = hbm_rate()
    print(f"{torch.cuda.get_device_name()}: HBM copy {rate / 1e9:.0f} GB/s", flush=True)
    best = {}
    for name, (N, K) in SHAPES.items():
        copies = 1 if name == "head" else 16
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        sets = list(range(16))
        nbytes = N * K * 2
        ref = F.linear(x, ws[0]).float()

        def arm(label, fn):
            t = time_arm(lambda i: fn(ws[i % copies]), sets)
            err = float((fn(ws[0]).float() - ref).norm() / ref.norm())
            print(f"{name} {N}x{K} {label:18s} {1e6 * t:7.2f} us  {nbytes / t / 1e9:6.0f} GB/s = "
                  f"{100 * nbytes / t / rate:5.1f}% of HBM  rel. to cuBLAS {err:.1e}", flush=True)
            return t

        arm("cuBLAS", lambda w: F.linear(x, w))
        arm(f"default {gemv_triton.tile_for(N, K)}", lambda w: gemv_triton.row(x, w))
        res = []
        for tile in TILES:
            gemv_triton.TILES[(N, K)] = tile
            res.append((arm(str(tile), lambda w: gemv_triton.row(x, w)), tile))
        del gemv_triton.TILES[(N, K)]
        res.sort()
        print(f"best {name}: {res[0][1]} {1e6 * res[0][0]:.2f} us = {100 * nbytes / res[0][0] / rate:.1f}% of HBM",
              flush=True)
        best[f"{N},{K}"] = list(res[0][1])
        del ws
    E, H = 128, 2048
    rs = [torch.randn(E, H, device="cuda") / H ** 0.5 for _ in range(16)]
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    for label, fn in (("cuBLAS + cast + tail", lambda r: decode_triton.softmax_topk_tail(F.linear(x.float(), r), 8,
                                                                                         True)),
                      ("router_row", lambda r: decode_triton.router_row(x, r, 8, True))):
        t = time_arm(lambda i: fn(rs[i]), list(range(16)))
        print(f"router {E}x{H} f32 {label:22s} {1e6 * t:7.2f} us  {E * H * 4 / t / 1e9:6.0f} GB/s", flush=True)
    w1, i1 = decode_triton.softmax_topk_tail(F.linear(x.float(), rs[0]), 8, True)
    w2, i2 = decode_triton.router_row(x, rs[0], 8, True)
    print(f"router ids equal: {torch.equal(i1, i2)}, weights max diff {float((w1 - w2).abs().max()):.1e}", flush=True)
    if a.best:
        a.best.write_text(json.dumps(best))


if __name__ == "__main__":
    main()
