"""Resident decode on a GPU (`--device cuda`) of the Qwen3-30B-A3B shape, against its HBM bound and launch count.

    python benchmarks/gpu_decode.py DIR [--layers 12] [-n 64] [--experts bf16]

Builds (once, in DIR) a seeded random release of the Qwen3-30B-A3B widths (hidden 2048, 128 experts top-8,
moe_intermediate 768, 32 / 4 heads of 128) with --layers layers and converts it; then loads it on the GPU with every
expert resident (the slab mirrored in GPU memory), decodes -n tokens (greedy, after a 32-token prompt) and prints
tok/s, ms per token, the bytes one token must read (the trunk less the embeddings, plus top_k records per MoE layer)
over the HBM rate measured here (a 2 GiB device-to-device copy), and the torch operators of one decode step (each a
kernel launch or more). Not a test; docs/LEARNED.md §10 has the figures.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import waste  # noqa: E402
from waste.convert.convert import convert  # noqa: E402
from waste.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe  # noqa: E402
from waste.timing import count_ops  # noqa: E402


def hbm_rate() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / statistics.median(times)      # bytes read + written


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--experts", default="bf16")
    a = ap.parse_args()
    out = a.dir / f"q30b{a.layers}-{a.experts}.waste"
    if not (out / "manifest.json").is_file():
        src = a.dir / "src"
        cfg = qwen3_moe_config(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=a.layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
        write_random_qwen3_moe(src, cfg, seed=0, shard_bytes=2 << 30, progress=False)
        t = time.perf_counter()
        convert(src, out, experts=a.experts, trunk="bf16", force=True, progress=False)
        print(f"converted in {time.perf_counter() - t:.0f} s", flush=True)
        shutil.rmtree(src)
    with waste.load(out, device="cuda", dtype="bfloat16") as eng:
        eng.experts.wait_fill()
        m, man = eng.model, eng.container.manifest
        ids = list(range(3, 35))
        state = m.new_state()
        logits = m.forward(torch.tensor(ids), state, 0, last_only=True)[-1]
        pos = len(ids)
        steps = []
        for i in range(a.n + 8):
            nxt = int(torch.argmax(logits))
            torch.cuda.synchronize()
            t = time.perf_counter()
            logits = m.forward(torch.tensor([nxt]), state, pos, last_only=True)[-1]
            torch.cuda.synchronize()
            if i >= 8:
                steps.append(time.perf_counter() - t)
            pos += 1
        ops, by_op = count_ops(lambda: m.forward(torch.tensor([nxt]), state, pos, last_only=True))
        cfg = eng.container.config
        embed = cfg["vocab_size"] * cfg["hidden_size"] * 2
        per_token = man["trunk"]["bytes"] - embed + cfg["moe"]["top_k"] * man["experts"]["record_bytes"] * len(
            man["experts"]["layers"])
        rate = hbm_rate()
        med = statistics.median(steps)
        print(f"{a.layers} layers, {a.experts} experts, bf16 compute on {torch.cuda.get_device_name()}: "
              f"{1 / med:.1f} tok/s ({1e3 * med:.2f} ms per token, range {1e3 * min(steps):.2f}-{1e3 * max(steps):.2f}); "
              f"{per_token / 1e6:.0f} MB per token / HBM {rate / 1e9:.0f} GB/s = bound {rate / per_token:.0f} tok/s "
              f"({per_token / med / rate * 100:.1f}% of it); "
              f"{ops} torch operators per step ({1e6 * med / ops:.1f} us each); most frequent: "
              + ", ".join(f"{k} {v}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]))


if __name__ == "__main__":
    main()
