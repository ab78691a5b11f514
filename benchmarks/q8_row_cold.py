"""A 30B-shaped layer's q8 q/k/v and o projections, one decode row each, from memory (26 layers cycled: more than
the caches hold), ms a layer, median of 3 rounds: the q8 row kernel before VNNI against the VNNI one
(quant/q8_numba.py; docs/LEARNED.md §10f).

    python benchmarks/q8_row_cold.py [THREADS]
"""
import statistics
import sys
import time

import numpy as np
import torch

from waste.numba_ptr import follow_torch_threads
from waste.quant import q8_numba

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from trunk_rows import layers  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
follow_torch_threads()
ls = layers("q8")
x, x2 = torch.randn(1, 2048), torch.randn(1, 4096)


def run(layer, f):
    qkv, o = layer
    for w, xx in [(m, x) for m in qkv] + [(o, x2)]:
        N, K = w.shape
        f(xx.data_ptr(), w.parts["q"].data_ptr(), w.parts["scale"].data_ptr(), N, K, np.empty(N, np.float32))


arms = {"before VNNI": q8_numba.q8_row, "VNNI": q8_numba.q8_row_vnni}
for f in arms.values():
    for layer in ls[:2]:
        run(layer, f)
ts = {k: [] for k in arms}
for _ in range(3):
    for k, f in arms.items():
        for layer in ls:
            t = time.perf_counter()
            run(layer, f)
            ts[k].append(time.perf_counter() - t)
print(", ".join(f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in ts.items()), "ms a layer (19 MB of q8), cold")
