"""A 30B-shaped layer's q8 q/k/v and o rows through the VNNI kernel with software prefetch at other distances, one
thread, cold (26 layers cycled: 0.5 GB, more than the caches) and hot (one layer again), ms a layer, median of 5
rounds interleaved; each arm's rows checked equal to the kernel's (docs/LEARNED.md §3m).

    python benchmarks/q8_row_prefetch.py [ROWS:BYTES,...]     (default 0:0,4:0,4:512,8:0; 0:0 = no prefetch)
"""
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from waste.numba_ptr import at, follow_torch_threads  # noqa: E402
from waste.quant import q8_numba as Q  # noqa: E402
from trunk_rows import layers  # noqa: E402

torch.set_num_threads(1)
follow_torch_threads()


def make(spec):
    pf = tuple(int(v) for v in (spec + ":0").split(":")[:2])
    chunk = Q.vnni_chunk_of(Q._rows_dot_vnni(4, *pf), Q._rows_dot_vnni(1, *pf))

    @numba.njit(fastmath=True)
    def kern(x_p, q_p, s_p, N, K, y):
        x, q, sc = at(x_p, (K,), np.float32), at(q_p, (N * K,), np.int8), at(s_p, (N,), np.float32)
        xu, dv = Q.vnni_operands(x, K)
        chunk(0, N, x, q, q_p, sc, K, xu, dv, y)
    return kern


pfs = (sys.argv[1] if len(sys.argv) > 1 else "0:0,4:0,4:512,8:0").split(",")
arms = {f"pf{p}": make(p) for p in pfs}
ls = layers("q8")
x, x2 = torch.randn(1, 2048), torch.randn(1, 4096)


def run(layer, f):
    qkv, o = layer
    res = []
    for w, xx in [(m, x) for m in qkv] + [(o, x2)]:
        N, K = w.shape
        y = np.empty(N, np.float32)
        f(xx.data_ptr(), w.parts["q"].data_ptr(), w.parts["scale"].data_ptr(), N, K, y)
        res.append(y)
    return res

ref = run(ls[0], Q.q8_row_vnni_serial)
for k, f in arms.items():
    got = run(ls[0], f)
    assert all(np.array_equal(a, b) for a, b in zip(ref, got)), k
cold = {k: [] for k in arms}; hot = {k: [] for k in arms}
for _ in range(5):
    for k, f in arms.items():
        for layer in ls:
            t = time.perf_counter(); run(layer, f); cold[k].append(time.perf_counter() - t)
        for _ in range(20):
            t = time.perf_counter(); run(ls[0], f); hot[k].append(time.perf_counter() - t)
print("cold (26 layers cycled) / hot (one layer) ms a layer, 19 MB of q8: " + ", ".join(
    f"{k} {statistics.median(cold[k])*1e3:.3f} / {statistics.median(hot[k])*1e3:.3f}" for k in arms))
