"""Speed of one routed expert (gate, up, down + SwiGLU) in every storage format, through the same call the
expert cache makes (layers/moe.py expert_rows on a record's parts), at T = 1 (decode) and T = 64
(prefill), for the expert shapes of Qwen3-30B-A3B, Kimi-Linear-48B and Kimi K3 (latent 3584 -> 3072).

    OPENBLAS_NUM_THREADS=1 python benchmarks/quant_kernels.py [--shapes qwen3,kimi,k3] [--formats ...] [--passes 5]
        [--dtype bfloat16|float32]

Records hold random parts of the right dtypes (speed does not depend on the values; vq3's k-means would take
minutes per record). "Cold": each pass walks through enough distinct records to exceed 600 MB, so the weights
come from memory, not from the 260 MB L3. Per pass the median microseconds per expert; printed: the median
over passes and the range. GB/s = stored record bytes / time. Limits beside each figure: the record read
from memory at the bandwidth measured here (torch sum, 2 threads) and from disk at 1.5 GB/s (O_DIRECT
ceiling of machine.md §B).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from waste.container.bank import RecordLayout  # noqa: E402
from waste.quant.formats import get_format  # noqa: E402
from waste.layers.moe import Bank, expert_rows  # noqa: E402
from waste.runtime.experts import matrix_parts, prepare_record  # noqa: E402

SHAPES = {"qwen3": (2048, 768), "kimi": (2304, 1024), "k3": (3584, 3072)}     # hidden (or latent), intermediate
FORMATS = ["bf16", "q8", "q4g32", "q4", "q4g128", "vq3", "mxfp4"]
DISK_GBS = 1.5
COLD_BYTES = 600 << 20


def random_record(fmt, h: int, inter: int, gen: torch.Generator):
    shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    tensors = {}
    for m, shp in shapes.items():
        for suffix, (dt, pshape) in fmt.part_specs(shp).items():
            name = f"{m}.{suffix}" if suffix else m
            if dt.is_floating_point:
                t = (torch.randn(pshape, generator=gen) * (0.02 if suffix in ("", "sz", "scale") else 1.0)).to(dt)
            else:
                t = torch.randint(0, 256 if dt == torch.uint8 else 127, pshape, generator=gen).to(dt)
            tensors[name] = t
    layout = RecordLayout.from_tensors(tensors)
    rec = torch.from_numpy(layout.pack(tensors))
    return layout, rec, shapes


def mem_bandwidth() -> float:
    a = torch.ones(256 << 20)          # 1 GiB of float32
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def bench(fmt, h, inter, T, passes, gen, dtype=torch.bfloat16):
    layout, rec0, shapes = random_record(fmt, h, inter, gen)
    n = max(4, min(48, COLD_BYTES // layout.record_bytes + 1))
    recs = [rec0] + [random_record(fmt, h, inter, gen)[1] for _ in range(n - 1)]
    views = [matrix_parts(layout.views(r)) for r in recs]
    for v in views:                  # as the cache does when a record fills a slot (a no-op on AVX-512 builds)
        prepare_record(v, fmt, shapes)
    x = torch.randn(T, h, generator=gen).to(dtype)
    for v in views[:2]:
        bank = Bank({}, shapes, fmt)
        expert_rows(x, v, bank)                          # compile / warm
    meds = []
    for _ in range(passes):
        times = []
        for v in views:
            t = time.perf_counter()
            expert_rows(x, v, bank)
            times.append(time.perf_counter() - t)
        meds.append(statistics.median(times))
    return layout.payload_bytes, meds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", help="activation dtype: bfloat16 (what models over 2 GiB "
                    "compute in) or float32")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    bw = mem_bandwidth()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.dtype} activations; memory bandwidth (torch sum) {bw:.1f} GB/s; "
          f"disk {DISK_GBS} GB/s (machine.md)")
    print("| shape | format | bits/w | record MB | T | us/expert (median, range) | stored GB/s | memory limit us | disk limit us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in a.shapes.split(","):
        h, inter = SHAPES[s]
        for f in a.formats.split(","):
            fmt = get_format(f)
            for T in [int(t) for t in a.tokens.split(",")]:
                nbytes, meds = bench(fmt, h, inter, T, a.passes, gen, getattr(torch, a.dtype))
                med = statistics.median(meds)
                bpw = nbytes * 8 / (3 * h * inter)
                print(f"| {s} {h}x{inter} | {f} | {bpw:.2f} | {nbytes / 1e6:.2f} | {T} | {med * 1e6:.0f} "
                      f"({min(meds) * 1e6:.0f}-{max(meds) * 1e6:.0f}) | {nbytes / med / 1e9:.1f} | "
                      f"{nbytes / bw / 1e3:.0f} | {nbytes / DISK_GBS / 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
