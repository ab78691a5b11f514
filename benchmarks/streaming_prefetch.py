"""Issue 15: next-layer prefetch on and off under three routings (the model's, uniform, the bundled model's trace),
on a Qwen3-30B-shaped model (hidden 2048, 128 experts, top-8, moe_intermediate 768) of few layers, q4 experts.

    python benchmarks/streaming_prefetch.py build --dir /tmp/q30p --layers 6
    python benchmarks/streaming_prefetch.py run --dir /tmp/q30p --budget 255M --repeat 2 -n 32 --prompt-len 64

Arms run interleaved (repeat r of every arm before repeat r + 1), each a fresh `waste bench` process, decode fed
seeded random tokens. A `--laptop SIZE` runs each under ../shared/tools/laptop instead of a plain --budget.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

TRACE = Path(__file__).parent / "traces" / "tiny-py-moe-heldout.json"
SHARED = Path(__file__).resolve().parents[2] / "shared"


def build(d: Path, layers: int) -> Path:
    import shutil

    from waste.convert.convert import convert
    from waste.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe

    out = d / "q30.waste"
    if not (out / "manifest.json").is_file():
        cfg = qwen3_moe_config(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
        write_random_qwen3_moe(d / "src", cfg, seed=0, shard_bytes=2 << 30, progress=False)
        convert(d / "src", out, experts="q4", force=True, progress=False)
        shutil.rmtree(d / "src")
    return out


def run(d: Path, a) -> None:
    arms = [(r, p) for r in ("model", "uniform", f"trace:{TRACE}") for p in (True, False)]
    rows = {arm: [] for arm in arms}
    for _ in range(a.repeat):
        for routing, pf in arms:
            cmd = [sys.executable, "-m", "waste", "bench", str(d / "q30.waste"), "-n", str(a.n), "--prompt-len",
                   str(a.prompt_len), "--feed", "random", "--routing", routing, "--json", "--no-preload"]
            cmd += [] if pf else ["--no-prefetch"]
            if a.laptop:
                cmd = [str(SHARED / "tools" / "laptop"), a.laptop, "--"] + cmd
            else:
                cmd += ["--budget", a.budget]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(p.stderr[-2000:])
            r = json.loads(p.stdout)
            load = open("/proc/loadavg").read().split()[0]
            rows[(routing, pf)].append(r)
            dd, pp = r["decode"], r["prefill"]
            prec = "-" if dd["prefetch_precision"] is None else f"{100 * dd['prefetch_precision']:.1f}%"
            rec = "-" if dd["prefetch_recall"] is None else f"{100 * dd['prefetch_recall']:.1f}%"
            print(f"{routing.split('/')[-1]:<28} prefetch {'on ' if pf else 'off'} | prefill {pp['tok_per_s']:6.2f} "
                  f"| decode {dd['tok_per_s']:6.2f} tok/s hit {100 * dd['hit_rate']:5.1f}% demand read "
                  f"{dd['bytes_read'] / 1e6:6.0f} MB prefetch read {dd['prefetch_bytes'] / 1e6:6.0f} MB "
                  f"precision {prec} recall {rec} | I/O bound "
                  f"{dd['io_bound_tok_per_s'] or 0:.1f} | disk {r['disk_bandwidth_gb_per_s']:.2f} GB/s "
                  f"| load {load}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "run"])
    ap.add_argument("--dir", default="/tmp/q30p")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--budget", default="255M")
    ap.add_argument("--laptop", default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    if a.what == "build":
        print(build(d, a.layers))
    else:
        run(d, a)


if __name__ == "__main__":
    main()
