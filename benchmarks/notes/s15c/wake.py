import time, statistics, threading
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1)
def f(t0): return time.perf_counter() - t0
for gap in (0.0001, 0.001, 0.003):
    lat = []
    for _ in range(200):
        time.sleep(gap)
        lat.append(pool.submit(f, time.perf_counter()).result())
    print(f"idle {gap*1e3} ms before: submit->running median {statistics.median(lat)*1e6:.0f} us, mean {statistics.fmean(lat)*1e6:.0f}, p90 {sorted(lat)[180]*1e6:.0f}")
# busy main thread (spinning in nogil-less python) after submit
lat=[]
for _ in range(100):
    time.sleep(0.002)
    t0=time.perf_counter(); fu=pool.submit(f, t0)
    while not fu.done(): pass
    lat.append(fu.result())
print(f"main spinning in python: median {statistics.median(lat)*1e6:.0f} us mean {statistics.fmean(lat)*1e6:.0f}")
