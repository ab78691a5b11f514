"""One MoE layer's routed experts at one row on a GPU, per format and kernel, against the HBM bound.

    python benchmarks/gpu_experts.py [--hidden 2048] [--inter 768] [--experts 128] [--top-k 8] [--formats bf16,q8,q4]

A slab of `--experts` random records of the Qwen3-30B-A3B expert shape (random bytes: speed does not depend on the
values) in GPU memory; each call computes top_k pairs (distinct random slots each call, drawn ahead) of one row.
Kernels: `gather` (layers/moe.py's torch gather + bmm, float and q8 only) and `triton` (layers/moe_triton.py, slots
read in place) at a few tile shapes. Prints microseconds per call (median of CUDA-event timings over many calls,
each call's inputs different) and GB/s of the records' bytes, beside the HBM copy rate measured here.
Not a test; docs/LEARNED.md §10 has the figures.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from waste.container.bank import _DTYPES  # noqa: E402
from waste.convert.convert import expert_layout  # noqa: E402
from waste.layers import moe, moe_triton  # noqa: E402
from waste.layers.moe import MATRICES, Bank  # noqa: E402
from waste.quant.formats import get_format  # noqa: E402


def random_bank(fmt_name: str, h: int, inter: int, n: int, device: str = "cuda") -> tuple[Bank, int]:
    layout = expert_layout(fmt_name, {"hidden_size": h, "moe": {"intermediate_size": inter}})
    rows = torch.randint(0, 256, (n, layout.record_bytes), dtype=torch.uint8, device=device)
    bank = bank_views(rows, fmt_name, h, inter)
    for m in MATRICES:
        for t in bank.parts[m].values():
            if t.is_floating_point():          # finite values where the format keeps floats (bf16 weights, scales)
                t.copy_(torch.randn(t.shape, device=device) * 0.02)
    return bank, layout.payload_bytes


def bank_views(rows: torch.Tensor, fmt_name: str, h: int, inter: int) -> Bank:
    """A Bank of [slots, ...] views over rows [slots, record_bytes] in the format's record layout."""
    layout = expert_layout(fmt_name, {"hidden_size": h, "moe": {"intermediate_size": inter}})
    n = rows.shape[0]
    parts = {m: {} for m in MATRICES}
    for p in layout.parts:
        m, _, suffix = p.name.partition(".")
        parts[m][suffix] = rows[:, p.offset:p.offset + p.nbytes].view(_DTYPES[p.dtype]).view(n, *p.shape)
    shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    return Bank(parts, shapes, get_format(fmt_name))


def hbm_rate() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / time_calls(lambda i: b.copy_(a), 10)


def time_calls(fn, n: int) -> float:
    for i in range(3):
        fn(i)
    ts = []
    for i in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(i)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts)


def graphed(fn, n: int) -> float:
    """Seconds per call of fn(i), i < n, all captured in one CUDA graph: launch overhead excluded, each call's
    slots different (a 128-expert slab is several times the 60 MB L2)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    return time_calls(lambda i: g.replay(), 5) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--formats", default="bf16,q8,q4,mxfp4")
    ap.add_argument("-n", type=int, default=200)
    a = ap.parse_args()
    rate = hbm_rate()
    print(f"{torch.cuda.get_device_name()}: HBM copy {rate / 1e9:.0f} GB/s; hidden {a.hidden}, inter {a.inter}, "
          f"{a.experts} experts, top {a.top_k}, one row", flush=True)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([torch.randperm(a.experts, generator=g)[:a.top_k] for _ in range(a.n + 3)]).cuda()
    for fmt in a.formats.split(","):
        bank, rec = random_bank(fmt, a.hidden, a.inter, a.experts)
        dt = torch.float32 if fmt == "q8" else torch.bfloat16     # gather_q8 takes float32 rows only
        x = torch.randn(1, a.hidden, device="cuda", dtype=dt)
        nbytes = a.top_k * rec
        arms = []
        if fmt in ("bf16", "q8"):
            arms.append(("gather", (moe.gather_float if fmt == "bf16" else moe.gather_q8), {}))
        arms.append(("triton (default tiles)", moe_triton.pairs, {}))
        if fmt == "q4":      # (random bytes: the GPU's row layout times the same whatever the nibbles mean)
            for bn, w in ((4, 2), (8, 4), (16, 4), (16, 8)):
                arms.append((f"triton bn{bn} w{w}", moe_triton.pairs, dict(bn=bn, warps=w)))
        else:
            for bn, bk, w in ((8, 256, 4), (16, 128, 4), (32, 256, 8)):
                arms.append((f"triton bn{bn} bk{bk} w{w}", moe_triton.pairs, dict(bn=bn, bk=bk, warps=w)))
        for name, fn, kw in arms:
            try:
                t = time_calls(lambda i: fn(x, draws[i].view(1, -1), bank, **kw), a.n)
            except Exception as exc:     # a tile shape a format cannot take: say so, go on
                print(f"  {fmt:6s} {name:26s} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            tg = graphed(lambda i: fn(x, draws[i].view(1, -1), bank, **kw), a.n)
            print(f"  {fmt:6s} {name:26s} {t * 1e6:8.1f} us  {nbytes / t / 1e9:7.0f} GB/s "
                  f"({nbytes / t / rate * 100:4.1f}% of HBM; {nbytes / 1e6:.1f} MB); in a CUDA graph "
                  f"{tg * 1e6:6.1f} us, {nbytes / tg / rate * 100:4.1f}% of HBM", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
