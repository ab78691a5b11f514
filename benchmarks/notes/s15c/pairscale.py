import time, statistics, numpy as np, torch, threading
from concurrent.futures import ThreadPoolExecutor
from waste.quant.formats import get_format
from waste.layers import cpu_kernels as ck
fmt, g = get_format("q4"), torch.Generator().manual_seed(1)
h, inter, E = 2048, 768, 40
shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
packed = {m: [fmt.pack(torch.randn(shp, generator=g) / shp[1] ** 0.5) for _ in range(4)] * (E // 4) for m, shp in shapes.items()}
arrays, os = [], []
for m in shapes:
    for key in ("q", "sz"):
        t = torch.stack([p[key] for p in packed[m]]).contiguous()
        a = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
        arrays.append(a.reshape(-1)); os.append((0, t[0].numel()))
os = np.array(os, np.int64)
groups = np.array([packed[m][0]["sz"].shape[0] for m in shapes], np.int64)
x = torch.randn(1, h, generator=g)
torch.set_num_threads(1)
def call(slots, out):
    s = np.array(slots, np.int64)
    ck.pairs_q4(x.data_ptr(), h, s.ctypes.data, len(slots), *arrays, os, groups, inter, np.float32(-1), out)
out = np.zeros((2, h), np.float32); out2 = np.zeros((2, h), np.float32)
call([0], out)
pool = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,))
pool.submit(call, [1], out2).result()
res = {"one pair, one thread (hot)": [], "two pairs, two threads at once (hot)": [], "one pair cold (cycling 40)": [], "two at once cold": []}
for r in range(30):
    t = time.perf_counter(); call([0], out); res["one pair, one thread (hot)"].append(time.perf_counter() - t)
    t = time.perf_counter(); f = pool.submit(call, [1], out2); call([0], out); f.result(); res["two pairs, two threads at once (hot)"].append(time.perf_counter() - t)
for r in range(3):
    for e in range(0, E, 2):
        t = time.perf_counter(); call([e], out); res["one pair cold (cycling 40)"].append(time.perf_counter() - t)
    for e in range(0, E, 2):
        t = time.perf_counter(); f = pool.submit(call, [e + 1], out2); call([e], out); f.result(); res["two at once cold"].append(time.perf_counter() - t)
for k, v in res.items(): print(f"{k}: median {1e3*statistics.median(v):.3f} ms")
