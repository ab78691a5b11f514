"""Decode on GPUs, one process against expert parallel, on `random:` models generated in place (no disk):

    python benchmarks/expert_parallel_gpu.py SPEC [-n 32] [--repeat 3] [--prompt-len 32]              # one GPU
    torchrun --nproc-per-node 2 benchmarks/expert_parallel_gpu.py SPEC ...                            # NCCL, a GPU each

e.g. SPEC = random:qwen3-30b-a3b,experts=q4 or random:kimi-k3,experts=mxfp4,layers=8. Loads once (the seconds the
generation takes are printed), then `--repeat` times: a prompt of seeded random tokens, then -n decode steps fed
seeded random tokens (the model's own greedy output repeats on random weights), bf16 compute, every expert
resident. Prints per repeat decode tok/s and, under expert parallel, the MoE-layer exchange per layer and token
(rows out, the owners' compute, pairs back) and the part of it spent inside the all-to-alls; then medians and
ranges. Beside them: the HBM bound (the bytes a token must read on the busiest GPU: its trunk less the embeddings
plus its share of top_k records per MoE layer, over a 2 GiB device copy's rate measured here) and, under torchrun,
NCCL all_to_all_single's rate at a few sizes measured in the same run (what leaves each rank / time). Rank 0
prints one JSON line last. Nothing here is a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from waste.engine import Engine  # noqa: E402

SIZES = (64 << 10, 1 << 20, 16 << 20, 256 << 20)      # bytes per rank for the all-to-all figure


def events_median(fn, iters: int = 10) -> float:
    times = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def hbm_rate() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    rate = 2 * a.numel() / events_median(lambda: b.copy_(a))
    a = b = None
    torch.cuda.empty_cache()      # the model may need every byte
    return rate


def all_to_all_rates(world: int) -> dict[str, float]:
    out = {}
    for size in SIZES:
        n = size // world * world
        x, y = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8,
                                                                                            device="cuda")
        for _ in range(3):
            dist.all_to_all_single(y, x)
        t = events_median(lambda: dist.all_to_all_single(y, x), 20)
        out[str(size)] = {"seconds": t, "gb_per_s": n * (world - 1) / world / t / 1e9}
    return out


def trunk_tensors(m) -> list[torch.Tensor]:
    """Every trunk tensor the model holds once (per-layer weight dicts such as `layers` and a family's `attn_w`, whose
    fused q/k/v is a tensor of its own), by storage, less the embedding table (a token reads one row of it)."""
    seen, out = {m.embed.data_ptr()} if m.head is not m.embed else set(), []
    for v in vars(m).values():
        if not (isinstance(v, list) and v and all(isinstance(d, dict) for d in v)):
            continue
        for d in v:
            for t in d.values():
                if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    out.append(t)
    return out


def token_bytes(eng, world: int) -> int:
    """Bytes one decode token reads on the busiest GPU: the trunk less the embedding rows it does not read, and its
    share of top_k records in every MoE layer."""
    m = eng.model
    trunk = sum(t.numel() * t.element_size() for t in trunk_tensors(m))
    trunk += m.head.numel() * m.head.element_size() + m.norm.numel() * m.norm.element_size()
    moe = [l for l in range(len(m.layers)) if not m.dense[l]]
    rec = eng.experts.record_bytes
    return trunk + len(moe) * -(-m.top_k // world) * rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu runs the same steps with gloo (a check)")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep, t0 = None, time.perf_counter()
    if world > 1:
        from waste.runtime.parallel import ExpertParallel

        ep = ExpertParallel.start(os.environ, world, device=a.device,
                                   report=lambda m: print(m, file=sys.stderr, flush=True))
    rank = ep.rank if ep else 0
    say = lambda what: print(f"rank {rank} at {time.perf_counter() - t0:.1f} s: {what}", file=sys.stderr,  # noqa: E731
                             flush=True)      # progress: a run cut at its limit says where it was
    say(f"started ({world} process(es))")
    a2a = all_to_all_rates(world) if ep and cuda else None
    if a2a:
        say("all-to-all rates: " + ", ".join(f"{int(k) >> 10} KiB {v['gb_per_s']:.1f} GB/s" for k, v in a2a.items()))
    hbm = hbm_rate() if cuda else 1e9
    t1 = time.perf_counter()
    load = lambda: Engine.load(a.spec, dtype="bfloat16", device=a.device, expert_parallel=ep)  # noqa: E731
    eng = ep.load(load) if ep else load()
    sync()
    load_s = time.perf_counter() - t1
    say(f"loaded in {load_s:.1f} s")
    try:
        if rank != 0:
            eng.experts.follow()
            return
        m, g = eng.model, torch.Generator().manual_seed(0)
        v = m.embed.shape[0]
        runs = []
        for r in range(a.repeat + 1):         # the first is a warm-up (triton compiles, graphs capture)
            ids = torch.randint(3, v, (a.prompt_len + a.n,), generator=g).tolist()
            state = m.new_state()
            m.forward(torch.tensor(ids[:a.prompt_len]), state, 0, last_only=True)
            sync()
            say(f"{'warm-up' if not r else f'repeat {r}'}: prefill done")
            c0 = eng.experts.report() if ep else None
            t = time.perf_counter()
            for i in range(a.n):
                m.forward(torch.tensor([ids[a.prompt_len + i]]), state, a.prompt_len + i, last_only=True)
            sync()
            dt = time.perf_counter() - t
            run = {"tok_per_s": a.n / dt, "ms_per_token": dt / a.n * 1e3}
            if ep:
                c1 = eng.experts.report()
                rounds = c1["rounds"] - c0["rounds"]
                run.update(exchange_us_per_layer=(c1["exchange_seconds"] - c0["exchange_seconds"]) / rounds * 1e6,
                           comm_us_per_layer=(c1["comm_seconds"] - c0["comm_seconds"]) / rounds * 1e6,
                           bytes_sent_per_layer=(c1["bytes_sent"] - c0["bytes_sent"]) / rounds, rounds=rounds)
            if r:
                runs.append(run)
            say(f"{'warm-up' if not r else f'repeat {r}'}: " + ", ".join(f"{k} {v:.1f}" for k, v in run.items()))
        tb = token_bytes(eng, world)
        summary = {k: {"median": statistics.median(x[k] for x in runs), "min": min(x[k] for x in runs),
                       "max": max(x[k] for x in runs)} for k in runs[0]}
        out = {"spec": a.spec, "gpus": world, "load_seconds": load_s, "n": a.n, "prompt_len": a.prompt_len,
               "repeats": a.repeat, "hbm_gb_per_s": hbm / 1e9, "token_bytes": tb, "hbm_bound_tok_per_s": hbm / tb,
               "gpu_gib_used": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "all_to_all": a2a, **summary}
        print(f"{a.spec} on {world} GPU(s): decode {summary['tok_per_s']['median']:.1f} tok/s "
              f"({summary['tok_per_s']['min']:.1f}-{summary['tok_per_s']['max']:.1f}); HBM bound "
              f"{hbm / tb:.0f} tok/s ({tb / 1e6:.0f} MB a token at {hbm / 1e9:.0f} GB/s); loaded in {load_s:.0f} s")
        print("RESULT " + json.dumps(out), flush=True)
    finally:
        if ep and rank == 0:
            eng.experts.stop()
        eng.close()
        if ep:
            ep.close()


if __name__ == "__main__":
    main()
