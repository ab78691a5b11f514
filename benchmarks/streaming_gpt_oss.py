"""Streaming benchmark: gpt-oss-120b at its real widths (hidden 2880, expert intermediate 2880, 64 query and 8
key/value heads of 64, top-4 of 128 experts, mxfp4 records of about 13.3 MB kept as released, biases beside them),
with as many layers as the disk holds (`--layers` caps it), decoded cold under a memory limit, against the I/O
bound; then extrapolated to the real 36 layers.

Layers alternate sliding-window and full attention as the release's do; the vocabulary is the small synthetic one
(the trunk is not what is measured). Experts are random mxfp4 codes, so the benchmark sends each token to 4
experts drawn uniformly (`waste bench --routing uniform`): the cache's worst case. A trained model's skewed routing
hits more.

    python benchmarks/streaming_gpt_oss.py build --dir /tmp/oss [--layers N]     # default: as many as fit
    python benchmarks/streaming_gpt_oss.py run --dir /tmp/oss --limit 4G --repeat 3 -n 16

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

import torch
from safetensors.torch import save_file

from waste.convert.convert import convert
from waste.convert.synthetic import write_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"
D, I, E, K, H, KV, HD = 2880, 2880, 128, 4, 64, 8, 64
RECORD = 3 * D * I // 2 + 3 * D * I // 32 + 4 * (2 * I + D) + 4096     # one mxfp4 record with biases, about
LAYER_BANK = E * RECORD
REAL_LAYERS = 36
RESERVE = 20 << 30          # left free for everything else on the disk


def config(n: int, vocab: int) -> dict:
    """config.json as OpenAI's gpt-oss-120b release writes it, with n layers and the synthetic vocabulary."""
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": vocab, "hidden_size": D,
            "intermediate_size": I, "num_hidden_layers": n, "num_attention_heads": H, "num_key_value_heads": KV,
            "head_dim": HD, "num_local_experts": E, "num_experts_per_tok": K, "experts_per_token": K,
            "sliding_window": 128, "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                                    for i in range(n)],
            "attention_bias": True, "rms_norm_eps": 1e-5, "rope_theta": 150000, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 4096},
            "swiglu_limit": 7.0, "tie_word_embeddings": False, "eos_token_id": 0, "pad_token_id": 0,
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}


def write_release(dst: Path, n: int, seed: int = 0) -> Path:
    """A seeded random release in OpenAI's layout, one shard per layer (bounded memory)."""
    dst.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(dst)
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    def ones(n_):
        return (1 + 0.1 * torch.randn(n_, generator=g)).to(torch.bfloat16)

    index = {}
    edges = {"model.embed_tokens.weight": w(vocab, D), "lm_head.weight": w(vocab, D), "model.norm.weight": ones(D)}
    save_file(edges, str(dst / "edges.safetensors"), metadata={"format": "pt"})
    index.update({k: "edges.safetensors" for k in edges})
    for i in range(n):
        p, t = f"model.layers.{i}", {}
        t.update({f"{p}.input_layernorm.weight": ones(D), f"{p}.post_attention_layernorm.weight": ones(D)})
        for x, rows, cols in (("q", H * HD, D), ("k", KV * HD, D), ("v", KV * HD, D), ("o", D, H * HD)):
            t[f"{p}.self_attn.{x}_proj.weight"] = w(rows, cols)
            t[f"{p}.self_attn.{x}_proj.bias"] = (0.01 * torch.randn(rows, generator=g)).to(torch.bfloat16)
        t[f"{p}.self_attn.sinks"] = torch.randn(H, generator=g).to(torch.bfloat16)
        t[f"{p}.mlp.router.weight"], t[f"{p}.mlp.router.bias"] = w(E, D), ones(E)
        for proj, N, Kin in (("gate_up_proj", 2 * I, D), ("down_proj", D, I)):
            f = f"{p}.mlp.experts.{proj}"
            t[f + "_blocks"] = torch.randint(0, 256, (E, N, Kin // 32, 16), generator=g, dtype=torch.uint8)
            t[f + "_scales"] = (120 + torch.randint(0, 3, (E, N, Kin // 32), generator=g)).to(torch.uint8)
            t[f + "_bias"] = (0.01 * torch.randn(E, N, generator=g)).to(torch.bfloat16)
        name = f"layer-{i:03d}.safetensors"
        save_file(t, str(dst / name), metadata={"format": "pt"})
        index.update({k: name for k in t})
        del t
        print(f"wrote layer {i + 1} of {n}", file=sys.stderr, flush=True)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (dst / "config.json").write_text(json.dumps(config(n, vocab), indent=1))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return dst


def layers_that_fit(d: Path) -> int:
    free = shutil.disk_usage(d).free
    return max(0, int((free - RESERVE) // (2.1 * LAYER_BANK)))


def build(d: Path, layers: int | None) -> Path:
    out = d / "oss.waste"
    if (out / "manifest.json").is_file():
        return out
    n = min(layers or REAL_LAYERS, layers_that_fit(d), REAL_LAYERS)
    if n < 1:
        raise SystemExit(f"{d}: one layer needs about {2.1 * LAYER_BANK / 1e9:.1f} GB free while it is built "
                         f"(plus {RESERVE >> 30} GiB kept free); there is {shutil.disk_usage(d).free / 1e9:.0f} GB")
    src = d / "src"
    write_release(src, n)
    convert(src, out, force=True)       # experts auto: the mxfp4 records as released; trunk q8
    shutil.rmtree(src)
    return out


def bench(d: Path, limit: str, n: int, prompt_len: int, routing: str) -> dict:
    cmd = [str(SHARED / "tools" / "laptop"), "--drop-caches", limit, "--", sys.executable, "-m", "waste", "bench",
           str(d / "oss.waste"), "-n", str(n), "--prompt-len", str(prompt_len), "--feed", "random",
           "--routing", routing, "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}   # see streaming_kimi_k3.py
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
    results = [bench(d, limit, n, prompt_len, "uniform") for _ in range(repeat)]
    results.append(bench(d, limit, n, prompt_len, "model"))
    extrapolate(d, results)
    return results


def extrapolate(d: Path, results: list[dict]) -> None:
    """The real 36 layers from the measured pieces, as streaming_kimi_k3.py does: per layer and token, compute (the
    own-router run's step less its I/O bound) and reads (misses x record / the disk's bandwidth), not overlapped;
    misses from budget / bank under uniform routing."""
    m = json.loads((d / "oss.waste" / "manifest.json").read_text())
    L = len(m["experts"]["layers"])
    rec = m["experts"]["record_bytes"]
    trunk_layer = m["trunk"]["bytes"] / m["config"]["num_layers"]
    med = statistics.median
    uni = [r["decode"] for r in results if r["routing"] == "uniform"]
    local = [r["decode"] for r in results if r["routing"] == "model"][0]
    step = med([x["seconds"] / x["tokens"] for x in uni])
    compute = (local["seconds"] - (local["io_bound_seconds"] or 0.0)) / local["tokens"] / L
    bw = med([r["disk_bandwidth_gb_per_s"] for r in results]) * 1e9
    bound = med([x["io_bound_seconds"] / x["tokens"] for x in uni])
    print(f"\nmeasured ({L} layer(s), record {rec / 1e6:.1f} MB): uniform routing {step:.2f} s per token against an "
          f"I/O bound of {bound:.2f} s ({100 * bound / step:.0f}%); compute {compute:.3f} s per layer and token (own "
          f"router, {100 * local['hit_rate']:.0f}% hits); disk {bw / 1e9:.2f} GB/s; trunk {trunk_layer / 1e6:.0f} MB "
          "per layer (q8)")
    bank = REAL_LAYERS * E * rec
    print(f"36 layers: bank {bank / 1e9:.1f} GB")
    print("| machine | expert budget | hit rate | reads per token | I/O s | compute s | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for ram in (16e9, 32e9, 64e9):
        budget = min(0.75 * ram - REAL_LAYERS * trunk_layer - 1e9, bank)
        if budget < REAL_LAYERS * K * rec:
            print(f"| {ram / 1e9:.0f} GB | below one working set: refused | | | | | |")
            continue
        hit = budget / bank
        reads = REAL_LAYERS * K * (1 - hit) * rec
        io, cmp = reads / bw, REAL_LAYERS * compute
        print(f"| {ram / 1e9:.0f} GB | {budget / 1e9:.0f} GB | {100 * hit:.1f}% | {reads / 1e9:.2f} GB | {io:.2f} | "
              f"{cmp:.2f} | {1 / (io + cmp):.2f} (I/O alone {1 / io if io else float('inf'):.2f}) |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "run"])
    ap.add_argument("--dir", default="/tmp/oss")
    ap.add_argument("--layers", type=int, default=None, help="default: as many as the disk holds while building")
    ap.add_argument("--limit", default="4G", help="memory limit of each run (one layer's bank is 1.7 GB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-n", type=int, default=16)
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
