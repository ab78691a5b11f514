"""q8 attention rows of a 30B-shaped layer cold / warmed beforehand (touched, with 21 MB of other traffic between) / hot."""
import statistics, sys, time
sys.path.insert(0, "/work/s15c/benchmarks")
import numba, numpy as np, torch
from waste.numba_ptr import at, follow_torch_threads
from waste.quant import q8_numba as Q
from trunk_rows import layers
torch.set_num_threads(1); follow_torch_threads()

@numba.njit(nogil=True, cache=False)
def touch(addr, n):
    a = at(addr, (n,), np.uint8)
    s = 0
    for i in range(0, n, 64):
        s += a[i]
    return s

ls = layers("q8")
x, x2 = torch.randn(1, 2048), torch.randn(1, 4096)
other = torch.empty(21 << 20, dtype=torch.uint8).fill_(1)
def run(layer):
    qkv, o = layer
    for w, xx in [(m, x) for m in qkv] + [(o, x2)]:
        N, K = w.shape
        y = np.empty(N, np.float32)
        Q.q8_row_vnni_serial(xx.data_ptr(), w.parts["q"].data_ptr(), w.parts["scale"].data_ptr(), N, K, y)
def warm(layer):
    qkv, o = layer
    for w in list(qkv) + [o]:
        touch(w.parts["q"].data_ptr(), w.parts["q"].numel())
run(ls[0]); warm(ls[0]); touch(other.data_ptr(), other.numel())
res = {k: [] for k in ("cold", "warm", "warm+21MB", "hot", "touch")}
for _ in range(5):
    for l in ls:
        t = time.perf_counter(); run(l); res["cold"].append(time.perf_counter() - t)
    for i, l in enumerate(ls):
        t = time.perf_counter(); warm(l); res["touch"].append(time.perf_counter() - t)
        t = time.perf_counter(); run(l); res["warm"].append(time.perf_counter() - t)
    for l in ls:
        warm(l); touch(other.data_ptr(), other.numel())
        t = time.perf_counter(); run(l); res["warm+21MB"].append(time.perf_counter() - t)
    for _ in range(20):
        t = time.perf_counter(); run(ls[0]); res["hot"].append(time.perf_counter() - t)
print(", ".join(f"{k} {1e3*statistics.median(v):.3f} (mean {1e3*statistics.fmean(v):.3f})" for k, v in res.items()))
