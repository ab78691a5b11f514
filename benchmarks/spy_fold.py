"""Fold a `py-spy record --idle -f raw` profile into inclusive shares per function, for the samples whose stack holds
a frame matching --under (default: disk_tier_timeline.py's timed steps), on the thread that runs it.

    py-spy record --idle -r 1000 -f raw -o spy.txt -- python benchmarks/disk_tier_timeline.py ...
    python benchmarks/spy_fold.py spy.txt [--under timed_step] [--top 45]

Each function's share counts a sample once however deep it recurs; `(self)` lines are leaf frames. Not a test.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--under", default="timed_step")
    ap.add_argument("--top", type=int, default=45)
    a = ap.parse_args()
    under, incl, leaf, total = re.compile(a.under), Counter(), Counter(), 0
    for line in open(a.raw):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        hit = next((k for k, f in enumerate(frames) if under.search(f)), None)
        if hit is None:
            continue
        n = int(n)
        total += n
        names = [re.sub(r":\d+\)$", ")", f) for f in frames[hit:]]     # a function, not a line
        for f in set(names):
            incl[f] += n
        leaf[names[-1] + " (self)"] += n
    print(f"{total} samples under {a.under!r}")
    for f, n in (incl + leaf).most_common(a.top):
        print(f"{100 * n / total:6.1f}%  {f}")


if __name__ == "__main__":
    main()
