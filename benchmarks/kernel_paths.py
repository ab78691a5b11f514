"""The small timings behind the kernel-path choices of docs/LEARNED.md §3d, §5b and §7a, one 768 x 2048 matrix
(Qwen3-30B-A3B's expert shape) at a time, cache-hot, medians of 20 calls, 2 torch threads.

    OPENBLAS_NUM_THREADS=1 python benchmarks/kernel_paths.py
    ATEN_CPU_CAPABILITY=avx2 OPENBLAS_NUM_THREADS=1 python benchmarks/kernel_paths.py     # torch's AVX2 kernels

1. torch's int4 and int8 kernels with float32 against bfloat16 activations, T = 1 and 64;
2. q8 with float32 x: its matrix unpacked to float32 + F.linear against the float32 int8 kernel;
3. q4 repacked for the kernel at every call (what the expert path did off AVX-512) against once, with the repack
   itself: the 64 -> 32-row reshuffle (AVX2's layout) and torch's own packer;
4. q4's per-group search: the numba kernel (quant/q4fit.py) against the same search as torch ops
   (benchmarks/quant_calibrated.py fit_groups, unweighted);
5. rms_norm: waste's eight ops against torch's F.rms_norm on one decode row.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from waste.layers.norm import rms_norm  # noqa: E402
from waste.quant import int4pack, intq  # noqa: E402
from waste.quant.formats import get_format  # noqa: E402
from waste.quant.q4fit import fit_groups  # noqa: E402

N, K = 768, 2048


def us(fn, n: int = 20) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def main() -> None:
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, kernels {torch.backends.cpu.get_cpu_capability()}, int4 operand block "
          f"{int4pack.kernel_block()} (stored: {int4pack.BLOCK})")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    q4, q8 = get_format("q4"), get_format("q8")
    p4 = q4.prepare(q4.pack(w), (N, K))
    p8 = q8.pack(w)
    for T in (1, 64):
        x = torch.randn(T, K, generator=g)
        sz = p4["sz"]
        f4 = us(lambda: torch._weight_int4pack_mm_for_cpu(x, p4["q"], 64, sz.float()))
        b4 = us(lambda: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), p4["q"], 64, sz))
        f8 = us(lambda: torch._weight_int8pack_mm(x, p8["q"], p8["scale"]))
        b8 = us(lambda: torch._weight_int8pack_mm(x.bfloat16(), p8["q"], p8["scale"].bfloat16()))
        print(f"1. T={T}: int4 kernel float32 x {f4:.0f} us, bf16 x {b4:.0f} us; int8 kernel float32 x {f8:.0f} us, "
              f"bf16 x {b8:.0f} us")
        un = us(lambda: F.linear(x, q8.unpack(p8, (N, K), torch.float32)))
        print(f"2. T={T}: q8 float32 x: unpack + F.linear {un:.0f} us (float32 kernel above: {f8:.0f} us)")
    x = torch.randn(1, K, generator=g).bfloat16()
    stored = q4.pack(w)
    every = us(lambda: q4.linear(x, q4.prepare(stored, (N, K)), (N, K)))
    once = us(lambda: q4.linear(x, p4, (N, K)))
    shuffle = us(lambda: int4pack.pack_nibbles(int4pack.unpack_nibbles(stored["q"], N, K), 32))
    theirs = us(lambda: torch._convert_weight_to_int4pack_for_cpu(
        int4pack.unpack_nibbles(stored["q"], N, K).to(torch.int32).contiguous(), 2))
    print(f"3. q4 at T=1: prepared at every call {every:.0f} us, once {once:.0f} us; reshuffle into 32-row blocks "
          f"{shuffle:.0f} us, torch's packer (with our unpack) {theirs:.0f} us")
    from quant_calibrated import fit_groups as torch_search
    torch.set_num_threads(1)
    xg = w.view(N, K // 64, 64)
    nb = us(lambda: fit_groups(xg, intq.Q4_SHRINK, intq.Q4_REFITS), 5)
    ts = us(lambda: torch_search(xg, None), 5)
    print(f"4. q4 search, one thread: numba {nb / 1e3:.1f} ms, torch ops {ts / 1e3:.1f} ms")
    torch.set_num_threads(2)
    r, nw = torch.randn(1, 320, generator=g), torch.randn(320, generator=g)
    ours = us(lambda: rms_norm(r.double().float(), nw, 1e-6), 200)
    print(f"5. rms_norm of one 320-wide row: F.rms_norm (waste's path for float32) {us(lambda: F.rms_norm(r, (320,), nw, 1e-6), 200):.1f} us, "
          f"the eight ops (its bf16 path, run in float32) {us(lambda: _eight_ops(r, nw), 200):.1f} us ({ours:.1f} us through rms_norm)")


def _eight_ops(x, weight, eps=1e-6):
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


if __name__ == "__main__":
    main()
