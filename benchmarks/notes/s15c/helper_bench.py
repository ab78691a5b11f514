import statistics, sys, time
sys.path.insert(0, "/work/s15c/benchmarks")
from concurrent.futures import ThreadPoolExecutor
import torch
from trunk_rows import layers, LAYERS
from waste.quant.linear import linear
from waste.numba_ptr import row_helper
torch.set_num_threads(1)
ls = layers("q8")
x, x2 = torch.randn(1, 2048), torch.randn(1, 4096)
pool = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,))
def cyc():
    t0 = time.perf_counter()
    for qkv, o in ls:
        for w in qkv: linear(x, w)
        linear(x2, o)
    return 1e3 * (time.perf_counter() - t0) / LAYERS
for arm in ("one", "helper", "one", "helper", "helper-spin"):
    ms = []
    for _ in range(4):
        if arm == "one":
            ms.append(cyc())
        else:
            with row_helper(pool):
                ms.append(cyc())
    print(arm, [round(m, 3) for m in ms[1:]])
