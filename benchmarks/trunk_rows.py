"""A decode row's attention matrices on the CPU, cold: the fused q/k/v (5120 x 2048) and o (2048 x 4096) projections of
26 Qwen3-30B-A3B-shaped layers, one row through each in turn (0.5 GB of q8, more than the caches), in ms per layer,
for q8 and q4 in float32 (numba rows) and bfloat16 (torch's int8 / int4 kernels) at 1 and 2 threads; and q8's float32
row as it went before its numba row (Q8.linear: the codes widened to float32 at every call, then F.linear).

    python benchmarks/trunk_rows.py

Nothing here is a test.
"""
from __future__ import annotations

import statistics
import time

import torch

from waste.quant.formats import get_format
from waste.quant.linear import QuantWeight, fuse_rows, linear

LAYERS = 26


def layers(name: str) -> list:
    f, g = get_format(name), torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        ws = [QuantWeight(f, f.pack(torch.randn(n, 2048, generator=g) * 0.02), (n, 2048)) for n in (4096, 512, 512)]
        qkv = fuse_rows(ws)          # q8 stacks q, k and v (the model's qkv_proj); q4 keeps three
        out.append(([qkv] if qkv is not None else ws, QuantWeight(f, f.pack(torch.randn(2048, 4096, generator=g) * 0.02),
                                                                   (2048, 4096))))
    return out


def main():
    for name in ("q8", "q4"):
        ls = layers(name)
        for dt in (torch.float32, torch.bfloat16):
            for t in (1, 2):
                torch.set_num_threads(t)
                x, x2 = torch.randn(1, 2048, dtype=dt), torch.randn(1, 4096, dtype=dt)
                ms = []
                for _ in range(4):
                    t0 = time.perf_counter()
                    for qkv, o in ls:
                        for w in qkv:
                            linear(x, w)
                        linear(x2, o)
                    ms.append(1e3 * (time.perf_counter() - t0) / LAYERS)
                ms = ms[1:]                  # the first pass compiles and warms
                print(f"{name} {str(dt)[6:]:<8} {t} thread(s): {statistics.median(ms):.3f} ms a layer "
                      f"({min(ms):.3f}-{max(ms):.3f})", flush=True)
        if name == "q8":
            torch.set_num_threads(1)
            x, x2 = torch.randn(1, 2048), torch.randn(1, 4096)
            t0 = time.perf_counter()
            for qkv, o in ls[:4]:
                qkv[0].fmt.linear(x, qkv[0].parts, qkv[0].shape)
                o.fmt.linear(x2, o.parts, o.shape)
            print(f"q8 float32 widened (before), 1 thread: {1e3 * (time.perf_counter() - t0) / 4:.3f} ms a layer")


if __name__ == "__main__":
    main()
