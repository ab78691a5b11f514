import statistics, sys, time
sys.path.insert(0, "/work/s15c/benchmarks")
import torch
from trunk_rows import layers, LAYERS
from waste.quant.linear import linear
ls = layers("q8")
x, x2 = torch.randn(1, 2048), torch.randn(1, 4096)
for t in (1, 2, 1, 2):
    torch.set_num_threads(t)
    ms = []
    for _ in range(4):
        t0 = time.perf_counter()
        for qkv, o in ls:
            for w in qkv: linear(x, w)
            linear(x2, o)
        ms.append(1e3 * (time.perf_counter() - t0) / LAYERS)
    print(t, "threads", [round(m, 3) for m in ms[1:]])
a = torch.ones(1 << 28)
for t in (1, 2, 1, 2):
    torch.set_num_threads(t); a.sum()
    t0 = time.perf_counter(); [a.sum() for _ in range(3)]; dt = (time.perf_counter() - t0) / 3
    print(t, "threads sum 1 GiB:", round(a.numel() * 4 / dt / 1e9, 1), "GB/s")
