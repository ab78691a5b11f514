"""A q8 trunk matrix times one float32 decode row: quant/q8_numba.py's kernel (x rounded to int8 in blocks of 32)
against the path it replaced (the codes widened to float32 through F.linear, the row scales after), us per call
(50 calls after one), its relative error against float64, and bit-equality at 1 and 2 threads. LEARNED §10d.

    python benchmarks/q8_row.py
"""
import time

import torch
import torch.nn.functional as F

from waste.quant.formats import get_format

fmt, g = get_format("q8"), torch.Generator().manual_seed(0)
for shape in [(4096, 2048), (2048, 4096), (96, 320), (320, 96), (16, 40)]:
    w = torch.randn(shape, generator=g) / shape[1] ** 0.5
    parts = fmt.pack(w)
    d = fmt.unpack(parts, shape, torch.float64)
    x = torch.randn(1, shape[1], generator=g)
    rk = fmt.row_kernel(parts, shape)
    got = {}
    for n in (1, 2, 1):
        torch.set_num_threads(n)
        got.setdefault(n, []).append(rk(x))
    ref = x.double() @ d.T
    ts = {}
    for name, f in (("numba int8", lambda: rk(x)), ("widened F.linear", lambda: F.linear(x, parts["q"].float()) * parts["scale"])):
        f()
        t = time.perf_counter()
        for _ in range(50):
            f()
        ts[name] = (time.perf_counter() - t) / 50 * 1e6
    err = ((got[1][0].double() - ref).norm() / ref.norm()).item()
    same = torch.equal(got[1][0], got[2][0]) and torch.equal(got[1][0], got[1][1])
    print(shape, f"rel err {err:.1e}", "1 = 2 threads" if same else "THREADS DIFFER",
          ", ".join(f"{k} {v:.1f} us" for k, v in ts.items()))
