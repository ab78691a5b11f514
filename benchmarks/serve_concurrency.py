"""`waste serve` under 1, 2, 4 and 8 concurrent clients: aggregate and per-request decode tok/s, time to first
token, expert bytes read, the batch the scheduler formed. Not a test.

Each round runs every concurrency level once (levels interleaved, so the machine's drift falls on all of them);
figures are medians over rounds with the range. Every client streams `--requests` completions one after another,
each from a prompt of `--prompt-len` token ids of its own (the same length for all, so every level does the same
work per request) with its own seed at temperature 0.8. Per-request tok/s is decode speed, (completion tokens - 1)
/ (last token time - first token time); aggregate is all completion tokens / the level's wall time (prefill
included); TTFT is the median time to the first token.

    python benchmarks/serve_concurrency.py run                                   # the default model
    python benchmarks/serve_concurrency.py build --dir /tmp/serve-stream         # a streaming-sized model
    python benchmarks/serve_concurrency.py run /tmp/serve-stream/stream.waste --budget 400M

The streaming-sized model has Qwen3-30B-A3B's expert widths (hidden 2048, 128 experts, top-8, moe_intermediate
768; 32 / 4 heads of 128) and 6 layers, seeded random (routing close to uniform); converted with the default
formats, so its bank is several times the --budget given to the server and experts stream from disk.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

BANNER = re.compile(r"waste: serving .* at (http://127\.0\.0\.1:\d+)/v1")


def build(d: Path, layers: int) -> Path:
    from waste.convert.convert import convert
    from waste.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe

    out = d / "stream.waste"
    if (out / "manifest.json").is_file():
        return out
    cfg = qwen3_moe_config(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                           num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
    src = d / "src"
    write_random_qwen3_moe(src, cfg, seed=0, progress=True)
    convert(src, out, force=True)
    import shutil

    shutil.rmtree(src)
    return out


def metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#") and "{" in line:
            name = line[:line.index("{")]
            if name.startswith("waste_") and "endpoint=" not in line and "reason=" not in line:
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def prompt_ids(cid: int, r: int, n: int) -> list[int]:
    return [32 + (cid * 37 + r * 11 + 5 * k) % 200 for k in range(n)]


def client(url: str, cid: int, requests: int, tokens: int, results: list, plen: int) -> None:
    with httpx.Client(base_url=url, timeout=600) as h:
        for r in range(requests):
            body = {"prompt": prompt_ids(cid, r, plen), "max_tokens": tokens, "temperature": 0.8,
                    "seed": 1000 * cid + r, "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = last = None
            usage = None
            with h.stream("POST", "/v1/completions", json=body) as s:
                if s.status_code != 200:
                    raise SystemExit(f"request failed: {s.status_code} {s.read()[:300]}")
                for line in s.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    now = time.perf_counter()
                    if ev.get("usage"):
                        usage = ev["usage"]
                    elif ev["choices"] and ev["choices"][0]["text"]:
                        first = first or now
                        last = now
            n = usage["completion_tokens"] if usage else 0
            results.append({"tokens": n, "ttft": (first or t0) - t0,
                            "tps": (n - 1) / (last - first) if first and last and last > first and n > 1 else None})


def level(url: str, c: int, requests: int, tokens: int, plen: int) -> dict:
    m0 = metrics(url)
    results: list = []
    threads = [threading.Thread(target=client, args=(url, i, requests, tokens, results, plen)) for i in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    m1 = metrics(url)

    def d(name):
        return m1.get(name, 0) - m0.get(name, 0)

    hits, misses = d("waste_expert_cache_hits_total"), d("waste_expert_cache_misses_total")
    steps = d("waste_engine_steps_total")
    tps = [r["tps"] for r in results if r["tps"]]
    total = sum(r["tokens"] for r in results)
    return {"clients": c, "requests": len(results), "tokens": total, "wall_s": wall, "aggregate_tps": total / wall,
            "per_request_tps": statistics.median(tps) if tps else None,
            "ttft_s": statistics.median(r["ttft"] for r in results),
            "mean_batch": d("waste_engine_step_sequences_total") / steps if steps else 0,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "mb_read_per_token": d("waste_expert_bytes_read_total") / 1e6 / total if total else 0}


def run(a) -> list[dict]:
    env = {**os.environ}
    if a.omp:
        env["OMP_NUM_THREADS"] = str(a.omp)
    cmd = [sys.executable, "-m", "waste", "serve", *([a.model] if a.model else []), "--port", "0", "--max-batch",
           str(max(a.levels)), *(["--budget", a.budget] if a.budget else []), *(["--no-preload"] if a.budget else []),
           *(["--dtype", a.dtype] if a.dtype else [])]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    url = None
    try:
        for line in proc.stderr:
            m = BANNER.search(line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise SystemExit("waste serve did not start")
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        level(url, 2, 1, a.tokens, a.prompt_len)          # warm-up (and, with a budget, a warm cache)
        rounds = []
        for r in range(a.rounds):
            for c in a.levels:
                row = {"round": r, **level(url, c, a.requests, a.tokens, a.prompt_len)}
                print(json.dumps(row), flush=True)
                rounds.append(row)
        return rounds
    finally:
        proc.terminate()
        proc.wait(30)


def table(rows: list[dict]) -> str:
    def cell(vals, fmt):
        vals = [v for v in vals if v is not None]
        if not vals:
            return "-"
        return f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"

    out = ["| clients | aggregate tok/s | per-request tok/s | TTFT s | mean batch | expert hit rate | MB read / token |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for c in sorted({r["clients"] for r in rows}):
        rs = [r for r in rows if r["clients"] == c]
        out.append(f"| {c} | {cell([r['aggregate_tps'] for r in rs], '{:.1f}')} | "
                   f"{cell([r['per_request_tps'] for r in rs], '{:.1f}')} | {cell([r['ttft_s'] for r in rs], '{:.2f}')} | "
                   f"{cell([r['mean_batch'] for r in rs], '{:.2f}')} | {cell([r['hit_rate'] for r in rs], '{:.2f}')} | "
                   f"{cell([r['mb_read_per_token'] for r in rs], '{:.1f}')} |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--dir", type=Path, required=True)
    b.add_argument("--layers", type=int, default=6)
    r = sub.add_parser("run")
    r.add_argument("model", nargs="?", default=None, help="a container (default: the default model)")
    r.add_argument("--budget", default=None, help="the server's expert cache (makes experts stream)")
    r.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--requests", type=int, default=2, help="requests per client per level")
    r.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    r.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per request")
    r.add_argument("--omp", type=int, default=None, help="OMP_NUM_THREADS for the server")
    r.add_argument("--dtype", default=None, help="the server's compute dtype (default auto)")
    r.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = p.parse_args()
    if a.cmd == "build":
        print(build(a.dir, a.layers))
        return
    rows = run(a)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
