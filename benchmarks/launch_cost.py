"""The host's cost of one launch, eager, for the calls a GPU decode step makes outside a CUDA graph (LEARNED §10l):

    python benchmarks/launch_cost.py [--calls 2000] [--rounds 5]

Arms, interleaved over --rounds: cuBLAS's gemv (F.linear) against quant/gemv_triton through triton's JIT and through
waste/triton_launch.py's fast launch; decode_triton.add_rms the same two ways against torch's add and RMS norm; an
empty torch op. Each arm queues --calls launches of a small problem (a 512 x 512 bf16 matrix: the GPU's work a call
is below the host's, so the queue never fills) and the figure is the host's microseconds a call (the loop's wall
time, before the synchronize), the median over rounds with the range.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from waste import triton_launch  # noqa: E402
from waste.layers import decode_triton  # noqa: E402
from waste.layers.norm import rms_norm  # noqa: E402
from waste.quant import gemv_triton  # noqa: E402


def host_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(1, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(512, 512, device=dev, dtype=torch.bfloat16)
    nw = torch.ones(512, device=dev)
    h = torch.randn(1, 512, device=dev, dtype=torch.bfloat16)

    def fast(on):
        def set_():
            triton_launch.ENABLED = on
        return set_

    arms = {
        "torch empty+add": (None, lambda: torch.empty_like(x).add_(x)),
        "cuBLAS F.linear": (None, lambda: F.linear(x, w)),
        "gemv, triton JIT": (fast(False), lambda: gemv_triton.row(x, w)),
        "gemv, fast launch": (fast(True), lambda: gemv_triton.row(x, w)),
        "torch add + rms_norm": (None, lambda: rms_norm(h + x, nw, 1e-6).to(h.dtype)),
        "add_rms, triton JIT": (fast(False), lambda: decode_triton.add_rms(h, x, nw, 1e-6)),
        "add_rms, fast launch": (fast(True), lambda: decode_triton.add_rms(h, x, nw, 1e-6)),
    }
    assert torch.equal(gemv_triton.row(x, w), (fast(False)(), gemv_triton.row(x, w))[1])
    res = {k: [] for k in arms}
    for r in range(a.rounds):
        for name, (setup, fn) in arms.items():
            if setup:
                setup()
            fn()
            res[name].append(host_us(fn, a.calls))
        triton_launch.ENABLED = True
    for name, v in res.items():
        print(f"{name:24s} {statistics.median(v):6.2f} us a call on the host ({min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
