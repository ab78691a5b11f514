"""Where a GPU decode step's time goes, and the fused decode kernels against the torch path, in one process:

    python benchmarks/gpu_profile.py MODEL [-n 48] [--rounds 3] [--arms fused,torch] [--profile 4]
                                           [--json F] [--q4-tiles GU/DOWN]

MODEL: a container or a `random:` spec (random:qwen3-30b-a3b,experts=q4[,layers=N]: generated in place, no disk).
Arms, interleaved over --rounds, each a fresh sequence (32-token prompt, 4 warm-up steps that capture its graph,
then -n timed steps, greedy; median per round): fused = the defaults: layers/decode_triton.py's kernels and
moe_triton.weighted_pairs (q4: layers/q4_rows.py over the GPU's row layout, SwiGLU applied by the gate + up launch,
the routing weight by the down launch, a decode row's x and activation rounded to int8 by q4_int8_rows, whose down
launch also sums a row's pairs; the trunk's decode matvecs by quant/gemv_triton, the router by
decode_triton.router_row); f32q4 = fused with q4_rows' float32 rows (q4_int8_rows off); cublas = fused with cuBLAS's
matvecs and router (gemv_triton and router_row off); jit = fused with every triton launch through triton's JIT
(waste/triton_launch.py's fast launches off); nopdl = fused with every launch independent (triton_launch.PDL off:
no programmatic dependent launch); kdaeager = fused with KDA layers
eager (graphs.py's `layer` off); torch = none of them (decode_triton off,
the experts through moe_triton.pairs and torch's activation and weighted sum). Then, per arm, torch.profiler with CUDA
activities over --profile steps, replayed (whole-step graph) and eager: kernels per step and per layer, kernel time
per step, the top kernels.
Beside each figure: the HBM bound (bytes a token reads / a 2 GiB copy's rate here) and the launch floors (one eager
launch; one kernel inside a CUDA graph). Not a test; docs/LEARNED.md §10b and §10g have the figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from expert_parallel_gpu import hbm_rate, token_bytes  # noqa: E402
from gpu_decode import launch_us  # noqa: E402
from waste import triton_launch  # noqa: E402
from waste.engine import Engine  # noqa: E402
from waste.layers import decode_triton, moe_triton, q4_int8_rows, q4_rows  # noqa: E402
from waste.quant import gemv_triton  # noqa: E402


def graph_launch_us(n: int = 200) -> float:
    """Microseconds per tiny kernel replayed inside one CUDA graph (the floor a captured step pays per kernel)."""
    t = torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        t.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            t.add_(1)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(times)


def set_arm(m, arm: str) -> None:
    decode_triton.ENABLED = arm != "torch"
    triton_launch.ENABLED = arm != "jit"
    triton_launch.PDL = arm != "nopdl"
    q4_int8_rows.ENABLED = arm not in ("torch", "f32q4")
    gemv_triton.ENABLED = decode_triton.ROUTER_ROW = arm not in ("torch", "cublas")
    moe_triton.pairs.weighted_pairs = None if arm == "torch" else moe_triton.weighted_pairs
    if m.graphs is not None:           # captured with the other arm's kernels: capture again, in a new pool (torch
        m.graphs.steps.clear()         # asserts when a pool whose graphs were all freed is captured into again)
        m.graphs.mlps.clear()
        m.graphs.layers.clear()
        m.graphs.layers_on = arm not in ("torch", "kdaeager")
        m.graphs.pool = None
        torch.cuda.synchronize()


def run_steps(m, n: int, warm: int = 4, seed: int = 0):
    """A fresh sequence: prompt, warm-up steps, then n timed steps: (seconds per step, the state, next id, pos)."""
    g = torch.Generator().manual_seed(seed)
    v = m.embed.shape[0]
    ids = torch.randint(3, v, (32,), generator=g)
    state = m.new_state()
    logits = m.forward(ids, state, 0, last_only=True)[-1]
    pos, steps = 32, []
    for i in range(warm + n):
        nxt = int(torch.argmax(logits))
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = m.forward(torch.tensor([nxt]), state, pos, last_only=True)[-1]
        torch.cuda.synchronize()
        if i >= warm:
            steps.append(time.perf_counter() - t)
        pos += 1
    return steps, state, int(torch.argmax(logits)), pos


def kernels(m, state, nxt: int, pos: int, steps: int, graphed: bool) -> dict:
    """torch.profiler over `steps` decode steps: kernels per step, their time, the top ones by time."""
    saved = m.graphs
    if not graphed:
        m.graphs = None
    try:
        m.forward(torch.tensor([nxt]), state, pos, last_only=True)
        torch.cuda.synchronize()
        pos += 1
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                m.forward(torch.tensor([nxt]), state, pos, last_only=True)
                pos += 1
            torch.cuda.synchronize()
    finally:
        m.graphs = saved
    ev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by: dict[str, list] = {}
    for e in ev:
        r = by.setdefault(e.name[:90], [0, 0.0])
        r[0] += 1
        r[1] += e.time_range.elapsed_us()
    total = sum(r[1] for r in by.values())
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:14]
    return {"kernels_per_step": len(ev) / steps, "kernel_us_per_step": total / steps,
            "top": [(k, r[0] / steps, r[1] / steps) for k, r in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default="fused,torch")
    ap.add_argument("--q4-tiles", help="q4_rows' (rows a program, groups a step, warps) for gate + up and down, as "
                    "benchmarks/q4_tiles.py --best writes them: 16.2.4/8.2.4")
    ap.add_argument("--gemv-tiles", type=Path, help="benchmarks/gemv_tiles.py --best's JSON: gemv_triton's tiles")
    ap.add_argument("--profile", type=int, default=4, help="steps under the profiler per arm (0: none)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.q4_tiles:
        q4_rows.GATE_UP, q4_rows.DOWN = (tuple(int(v) for v in part.split(".")) for part in a.q4_tiles.split("/"))
        print(f"q4_rows: gate + up {q4_rows.GATE_UP}, down {q4_rows.DOWN}", flush=True)
    if a.gemv_tiles and a.gemv_tiles.is_file():
        for key, tile in json.loads(a.gemv_tiles.read_text()).items():
            gemv_triton.TILES[tuple(int(v) for v in key.split(","))] = tuple(tile)
        print(f"gemv_triton tiles: {gemv_triton.TILES}", flush=True)
    rate, eager_us, graph_us = hbm_rate(), launch_us(), graph_launch_us()
    t0 = time.perf_counter()
    eng = Engine.load(a.model, dtype="bfloat16", device="cuda")
    if hasattr(eng.experts, "wait_fill"):
        eng.experts.wait_fill()
    load_s = time.perf_counter() - t0
    m = eng.model
    layers, tb = len(m.layers), token_bytes(eng, 1)
    print(f"{torch.cuda.get_device_name()}: HBM copy {rate / 1e9:.0f} GB/s; one eager launch {eager_us:.1f} us, one "
          f"kernel in a graph {graph_us:.2f} us; {a.model}: {layers} layers, loaded in {load_s:.0f} s, "
          f"{tb / 1e6:.0f} MB a token = bound {rate / tb:.0f} tok/s", flush=True)
    arms = a.arms.split(",")
    res: dict[str, list] = {arm: [] for arm in arms}
    last = {}
    for r in range(a.rounds):
        for arm in arms:
            set_arm(m, arm)
            steps, state, nxt, pos = run_steps(m, a.n, seed=r)
            res[arm].append(statistics.median(steps))
            last[arm] = (state, nxt, pos)
            print(f"round {r + 1} {arm}: {1e3 * res[arm][-1]:.3f} ms a token", flush=True)
    out = {"model": a.model, "layers": layers, "hbm_gb_s": rate / 1e9, "eager_launch_us": eager_us,
           "graph_kernel_us": graph_us, "token_bytes": tb, "bound_tok_s": rate / tb, "arms": {}}
    for arm in arms:
        meds = res[arm]
        med = statistics.median(meds)
        o = out["arms"][arm] = {"tok_s": 1 / med, "ms": 1e3 * med, "rounds_ms": [1e3 * x for x in meds],
                                "share_of_bound": tb / med / rate, "us_per_layer": 1e6 * med / layers}
        print(f"{arm}: {o['tok_s']:.1f} tok/s ({o['ms']:.3f} ms a token, rounds "
              f"{', '.join(f'{x:.3f}' for x in o['rounds_ms'])}) = {100 * o['share_of_bound']:.1f}% of the "
              f"{rate / tb:.0f} tok/s bound; {o['us_per_layer']:.0f} us a layer", flush=True)
        if a.profile:
            set_arm(m, arm)
            state, nxt, pos = last[arm]
            for graphed in (True, False):
                k = kernels(m, state, nxt, pos, a.profile, graphed)
                pos += a.profile + 1
                o["graphed" if graphed else "eager"] = k
                floor = k["kernels_per_step"] * (graph_us if graphed else eager_us)
                print(f"  {arm}, {'graph replay' if graphed else 'eager'}: {k['kernels_per_step']:.0f} kernels a "
                      f"step ({k['kernels_per_step'] / layers:.1f} a layer), kernel time {k['kernel_us_per_step']:.0f}"
                      f" us a step ({k['kernel_us_per_step'] / layers:.0f} a layer); launch floor {floor:.0f} us",
                      flush=True)
                for name, cnt, us in k["top"]:
                    print(f"    {us:9.1f} us {cnt:6.1f}x  {name}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    eng.close()


if __name__ == "__main__":
    main()
