"""Streaming benchmark: a Qwen3-30B-A3B-shaped model whose expert bank is about twice the memory limit.

Widths are Qwen3-30B-A3B's (hidden 2048, 128 experts, top-8, moe_intermediate 768, 32 query / 4 KV heads,
head_dim 128); the layer count is chosen so the bank (q4 by default, what `waste convert` writes) is about 2x the
limit: the ratio of the real 48-layer model's 16.3 GB q4 bank to an 8 GiB machine. Weights are seeded random,
so routing is close to uniform: the hit rate follows budget / bank, where a trained model's skewed routing
does better (docs/LEARNED.md). The vocabulary is the small synthetic one (the trunk is not what is measured).

    python benchmarks/streaming_qwen3_30b.py build --dir /tmp/q30b --limit 8G   # writes the release + container
    ../shared/tools/laptop --drop-caches 8G -- waste bench /tmp/q30b/q30b.waste -n 32 --prompt-len 16 --json
    python benchmarks/streaming_qwen3_30b.py run --dir /tmp/q30b --limit 8G --repeat 3   # does the line above
    python benchmarks/streaming_qwen3_30b.py retrunk --dir /tmp/q30b --trunk q4   # q30b-trunk-q4.waste beside it
    python benchmarks/streaming_qwen3_30b.py run --dir /tmp/q30b --limit 8G --arm bf16:"--dtype bfloat16" \
        --arm f32:"--dtype float32" --arm q4t@/tmp/q30b/q30b-trunk-q4.waste:"--dtype float32"   # arms interleaved

Nothing here is a test.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from waste.convert.convert import convert
from waste.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe
from waste.quant.formats import get_format
from waste.units import parse_size

SHARED = Path(__file__).resolve().parents[2] / "shared"


def record_bytes(experts: str) -> int:
    """One expert record of this shape in the given format (gate, up, down), padded to 4 KiB as banks store it."""
    fmt = get_format(experts)
    n = sum(torch.Size(shp).numel() * dt.itemsize for m in ((768, 2048), (768, 2048), (2048, 768))
            for dt, shp in fmt.part_specs(m).values())
    return -(-n // 4096) * 4096


def shape(limit_bytes: int, factor: float = 2.0, experts: str = "bf16") -> dict:
    layers = math.ceil(factor * limit_bytes / (128 * record_bytes(experts)))
    return qwen3_moe_config(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)


def build(d: Path, limit: int, experts: str) -> Path:
    out = d / "q30b.waste"
    if (out / "manifest.json").is_file():
        return out
    src = d / "src"
    write_random_qwen3_moe(src, shape(limit, experts=experts), seed=0, shard_bytes=2 << 30, progress=True)
    convert(src, out, experts=experts, force=True)
    shutil.rmtree(src)        # the release is only needed to convert
    return out


def retrunk(src: Path, out: Path, trunk: str) -> Path:
    """A copy of container src whose trunk is stored in another format, its banks symbolic links to src's (no second
    bank on a full disk): the trunk's matrices dequantized and quantized again, so the weights are not the release's
    own (a speed arm, not a quality one)."""
    from waste.container import open_container
    from waste.container.manifest import FORMAT_NAME, MANIFEST, file_table, write_manifest
    from waste.container.trunk import TrunkWriter
    from waste.quant.linear import QuantWeight, assemble_trunk, part_name, quantizable

    if (out / MANIFEST).is_file():
        return out
    c, fmt = open_container(src), get_format(trunk)
    m = json.loads((src / MANIFEST).read_text())
    tensors = assemble_trunk(c.load_trunk(), m["trunk"])
    mats = {n: (t.dequantize() if isinstance(t, QuantWeight) else t) for n, t in tensors.items()}
    quantized = {n: list(t.shape) for n, t in mats.items()
                 if (n in m["trunk"]["quantized"] or t.dtype != torch.float32) and quantizable(n, t.shape, fmt)}
    parts = {}
    for n, t in mats.items():
        parts.update({part_name(n, k): v for k, v in fmt.pack(t).items()} if n in quantized else {n: t})
    out.mkdir(parents=True)
    tw = TrunkWriter(str(out / m["trunk"]["file"]), {n: (t.dtype, list(t.shape)) for n, t in parts.items()},
                     {"format": FORMAT_NAME, "trunk_format": fmt.name})
    for n, t in parts.items():
        tw.write(n, t)
    tw.close()
    for p in src.rglob("*"):
        if p.is_file() and p.name not in (MANIFEST, m["trunk"]["file"]):
            (out / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (out / p.relative_to(src)).symlink_to(p.resolve())
    m["trunk"] = {**m["trunk"], "format": fmt.name, "bytes": tw.bytes, "crc32": tw.crc32, "quantized": quantized,
                  "f32_tensors": sorted(n for n, t in parts.items() if t.dtype == torch.float32 and n in mats)}
    m["provenance"] = {**m["provenance"], "retrunk": f"{src} (trunk {c.manifest['trunk']['format']} -> {fmt.name})"}
    m["files"] = file_table(out, m)
    write_manifest(out, m)
    return out


def run(d: Path, limit: str, repeat: int, n: int, prompt_len: int, feed: str = "greedy",
        routing: str = "model", arms: list[str] | None = None) -> dict[str, list[dict]]:
    """Each arm (NAME[@CONTAINER]:FLAGS, extra `waste bench` flags; CONTAINER defaults to DIR/q30b.waste) run cold
    in its own process under laptop --drop-caches, the arms interleaved (repeat r of every arm before r + 1)."""
    arms = arms or ["default:"]
    results: dict[str, list[dict]] = {}
    for _ in range(repeat):
        for arm in arms:
            head, _, flags = arm.partition(":")
            name, _, model = head.partition("@")
            cmd = [str(SHARED / "tools" / "laptop"), "--drop-caches", limit, "--", sys.executable, "-m", "waste",
                   "bench", model or str(d / "q30b.waste"), "-n", str(n), "--prompt-len", str(prompt_len), "--feed",
                   feed, "--routing", routing, "--json", "--profile", *shlex.split(flags)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"bench failed ({p.returncode}): {p.stderr[-2000:]}")
            r = json.loads(p.stdout)
            r["laptop"] = p.stderr.strip().splitlines()[-1]
            r["load"] = float(open("/proc/loadavg").read().split()[0])
            results.setdefault(name, []).append(r)
            dec, ms = r["decode"], r["profile"]["ms_per_token"]
            print(f"{name:<10} {r['dtype'][6:]:<8} decode {dec['tok_per_s']:.3f} tok/s, hit {100 * dec['hit_rate']:.1f}%, "
                  f"read {dec['bytes_read'] / 1e9:.2f} GB; I/O bound {dec['io_bound_tok_per_s'] or 0:.3f} tok/s (disk "
                  f"{r['disk_bandwidth_gb_per_s']:.2f} GB/s); disk busy {100 * dec['disk_busy_share']:.0f}% of the step "
                  f"({dec['bytes_read'] / max(dec['disk_busy_seconds'], 1e-9) / 1e9:.2f} GB/s while busy); ms/token "
                  f"attention {ms['attention']:.1f} experts {ms['expert compute']:.1f} wait {ms['expert wait']:.1f} "
                  f"CPU {1e3 * dec['cpu_seconds'] / dec['tokens']:.0f}; load {r['load']:.1f} | {r['laptop']}", flush=True)
    for name, rs in results.items():
        tps = [r["decode"]["tok_per_s"] for r in rs]
        of = [r["decode"]["tok_per_s"] / r["decode"]["io_bound_tok_per_s"] for r in rs if r["decode"]["io_bound_tok_per_s"]]
        busy = [r["decode"]["disk_busy_share"] for r in rs]
        print(f"{name:<10} median decode {statistics.median(tps):.3f} tok/s ({min(tps):.3f}-{max(tps):.3f}); of the "
              f"I/O bound {100 * statistics.median(of):.0f}% ({100 * min(of):.0f}-{100 * max(of):.0f}%); disk busy "
              f"{100 * statistics.median(busy):.0f}% ({100 * min(busy):.0f}-{100 * max(busy):.0f}%)")
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "run", "retrunk"])
    ap.add_argument("--dir", default="/tmp/q30b")
    ap.add_argument("--limit", default="8G")
    ap.add_argument("--experts", default="q4", help="the expert format the bank is built in (its size sets the "
                    "layer count: a bank of 2x the limit)")
    ap.add_argument("--trunk", default="q4", help="retrunk: the trunk format of the copy")
    ap.add_argument("--arm", action="append", help="run: NAME[@CONTAINER]:FLAGS (extra waste bench flags), repeatable; "
                    "the arms interleaved")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--feed", choices=["greedy", "random"], default="random",
                    help="waste bench --feed: random tokens route like varied text (greedy repeats on random weights)")
    ap.add_argument("--routing", choices=["model", "uniform"], default="uniform",
                    help="waste bench --routing: uniform is a balanced model's worst case; this random model's own "
                         "router concentrates on a few experts in its deeper layers")
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    if a.what == "build":
        print(build(d, parse_size(a.limit), a.experts))
    elif a.what == "retrunk":
        print(retrunk(d / "q30b.waste", d / f"q30b-trunk-{a.trunk}.waste", a.trunk))
    else:
        res = run(d, a.limit, a.repeat, a.n, a.prompt_len, a.feed, a.routing, a.arm)
        (d / "results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
