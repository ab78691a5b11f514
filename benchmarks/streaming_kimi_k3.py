"""Streaming benchmark: Kimi K3 at its real widths (hidden 7168, latent 3584, moe_intermediate 3072, top-16 of 896
experts, mxfp4 records of 17.3 MB kept as released), with as many layers as the disk holds, decoded cold under a
memory limit, against the I/O bound; then extrapolated to the real 93 layers on 64 GB and 128 GB machines.

One K3 MoE layer's bank is 15.5 GB (896 x 17.3 MB); building it writes the release and then the container (the
release is deleted after the conversion), so a layer needs about twice that on disk while it is built. Layers
are KDA (69 of the real 93 are); the vocabulary is the small synthetic one (the trunk is not what is measured).
Weights are seeded random, so the benchmark sends each token to 16 experts drawn uniformly (`waste bench
--routing uniform`): the cache's worst case. A trained model's skewed routing hits more.

    python benchmarks/streaming_kimi_k3.py build --dir /tmp/k3 [--layers N]     # default: as many as fit
    python benchmarks/streaming_kimi_k3.py run --dir /tmp/k3 --limit 8G --repeat 3 -n 8

Nothing here is a test.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from waste.convert.convert import convert
from waste.convert.synthetic import kimi_k3_text_config, write_random_kimi_k3

SHARED = Path(__file__).resolve().parents[2] / "shared"
RECORD = 3 * 3072 * 3584 // 2 + 3 * 3072 * 3584 // 32 + 4096   # one mxfp4 record, about, with its padding
LAYER_BANK = 896 * RECORD
REAL_MOE_LAYERS, REAL_TOP_K = 92, 16
RESERVE = 20 << 30          # left free for everything else on the disk


def layers_that_fit(d: Path) -> int:
    free = shutil.disk_usage(d).free
    return max(0, int((free - RESERVE) // (2.1 * LAYER_BANK)))


def build(d: Path, layers: int | None) -> Path:
    out = d / "k3.waste"
    if (out / "manifest.json").is_file():
        return out
    n = layers or layers_that_fit(d)
    if n < 1:
        raise SystemExit(f"{d}: one K3 layer needs about {2.1 * LAYER_BANK / 1e9:.0f} GB free while it is built "
                         f"(plus {RESERVE >> 30} GiB kept free); there is {shutil.disk_usage(d).free / 1e9:.0f} GB")
    src = d / "src"
    write_random_kimi_k3(src, kimi_k3_text_config(num_hidden_layers=n), seed=0, progress=True)
    convert(src, out, force=True)       # experts auto: the mxfp4 records as released; trunk q8
    shutil.rmtree(src)
    return out


def bench(d: Path, limit: str, n: int, prompt_len: int, routing: str) -> dict:
    cmd = [str(SHARED / "tools" / "laptop"), "--drop-caches", limit, "--", sys.executable, "-m", "waste", "bench",
           str(d / "k3.waste"), "-n", str(n), "--prompt-len", str(prompt_len), "--feed", "random",
           "--routing", routing, "--json"]
    # one compute thread: numba's OpenMP layer would otherwise reset torch to every core after the first mxfp4
    # call, and OpenMP spinning on a busy 2-core box costs 3x here (docs/LEARNED.md §3c, §3f)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"bench failed ({p.returncode}): {p.stderr[-2000:]}")
    r = json.loads(p.stdout)
    r["laptop"] = p.stderr.strip().splitlines()[-1]
    dec = r["decode"]
    print(f"routing {routing}: decode {dec['tok_per_s']:.3f} tok/s, hit {100 * dec['hit_rate']:.1f}%, read "
          f"{dec['bytes_read'] / 1e9:.2f} GB; I/O bound {dec['io_bound_tok_per_s'] or 0:.3f} tok/s; disk "
          f"{r['disk_bandwidth_gb_per_s']:.2f} GB/s | {r['laptop']}", flush=True)
    return r


def run(d: Path, limit: str, repeat: int, n: int, prompt_len: int) -> list[dict]:
    """`repeat` cold runs with uniform routing (what is reported), then one with the random model's own router,
    which sends nearly every token to the same few experts: its step is the compute of a token, reads aside."""
    results = [bench(d, limit, n, prompt_len, "uniform") for _ in range(repeat)]
    results.append(bench(d, limit, n, prompt_len, "model"))
    extrapolate(d, results)
    return results


def extrapolate(d: Path, results: list[dict]) -> None:
    """The real model from the measured pieces: per MoE layer and token, compute (the own-router run's step less its
    I/O bound) and reads (misses x record / the disk's bandwidth), not overlapped; misses from budget / bank under
    uniform routing. Then the hit rate the seeds' 0.45-0.62 tok/s (0.88 at top-8) would take on this disk."""
    m = json.loads((d / "k3.waste" / "manifest.json").read_text())
    L = len(m["experts"]["layers"])
    rec = m["experts"]["record_bytes"]
    trunk_layer = m["trunk"]["bytes"] / m["config"]["num_layers"]      # q8, per KDA layer (embedding is tiny here)
    med = lambda xs: statistics.median(xs)                             # noqa: E731
    uni = [r["decode"] for r in results if r["routing"] == "uniform"]
    local = [r["decode"] for r in results if r["routing"] == "model"][0]
    step = med([x["seconds"] / x["tokens"] for x in uni])
    compute = (local["seconds"] - (local["io_bound_seconds"] or 0.0)) / local["tokens"] / L
    bw = med([r["disk_bandwidth_gb_per_s"] for r in results]) * 1e9
    bound = med([x["io_bound_seconds"] / x["tokens"] for x in uni])
    print(f"\nmeasured ({L} MoE layer(s), record {rec / 1e6:.1f} MB): uniform routing {step:.2f} s per token against an "
          f"I/O bound of {bound:.2f} s ({100 * bound / step:.0f}%); compute {compute:.2f} s per layer and token (own "
          f"router, {100 * local['hit_rate']:.0f}% hits); disk {bw / 1e9:.2f} GB/s; trunk {trunk_layer / 1e9:.2f} GB "
          "per layer (q8)")
    bank = REAL_MOE_LAYERS * 896 * rec
    trunk = 93 * trunk_layer
    print(f"93 layers: bank {bank / 1e12:.2f} TB, trunk about {trunk / 1e9:.0f} GB at q8 ({trunk / 2e9:.0f} GB at q4)")
    print("| machine | trunk | expert budget | hit rate | reads per token | I/O s | compute s | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for ram in (64e9, 128e9):
        for tname, t in (("q8", trunk), ("q4", trunk / 2)):
            budget = 0.75 * ram - t - 1e9
            if budget < REAL_MOE_LAYERS * REAL_TOP_K * rec:
                print(f"| {ram / 1e9:.0f} GB | {tname} | below one working set: refused | | | | | |")
                continue
            hit = budget / bank
            reads = REAL_MOE_LAYERS * REAL_TOP_K * (1 - hit) * rec
            io = reads / bw
            cmp = REAL_MOE_LAYERS * compute
            print(f"| {ram / 1e9:.0f} GB | {tname} | {budget / 1e9:.0f} GB | {100 * hit:.1f}% | {reads / 1e9:.1f} GB | "
                  f"{io:.1f} | {cmp:.1f} | {1 / (io + cmp):.3f} (I/O alone {1 / io:.3f}) |")
    cmp = REAL_MOE_LAYERS * compute
    for tps, k in ((0.45, 16), (0.62, 16), (0.88, 8)):
        left = 1 / tps - cmp
        need = 1 - left * bw / (REAL_MOE_LAYERS * k * rec) if left > 0 else None
        print(f"{tps} tok/s at top-{k} on this disk and CPU: " + (f"a {100 * need:.0f}% hit rate" if need is not None
              else f"out of reach (compute alone {cmp:.1f} s per token)"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "run"])
    ap.add_argument("--dir", default="/tmp/k3")
    ap.add_argument("--layers", type=int, default=None, help="default: as many as the disk holds while building")
    ap.add_argument("--limit", default="8G", help="memory limit of each run (one layer's bank is 15.5 GB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8)
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    if a.what == "build":
        print(build(d, a.layers))
    else:
        res = run(d, a.limit, a.repeat, a.n, a.prompt_len)
        (d / "results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
