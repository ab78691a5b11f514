"""CPU milliseconds per generated token of Engine.generate, one torch thread, for two source trees interleaved
(docs/LEARNED.md §10: the old tree against the new, on a shared machine where CPU time holds better than wall time).

    python benchmarks/decode_cpu_time.py CONTAINER TREE [TREE ...] [--rounds 2]

Each TREE is a checkout of this repository (e.g. `git worktree add /tmp/old 79c41e4`); every round runs each tree in
a fresh process: 5 generations of 65 tokens after a warm-up, `time.thread_time`, median and min per token.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r"""
import sys, time, statistics, torch
sys.path.insert(0, sys.argv[1])
import waste
torch.set_num_threads(1)
eng = waste.load(sys.argv[2]); eng.experts.wait_fill()
ids = eng.encode("def fibonacci(n):\n")
eng.generate(ids, max_tokens=8)
per = []
for _ in range(5):
    t = time.thread_time(); eng.generate(ids, max_tokens=65); per.append((time.thread_time() - t) / 65 * 1e3)
print(f"{sys.argv[1]:<24} {sys.argv[2].rsplit('/', 1)[-1]:<24} cpu ms/token median {statistics.median(per):.2f} "
      f"min {min(per):.2f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("container")
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    for _ in range(a.rounds):
        for tree in a.trees:
            subprocess.run([sys.executable, "-c", CHILD, tree, a.container], check=True)


if __name__ == "__main__":
    main()
