"""Run by tests/test_expert_parallel.py, both under torchrun (`--expert-parallel`: rank 0 writes what it computed)
and in one process (the reference): the same forwards of each container, saved to OUT/NAME.pt.

usage: python ep_worker.py OUT [--device cuda] [--expert-parallel N [--weights W0,W1..]] NAME=CONTAINER[@BUDGET][+PLACEMENT] ...
(on GPUs: `torchrun --nproc-per-node 2 tests/ep_worker.py OUT --device cuda --expert-parallel 2 ...` against
`python tests/ep_worker.py OUT1 --device cuda ...`: NCCL, one GPU per process)
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from waste.engine import Engine
from waste.quant.quality import greedy


def outputs(eng) -> dict[str, torch.Tensor]:
    m = eng.model
    v = m.embed.shape[0]
    ids = torch.randint(3, v, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    out = {"prefill": m.forward(torch.tensor(ids), m.new_state(), 0)}          # [T, V]: one row per token
    out["greedy"] = torch.tensor(greedy(eng, ids[:6], 10))                     # prefill, then one row per step
    # two sequences in one step (their rows batched into one exchange), then a decode step of both
    a, b = m.new_state(), m.new_state()
    first = m.step([(torch.tensor(ids[:7]), a, 0), (torch.tensor(ids[7:10]), b, 0)], last_only=False)
    nxt = m.step([(torch.tensor([ids[11]]), a, 7), (torch.tensor([ids[12]]), b, 3)])
    out.update(batch_a=first[0], batch_b=first[1], next_a=nxt[0], next_b=nxt[1])
    return out


def run_one(item: str, ep, device: str = "cpu") -> dict | None:
    """item NAME=CONTAINER[@BUDGET][+PLACEMENT]: its outputs (None on a rank other than 0, which answers rank 0's
    MoE layers until it is done)."""
    name, _, path = item.partition("=")
    path, _, placement = path.partition("+")
    path, _, budget = path.partition("@")
    if ep is not None:
        ep.placement = placement or "id"
    load = lambda: Engine.load(path, dtype="float32", budget=budget or None, preload=not budget,  # noqa: E731
                               expert_parallel=ep, device=device)
    t0 = time.perf_counter()
    eng = load() if ep is None else ep.load(load)
    rank = 0 if ep is None else ep.rank
    # progress on stderr, so that a run cut at its time limit says where it was
    print(f"ep_worker rank {rank}: {name} loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    try:
        if ep is not None and ep.rank != 0:
            eng.experts.follow()
            return None
        res = outputs(eng)
        print(f"ep_worker rank 0: {name} computed in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        res["misses"], res["evictions"] = eng.experts.stats.misses, eng.experts.stats.evictions
        res["held"] = eng.experts.n_records           # the expert records this process holds
        if ep is not None:
            eng.experts.stop()
        return res
    finally:
        eng.close()


def _error(message: str) -> None:
    print(f"waste: error: {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> None:
    out, rest, ep, device = Path(argv[0]), argv[1:], None, "cpu"
    if rest[0] == "--device":
        device, rest = rest[1], rest[2:]
    if rest[0] == "--expert-parallel":
        from waste.runtime.parallel import ExpertParallel

        ep, rest = ExpertParallel.start(os.environ, int(rest[1]), device=device, report=_error), rest[2:]
        if rest[0] == "--weights":       # each rank's share of the experts (else even, or by each rank's room)
            ep.weights, rest = [float(w) for w in rest[1].split(",")], rest[2:]
    try:
        for item in rest:
            res = run_one(item, ep, device)
            if res is not None:
                torch.save(res, out / f"{item.partition('=')[0]}.pt")
    finally:
        if ep is not None:
            ep.close()


if __name__ == "__main__":
    main(sys.argv[1:])
