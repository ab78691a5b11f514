"""The q4 decode launches alone on a GPU: layers/q4_rows.py's tiles (rows a program, groups a step, warps) for the
gate + up launch and for the down launch, one decode row's 8 pairs of a Qwen3-30B-A3B-shaped layer (h 2048, 768 per
expert, q4) read in place from a slab of 128 random records:

    python benchmarks/q4_tiles.py [--slots 128] [--k 8] [--best FILE] [--tiles GU/DOWN]

Each arm: 16 calls, each on another random set of k slots (the slab is 6x the L2: the reads come from HBM), captured
in one CUDA graph, replayed 20 times; the median replay / 16 is a call's time, its bytes / that time its rate beside a
2 GiB device copy's. Every gate + up tile alone (2/3 of the bytes), every down tile alone (1/3), then the fastest of
each together with the pairs' sum (moe_triton.weighted_pairs + sum_pairs). --best writes the fastest as `GU/DOWN`
(e.g. 4.16.4/4.16.4) for gpu_profile.py --q4-tiles. Not a test; docs/LEARNED.md §10j has the
figures (§10g: the kernels before, int4pack's blocks read as tiles, 30.3 us a call).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from expert_parallel_gpu import hbm_rate  # noqa: E402
from waste.container.bank import _DTYPES, RecordLayout  # noqa: E402
from waste.layers import moe_triton, q4_int8_rows, q4_rows  # noqa: E402
from waste.layers.moe import MATRICES, Bank  # noqa: E402
from waste.quant.formats import get_format  # noqa: E402

GU = [(bn, ng, w) for bn in (2, 4, 8, 16) for ng in (4, 8, 16, 32) for w in (2, 4, 8) if bn * ng <= 128]
DOWN = [(bn, ng, w) for bn in (2, 4, 8, 16) for ng in (4, 8, 16) for w in (2, 4, 8) if bn * ng <= 128]
I8 = [(bn, ng, w) for bn in (4, 8, 16, 32) for ng in (2, 4, 8, 16) for w in (2, 4, 8) if bn * ng <= 256]


def random_bank(h: int, inter: int, n: int) -> tuple[Bank, int]:
    """n records of random nibbles with sane (scale, zero) pairs, laid out as the expert store's slab (random bytes:
    the row layout's timing does not depend on which nibble is which)."""
    fmt = get_format("q4")
    shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    rec = {}
    for m in MATRICES:
        for k, v in fmt.pack(torch.randn(shapes[m]) / h ** 0.5).items():
            rec[f"{m}.{k}"] = v
    layout = RecordLayout.from_tensors(rec)
    rows = torch.randint(0, 256, (n, layout.record_bytes), dtype=torch.uint8, device="cuda")
    parts = {m: {} for m in MATRICES}
    for p in layout.parts:
        m, _, suffix = p.name.partition(".")
        t = rows[:, p.offset:p.offset + p.nbytes].view(_DTYPES[p.dtype]).view(n, *p.shape)
        if suffix == "sz":
            t.copy_(torch.randn(t.shape, device="cuda") * 0.01)
        parts[m][suffix] = t
    return Bank(parts, shapes, fmt), layout.payload_bytes


def time_arm(fn, sets, reps: int = 20) -> float:
    """Seconds a call: len(sets) calls in one graph, replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for sl in sets[:2]:
            fn(sl)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for sl in sets:
            fn(sl)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(sets))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--best", type=Path)
    ap.add_argument("--rows", default="i8", choices=("i8", "float"),
                    help="whose tiles to search: q4_int8_rows' (the float kernels' defaults timed beside) or q4_rows'")
    ap.add_argument("--tiles", help="one arm only (GU/DOWN, e.g. 16.2.4/8.2.4), no other (for ncu)")
    a = ap.parse_args()
    rate = hbm_rate()
    bank, rec = random_bank(2048, 768, a.slots)
    gen = torch.Generator().manual_seed(0)
    sets = [torch.randperm(a.slots, generator=gen)[:a.k].view(1, a.k).cuda() for _ in range(16)]
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(1, a.k, device="cuda")
    byts = a.k * rec
    print(f"{torch.cuda.get_device_name()}: HBM copy {rate / 1e9:.0f} GB/s; {a.k} pairs x {rec / 1e6:.2f} MB = "
          f"{byts / 1e6:.1f} MB a call = bound {1e6 * byts / rate:.1f} us", flush=True)
    ref = None

    def arm(name, fn, nbytes):
        nonlocal ref
        t = time_arm(fn, sets)
        y = fn(sets[0]).float()
        err = 0.0 if ref is None else float((y - ref).norm() / ref.norm())
        ref = y if ref is None else ref
        print(f"{name:36s} {1e6 * t:7.1f} us  {nbytes / t / 1e9:6.0f} GB/s = {100 * nbytes / t / rate:5.1f}% of HBM"
              f"  rel. to the arm first timed {err:.1e}", flush=True)
        return t

    wt = w.reshape(-1)
    a_fixed = torch.rand(a.k, 768, device="cuda")

    mod = q4_int8_rows if a.rows == "i8" else q4_rows
    q4_int8_rows.ENABLED = a.rows == "i8"

    def gate_up(tile, rows=mod):        # (q4_int8_rows' returns the activation and its int8 rows: the first timed)
        if rows is q4_int8_rows:
            return lambda sl: rows.gate_up_act(x, a.k, sl.reshape(-1), bank, moe_triton._delta, tile)[0]
        return lambda sl: rows.gate_up_act(x, a.k, sl.reshape(-1), bank, moe_triton._delta, tile)

    a_words = q4_int8_rows.quantize(a_fixed, 768 // bank.parts["down"]["sz"].shape[1])

    def down(tile, rows=mod):
        a_in = (a_fixed, a_words) if rows is q4_int8_rows else a_fixed
        return lambda sl: rows.down(a_in, sl.reshape(-1), wt, bank, tile)

    def both(gu, dn):       # the pairs summed as a layer's one group of pairs is (by the down launch: int8 rows)
        return lambda sl: moe_triton.weighted_pairs(x, sl, w, bank, gate_up=gu, down=dn, total=x.dtype)

    if a.tiles:
        gu, dn = (tuple(int(v) for v in part.split(".")) for part in a.tiles.split("/"))
        arm(f"gu {gu} down {dn}", both(gu, dn), byts)
        return
    if a.rows == "i8":         # the float kernels at their defaults first, in the same run
        for name, fn, share in (("float gate + up", gate_up(None, q4_rows), 2 / 3),
                                ("float down", down(None, q4_rows), 1 / 3)):
            ref = None
            arm(name, fn, share * byts)
    best = []
    grids = ((I8, I8) if a.rows == "i8" else (GU, DOWN))
    for name, make, tiles, share in (("gate + up", gate_up, grids[0], 2 / 3), ("down", down, grids[1], 1 / 3)):
        ref = None
        res = sorted((arm(f"{name} {t}", make(t), share * byts), t) for t in tiles)
        for tt, t in res[:5]:
            print(f"top {name}: {t} {1e6 * tt:.1f} us = {100 * share * byts / tt / rate:.1f}% of HBM")
        best.append(res[0][1])
    ref = None
    t = arm(f"both: gu {best[0]} down {best[1]} + sum_pairs", both(*best), byts)
    spec = "/".join(".".join(map(str, b)) for b in best)
    print(f"best: {spec}: {1e6 * t:.1f} us = {100 * byts / t / rate:.1f}% of HBM", flush=True)
    if a.best:
        a.best.write_text(spec)


if __name__ == "__main__":
    main()
