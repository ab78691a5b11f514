"""A 128-token prefill (peers.py's text) of a resident container in one compute dtype, ms, median of 5 after 2
(docs/LEARNED.md §10f: run with the tree before a change and after it in turn, PYTHONPATH=TREE).

    python benchmarks/prefill_dtype.py CONTAINER bfloat16|float32
"""
import statistics
import sys
import time

import torch

from waste.engine import Engine

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from peers import BENCH_TEXT  # noqa: E402

torch.set_num_threads(2)
eng = Engine.load(sys.argv[1], dtype=sys.argv[2], preload=True)
eng.experts.wait_fill()
m = eng.model
ids = []
while len(ids) < 128:
    ids += eng.encode(BENCH_TEXT)
ids = torch.tensor(ids[:128])


def prefill() -> float:
    st = m.new_state()
    with torch.inference_mode():
        t = time.perf_counter()
        m.forward(ids, st, 0, last_only=True)
        return (time.perf_counter() - t) * 1e3


prefill()
prefill()
v = [prefill() for _ in range(5)]
print(f"{sys.argv[1]} {sys.argv[2]}: prefill {statistics.median(v):.1f} ms ({min(v):.1f}-{max(v):.1f})")
