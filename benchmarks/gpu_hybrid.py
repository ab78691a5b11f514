"""Issue 14 item 2's two arms for experts that miss the VRAM tier, one layer's k missed records at one decode row:

    python benchmarks/gpu_hybrid.py [--formats q4,bf16] [--ks 1,2,4,8] [-n 40]

- copy: the k records go up from the pinned host slab on a copy stream (one cudaMemcpyAsync each), the compute
  stream waits on their event, then the GPU kernel (layers/moe_triton.py) computes the k pairs;
- cpu: the row comes down, the host computes the k pairs from the pinned slab with layers/moe_cpu.py's numba kernel
  (one call, one thread: the kernels hold the GIL), the weighted row goes back up.
Host wall time per layer (perf_counter around each, the GPU synchronised), median of -n calls, arms interleaved,
each call on k distinct random records of a 128-record slab (beyond the L2 / the host's caches). The cost model a
per-layer choice would use: copy = a + k * record / link, cpu = b + k * c, fitted from these. Not a test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpu_experts import bank_views, random_bank  # noqa: E402
from waste.convert.convert import expert_layout  # noqa: E402
from waste.layers import moe_cpu, moe_triton  # noqa: E402
from waste.layers.moe import layout_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--formats", default="q4,bf16")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("-n", type=int, default=40)
    a = ap.parse_args()
    h, inter = a.hidden, a.inter
    g = torch.Generator().manual_seed(0)
    copy = torch.cuda.Stream()
    for fmt in a.formats.split(","):
        host, _ = random_bank(fmt, h, inter, a.experts, device="cpu")
        rows = host.parts["gate"][next(iter(host.parts["gate"]))].untyped_storage()
        rec = rows.nbytes() // a.experts
        slab = torch.empty(0, dtype=torch.uint8).set_(rows, 0, (a.experts * rec,)).view(a.experts, rec)
        slab = slab.pin_memory()                       # the pinned host tier (a copy, pinned)
        host = bank_views(slab, fmt, h, inter)
        tier = torch.empty(max(map(int, a.ks.split(","))), rec, dtype=torch.uint8, device="cuda")
        dev = bank_views(tier, fmt, h, inter)
        shape = {"hidden_size": h, "moe": {"intermediate_size": inter}}
        rewrite = layout_for(dev.fmt, "cuda", expert_layout(fmt, shape))
        cpu_kernel = moe_cpu.NumbaPairs(host)
        x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
        print(f"{fmt}: record {rec / 1e6:.2f} MB, hidden {h}, inter {inter}", flush=True)
        for k in map(int, a.ks.split(",")):
            w = torch.full((1, k), 1.0 / k, device="cuda")
            dslots = torch.arange(k, device="cuda").view(1, k)

            def arm_copy(sel):
                with torch.cuda.stream(copy):
                    for j, s in enumerate(sel):
                        tier[j].copy_(slab[s], non_blocking=True)
                    if rewrite is not None:         # q4: into the GPU's row layout, as the store's tier does
                        rewrite(tier, range(len(sel)))
                    ev = torch.cuda.Event()
                    ev.record()
                torch.cuda.current_stream().wait_event(ev)
                y = moe_triton.pairs(x, dslots, dev)
                return (y.float() * w.unsqueeze(-1)).sum(1)

            def arm_link(sel):
                with torch.cuda.stream(copy):
                    for j, s in enumerate(sel):
                        tier[j].copy_(slab[s], non_blocking=True)
                copy.synchronize()

            def arm_cpu(sel):
                xh = x.float().cpu()
                y = cpu_kernel(xh, torch.tensor([sel], dtype=torch.int64))
                return moe_cpu.weighted_row(y, torch.full((1, k), 1.0 / k)).to("cuda", non_blocking=True)

            times = {"copy": [], "cpu": [], "link only": []}
            for i in range(a.n + 3):
                sel = torch.randperm(a.experts, generator=g)[:k].tolist()
                for name, fn in (("copy", arm_copy), ("cpu", arm_cpu), ("link only", arm_link)):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    fn(sel)
                    torch.cuda.synchronize()
                    if i >= 3:
                        times[name].append(time.perf_counter() - t)
            med = {n: statistics.median(v) for n, v in times.items()}
            print(f"  k={k}: copy + GPU {med['copy'] * 1e6:7.1f} us ({min(times['copy']) * 1e6:.0f}-"
                  f"{max(times['copy']) * 1e6:.0f}); host cores {med['cpu'] * 1e6:7.1f} us "
                  f"({min(times['cpu']) * 1e6:.0f}-{max(times['cpu']) * 1e6:.0f}); the copies alone "
                  f"{med['link only'] * 1e6:6.1f} us = {k * rec / med['link only'] / 1e9:.1f} GB/s; cheaper: "
                  f"{'copy' if med['copy'] <= med['cpu'] else 'cpu'}", flush=True)


if __name__ == "__main__":
    main()
