"""Milliseconds per resident decode step, and where they go (docs/LEARNED.md §7a).

    python benchmarks/decode_step.py CONTAINER [--dtype auto] [--threads 2] [--profile]

Loads the container, waits for the background fill (every expert resident), prefills a short prompt, warms up 10
steps, then times 5 x 10 decode steps of the model's forward alone (no sampling, no detokenizing): prints the
median and range of the per-step time. --profile adds a cProfile of 50 more steps, by internal time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import waste  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("container")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with waste.load(a.container, dtype=a.dtype) as eng:
        eng.experts.wait_fill()
        m = eng.model
        ids = eng.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
        state = m.new_state()
        m.forward(torch.tensor(ids), state, 0)
        pos, tok = len(ids), torch.tensor([ids[-1]])

        def steps(n: int) -> None:
            nonlocal pos
            for _ in range(n):
                m.forward(tok, state, pos, last_only=True)
                pos += 1

        steps(10)
        per = []
        for _ in range(5):
            t = time.perf_counter()
            steps(10)
            per.append((time.perf_counter() - t) / 10 * 1e3)
        print(f"{a.container}: {statistics.median(per):.2f} ms per decode step (range {min(per):.2f}-{max(per):.2f}; "
              f"dtype {m.dtype}, experts {eng.container.manifest['experts']['format']}, {a.threads} threads, "
              f"context {len(ids) + 10}-{pos})")
        if a.profile:
            pr = cProfile.Profile()
            pr.enable()
            steps(50)
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
