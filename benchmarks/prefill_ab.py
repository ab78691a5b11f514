"""A 128-token prefill of a resident q4 container in one process, with the prefill paths of docs/LEARNED.md §10c
switched between prefills (arms interleaved, ROUNDS rounds, median and range, ms): torch's int4 kernel for experts and
trunk (as before), the grouped numba experts (layers/cpu_prefill.py, forced on whatever the record size), and the
trunk unpacked into sgemm (quant/q4_rows.py linear_rows) with either expert path. The prompt is peers.py's text
tokenized by the container's tokenizer.

    python benchmarks/prefill_ab.py CONTAINER [ROUNDS] [THREADS]
"""
import statistics
import sys
import time

import torch

from waste.engine import Engine
from waste.layers.cpu_prefill import GroupedRows
from waste.quant import int4pack, q4_rows

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from peers import BENCH_TEXT  # noqa: E402

rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
eng = Engine.load(sys.argv[1], preload=True)
eng.experts.wait_fill()
m = eng.model
ids = []
while len(ids) < 128:
    ids += eng.encode(BENCH_TEXT)
ids = torch.tensor(ids[:128])


def int4_rows(x, parts, shape):          # the path before: torch's int4 kernel, x rounded to bf16
    return int4pack.int4_mm(x, parts["q"], shape[1] // parts["sz"].shape[0], parts["sz"])


grouped, unpacked = GroupedRows(m.bank), q4_rows.linear_rows
arms = {"int4 experts + int4 trunk (before)": (None, int4_rows), "grouped experts + int4 trunk": (grouped, int4_rows),
        "int4 experts + unpacked trunk": (None, unpacked), "grouped experts + unpacked trunk": (grouped, unpacked)}


def prefill() -> float:
    st = m.new_state()
    with torch.inference_mode():
        t = time.perf_counter()
        m.forward(ids, st, 0, last_only=True)
        return (time.perf_counter() - t) * 1e3


ts = {a: [] for a in arms}
for a in list(arms) * 2:                 # warm-up: kernels, allocator
    m.bank._rows_kernel, q4_rows.linear_rows = arms[a]
    prefill()
for _ in range(rounds):
    for a in arms:
        m.bank._rows_kernel, q4_rows.linear_rows = arms[a]
        ts[a].append(prefill())
for a, v in ts.items():
    med = statistics.median(v)
    print(f"{a:<36} {med:8.2f} ms ({min(v):.2f}-{max(v):.2f})  {128 / med * 1e3:7.0f} tok/s")
