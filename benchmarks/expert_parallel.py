"""The cost of expert parallel's exchange alone, under torchrun: per MoE layer, one all-to-all of sizes, one of the
routed rows and one of the pair outputs back (runtime/parallel.py), with no expert compute; and the all-to-all's
bandwidth on a large buffer (the link's figure to hold the rows' bytes against).

    torchrun --nproc-per-node 2 benchmarks/expert_parallel.py                      # gloo, CPU processes
    torchrun --nproc-per-node 2 benchmarks/expert_parallel.py --device cuda        # NCCL, one GPU per process
    torchrun --nproc-per-node 2 benchmarks/expert_parallel.py --hidden 7168 --top-k 8 --rows 1   # K3-wide rows

Also, first: a check that an all-to-all with zero-size splits (a rank with no rows for another, or none at all)
completes and moves the right bytes, as the runtime's exchanges need; and the exchange as the runtime makes it (each
all-to-all's input copied from the host and its output back, the host waiting on it) beside the device-only one.

Rows: decode sends each token's row to every rank owning one of its k experts and gets k outputs back; here every
row goes to every rank and each rank returns k / world pairs per row (uniform routing). Nothing here is a test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, iters: int, sync) -> list[float]:
    out = []
    for _ in range(iters):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=2048, help="the experts' width (Qwen3-30B 2048; K3's latent: its "
                    "routed_expert_hidden_size)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1, help="rows per MoE layer (1: a decode step of one sequence)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--big", default="64", help="MiB per rank for the bandwidth figure")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    t0 = time.perf_counter()
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}: process group up in {time.perf_counter() - t0:.1f} s", flush=True)
    zero_splits(rank, world, dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dt = getattr(torch, a.dtype)
    esz = torch.empty(0, dtype=dt).element_size()
    row_bytes = a.rows * (a.hidden * esz + 8 * a.top_k) + 8 * 6          # rows + their ids + the meta
    back_bytes = a.rows * max(a.top_k // world, 1) * a.hidden * esz
    hdr, hdr_out = torch.zeros(world, 2, dtype=torch.long, device=dev), torch.empty(world, 2, dtype=torch.long, device=dev)
    send, recv = (torch.zeros(world * row_bytes, dtype=torch.uint8, device=dev) for _ in range(2))
    bsend, brecv = (torch.zeros(world * back_bytes, dtype=torch.uint8, device=dev) for _ in range(2))

    def round_():
        dist.all_to_all_single(hdr_out, hdr)
        dist.all_to_all_single(recv, send)
        dist.all_to_all_single(brecv, bsend)

    hosts = [t.cpu() for t in (hdr, send, bsend)]

    def round_host():           # as the runtime: host -> device, all-to-all, device -> host (the wait), three times
        for h, out in zip(hosts, (hdr_out, recv, brecv)):
            dist.all_to_all_single(out, h.to(dev))
            out.cpu()

    for _ in range(10):
        round_()
        round_host()
    t = timed(round_, a.iters, sync)
    th = timed(round_host, a.iters, sync)
    big = int(float(a.big) * (1 << 20)) // world * world
    x, y = torch.zeros(big, dtype=torch.uint8, device=dev), torch.empty(big, dtype=torch.uint8, device=dev)
    for _ in range(3):
        dist.all_to_all_single(y, x)
    tb = timed(lambda: dist.all_to_all_single(y, x), 10, sync)
    if rank == 0:
        moved = big * (world - 1) / world      # what leaves each rank
        print(f"{world} ranks, {'NCCL' if cuda else 'gloo'}; a MoE layer's exchange ({a.rows} row(s) of {a.hidden} "
              f"{a.dtype}, top-{a.top_k}: {row_bytes * world} B out, {back_bytes * world} B back per rank): median "
              f"{statistics.median(t) * 1e6:.0f} us, min {min(t) * 1e6:.0f} us over {a.iters}; with the host copies "
              f"and waits as the runtime makes them: median {statistics.median(th) * 1e6:.0f} us, min "
              f"{min(th) * 1e6:.0f} us")
        print(f"all-to-all of {big >> 20} MiB per rank: median {statistics.median(tb) * 1e3:.2f} ms = "
              f"{moved / statistics.median(tb) / 1e9:.2f} GB/s out of each rank")
    dist.destroy_process_group()


def zero_splits(rank: int, world: int, dev) -> None:
    """Rank r sends r + 1 bytes of value r to each higher rank and nothing to itself or a lower one (rank world - 1
    sends nothing at all): every rank must get exactly the bytes meant for it."""
    sizes_out = [rank + 1 if d > rank else 0 for d in range(world)]
    sizes_in = [s + 1 if rank > s else 0 for s in range(world)]
    out = torch.full((sum(sizes_in),), 255, dtype=torch.uint8, device=dev)
    dist.all_to_all_single(out, torch.full((sum(sizes_out),), rank, dtype=torch.uint8, device=dev), sizes_in,
                           sizes_out)
    want = torch.cat([torch.full((n,), s, dtype=torch.uint8) for s, n in enumerate(sizes_in)])
    assert torch.equal(out.cpu(), want), (rank, out.cpu().tolist())
    print(f"rank {rank}: zero-size splits ok (got {sum(sizes_in)} bytes)", flush=True)


if __name__ == "__main__":
    main()
