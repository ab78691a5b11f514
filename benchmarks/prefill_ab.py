"""A 128-token prefill of a resident q4 container in one process, with the CPU prefill paths switched between
prefills (arms interleaved, ROUNDS rounds, median and range, ms): torch's int4 kernel for experts and trunk; the float
paths of docs/LEARNED.md §10c (the grouped float-tile experts where the records are small enough, else torch's int4
kernel, and the trunk unpacked into sgemm); and the int8 rows by VNNI for both (quant/q4_vnni.py, §10f; where the
host has AVX-512 VNNI). The prompt is peers.py's text tokenized by the container's tokenizer.

    python benchmarks/prefill_ab.py CONTAINER [ROUNDS] [THREADS]
"""
import statistics
import sys
import time

import torch

from waste.engine import Engine
from waste.layers import cpu_prefill
from waste.quant import int4pack, q4_rows, q4_vnni

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
vnni = q4_vnni.available()


def int4_rows(x, parts, shape):          # torch's int4 kernel, x rounded to bf16
    return int4pack.int4_mm(x, parts["q"], shape[1] // parts["sz"].shape[0], parts["sz"])


def grouped(fn):
    g = cpu_prefill.GroupedRows(m.bank)
    g.fn = fn
    return g


(N, K) = m.bank.shapes["gate"]
small = N * K <= cpu_prefill.MAX_WEIGHTS
# arm: (the bank's prefill kernel, the trunk's many-row q4 path, whether Q4.linear takes the VNNI rows)
arms = {"int4 experts + int4 trunk": (None, int4_rows, False),
        "float paths (section 10c)": (grouped(cpu_prefill.pairs_q4_rows) if small else None, q4_rows.linear_rows,
                                      False)}
if vnni:
    arms["int8 VNNI experts + trunk"] = (grouped(cpu_prefill.pairs_q4_i8), q4_rows.linear_rows, True)
    arms["int8 VNNI experts, float trunk"] = (grouped(cpu_prefill.pairs_q4_i8), q4_rows.linear_rows, False)
    arms["float experts, int8 VNNI trunk"] = (arms["float paths (section 10c)"][0], q4_rows.linear_rows, True)


def use(arm):
    m.bank._rows_kernel, q4_rows.linear_rows, v = arms[arm]
    q4_vnni.available = (lambda: True) if v else (lambda: False)


def prefill() -> float:
    st = m.new_state()
    with torch.inference_mode():
        t = time.perf_counter()
        m.forward(ids, st, 0, last_only=True)
        return (time.perf_counter() - t) * 1e3


ts = {a: [] for a in arms}
for a in list(arms) * 2:                 # warm-up: kernels, allocator
    use(a)
    prefill()
for _ in range(rounds):
    for a in arms:
        use(a)
        ts[a].append(prefill())
for a, v in ts.items():
    med = statistics.median(v)
    print(f"{a:<36} {med:8.2f} ms ({min(v):.2f}-{max(v):.2f})  {128 / med * 1e3:7.0f} tok/s")
