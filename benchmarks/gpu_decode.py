"""Resident decode on a GPU (`--device cuda`) of the Qwen3-30B-A3B shape, against its HBM bound and launch count.

    python benchmarks/gpu_decode.py DIR [--layers 12] [-n 64] [--experts bf16,q4]
                                        [--variants gather,triton,graphs,whole] [--budget-frac F] [--peer]
                                        [--vram-frac F [--rounds 3] [--trace FILE]] [--replicate-from N]
                                        [--offload-peer]

Builds (once, in DIR) a seeded random release of the Qwen3-30B-A3B widths (hidden 2048, 128 experts top-8,
moe_intermediate 768, 32 / 4 heads of 128) with --layers layers and converts it; then loads it on the GPU with every
expert resident (the slab mirrored in GPU memory), decodes -n tokens (greedy, after a 32-token prompt) and prints
tok/s, ms per token, the bytes one token must read (the trunk less the embeddings, plus top_k records per MoE layer)
over the HBM rate measured here (a 2 GiB device-to-device copy), and the torch operators of one decode step (each a
kernel launch or more). Not a test; docs/LEARNED.md §10 has the figures.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import waste  # noqa: E402
from waste.container import open_container  # noqa: E402
from waste.convert.convert import convert  # noqa: E402
from waste.convert.synthetic import qwen3_moe_config, write_random_qwen3_moe  # noqa: E402
from waste.layers import moe  # noqa: E402
from waste.runtime import bankio, trace  # noqa: E402
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


def launch_us() -> float:
    """Microseconds of one tiny eager torch op on the GPU, issued back to back: the per-launch floor."""
    t = torch.zeros(1, device="cuda")
    for _ in range(100):
        t.add_(1)
    torch.cuda.synchronize()
    n, t0 = 2000, time.perf_counter()
    for _ in range(n):
        t.add_(1)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def disk_rate(paths: list[Path], limit: int = 4 << 30) -> float:
    """O_DIRECT reads of these files in 8 MiB requests (the page cache bypassed, as the bank reader does): bytes/s."""
    buf, n, t = mmap.mmap(-1, 8 << 20), 0, time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            off = 0
            while n < limit:
                k = os.preadv(fd, [buf], off)
                if k <= 0:
                    break
                off, n = off + k, n + k
        finally:
            os.close(fd)
    return n / (time.perf_counter() - t)


def aio_probe(c, seconds: float, depths=(1, 2, 4)) -> dict:
    """The disk as the store's reader sees it: random whole records through Linux AIO (bankio.DirectAio, the
    reaper thread included), `depths` in flight, `seconds` each, with the decoding thread idle: {depth: (GB/s,
    median ms from a record's submission to its landing)}. Before and after decode: the bound in the same run."""
    readers = [bankio.BankReader(b) for b in c.banks.values()]
    nb = readers[0].bank.record_bytes
    rng, out = random.Random(os.urandom(8)), {}
    try:
        for d in depths:
            aio, bufs = bankio.DirectAio(d, events=max(8, 2 * d)), [bankio.aligned_buffer(nb) for _ in range(d)]
            lat, cond, state = [], threading.Condition(), {"n": 0, "left": 0}
            t_end = time.perf_counter() + seconds

            def go(i):
                r = rng.choice(readers)
                t0 = time.perf_counter()

                def done(res, i=i, t0=t0):
                    lat.append(time.perf_counter() - t0)
                    with cond:
                        state["n"] += res == nb
                        if time.perf_counter() < t_end:
                            go(i)
                        else:
                            state["left"] -= 1
                            cond.notify_all()
                aio.submit([(*r.request(rng.randrange(r.bank.num_experts), bufs[i][1]), done)])
            t0 = time.perf_counter()
            with cond:
                state["left"] = d
                for i in range(d):
                    go(i)
                cond.wait_for(lambda: state["left"] == 0)
            out[d] = (state["n"] * nb / (time.perf_counter() - t0) / 1e9, 1e3 * statistics.median(lat))
            aio.close()
    finally:
        for r in readers:
            r.close()
    return out


def decode(m, n: int, feed: torch.Generator | None = None, after_prompt=None):
    """Greedy decode after a 32-token prompt (feed: seeded random ids instead of the argmax, so the routing does not
    settle into a repeating text's few experts); after_prompt() runs between the prompt and the steps."""
    ids = list(range(3, 35))
    state = m.new_state()
    logits = m.forward(torch.tensor(ids), state, 0, last_only=True)[-1]
    if after_prompt is not None:
        after_prompt()
    pos, steps = len(ids), []
    for i in range(n + 8):
        nxt = int(torch.argmax(logits)) if feed is None else int(torch.randint(3, logits.shape[-1], (1,),
                                                                               generator=feed))
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = m.forward(torch.tensor([nxt]), state, pos, last_only=True)[-1]
        torch.cuda.synchronize()
        if i >= 8:
            steps.append(time.perf_counter() - t)
        pos += 1
    return steps, (nxt, state, pos)


def build(d: Path, layers: int, fmt: str, replicate_from: int = 0) -> Path:
    """The container DIR/q30b{layers}-{fmt}.waste (built once): a seeded random release of the 30B widths converted,
    or with replicate_from, one of that many layers repeated (benchmarks/replicate_layers.py: no 58 GB bf16 source
    for 48 layers)."""
    out, src = d / f"q30b{layers}-{fmt}.waste", d / "src"
    if (out / "manifest.json").is_file():
        return out
    if replicate_from and replicate_from < layers:
        base = build(d, replicate_from, fmt)
        t = time.perf_counter()
        subprocess.run([sys.executable, str(Path(__file__).with_name("replicate_layers.py")), str(base), str(out),
                        "--layers", str(layers)], check=True, stdout=subprocess.DEVNULL)
        print(f"{layers} layers replicated from {replicate_from} in {time.perf_counter() - t:.0f} s", flush=True)
        return out
    if (src / "config.json").is_file() and json.loads((src / "config.json").read_text())["num_hidden_layers"] != layers:
        shutil.rmtree(src)
    if not (src / "config.json").is_file():
        cfg = qwen3_moe_config(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                               head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
        t = time.perf_counter()
        write_random_qwen3_moe(src, cfg, seed=0, shard_bytes=2 << 30, progress=False)
        print(f"random release written in {time.perf_counter() - t:.0f} s", flush=True)
    t = time.perf_counter()
    convert(src, out, experts=fmt, trunk="bf16", force=True, progress=False)
    print(f"converted to {fmt} experts in {time.perf_counter() - t:.0f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--experts", default="bf16", help="formats, comma-separated (one random release converted to each)")
    ap.add_argument("--variants", default="gather,triton,graphs,whole",
                    help="gather: the torch gather kernels (bf16 / q8 only); triton: slots read in place; "
                         "graphs: triton and each MoE layer's MLP replayed as a CUDA graph; whole: the whole "
                         "decode step replayed as one CUDA graph")
    ap.add_argument("--budget-frac", type=float, default=0.0,
                    help="also decode with an expert budget of this share of the bank (misses read from the disk "
                         "through the pinned host slab; against the disk's bound)")
    ap.add_argument("--vram-frac", type=float, default=0.0,
                    help="also decode with the whole bank in the pinned host slab and a VRAM tier of this share of it "
                         "(records copied up as layers need them; against the 55 GB/s pinned link)")
    ap.add_argument("--trace", help="the VRAM tier's arms route by this recorded trace (benchmarks/traces/)")
    ap.add_argument("--replicate-from", type=int, default=0, metavar="N",
                    help="build N layers and repeat them to --layers (48 layers of q4 without a 58 GB bf16 source)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the disk and VRAM tiers' arms")
    ap.add_argument("--probe", type=float, default=0.4, help="seconds per depth of the disk arm's AIO probe")
    ap.add_argument("--peer", action="store_true", help="also decode with transformers (bf16 on this GPU)")
    ap.add_argument("--offload-peer", action="store_true",
                    help="and with transformers + accelerate offload, its GPU memory capped at the peak the VRAM tier's "
                         "arms (--vram-frac) allocated")
    a = ap.parse_args()
    src = a.dir / "src"
    rate, floor = hbm_rate(), launch_us()
    print(f"{torch.cuda.get_device_name()}: HBM copy {rate / 1e9:.0f} GB/s; one eager launch {floor:.1f} us",
          flush=True)
    for fmt in a.experts.split(","):
        out = build(a.dir, a.layers, fmt, a.replicate_from)
        with waste.load(out, device="cuda", dtype="bfloat16") as eng:
            eng.experts.wait_fill()
            m, man = eng.model, eng.container.manifest
            cfg = eng.container.config
            embed = cfg["vocab_size"] * cfg["hidden_size"] * 2
            per_token = man["trunk"]["bytes"] - embed + cfg["moe"]["top_k"] * man["experts"]["record_bytes"] * len(
                man["experts"]["layers"])
            kernel, graphs = m.kernel, m.graphs
            for v in a.variants.split(","):
                if v == "gather":
                    if fmt not in ("bf16", "q8"):
                        continue
                    m.kernel = moe.gather_float if fmt == "bf16" else moe.gather_q8
                else:
                    m.kernel = kernel
                m.graphs = graphs if v in ("graphs", "whole") else None
                if graphs is not None:
                    graphs.whole = v == "whole"
                steps, (nxt, state, pos) = decode(m, a.n)
                m.graphs = None
                ops, by_op = count_ops(lambda: m.forward(torch.tensor([nxt]), state, pos, last_only=True))
                med = statistics.median(steps)
                print(f"{a.layers} layers, {fmt} experts, {v}: {1 / med:.1f} tok/s ({1e3 * med:.2f} ms per token, "
                      f"range {1e3 * min(steps):.2f}-{1e3 * max(steps):.2f}); {per_token / 1e6:.0f} MB per token / "
                      f"HBM {rate / 1e9:.0f} GB/s = bound {rate / per_token:.0f} tok/s "
                      f"({per_token / med / rate * 100:.1f}% of it); eager step {ops} torch operators "
                      f"(launch floor {ops * floor / 1e3:.2f} ms = {1e6 / (ops * floor):.0f} tok/s); most frequent: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:8]),
                      flush=True)
            m.kernel, m.graphs = kernel, graphs
            bank_bytes = eng.experts.n_records * man["experts"]["record_bytes"]
        if a.budget_frac:
            disk_arms(out, fmt, bank_bytes, a)
        if a.vram_frac:
            tier_arms(out, fmt, bank_bytes, man["experts"]["record_bytes"], a)
            vram_used = torch.cuda.max_memory_allocated()
    if a.peer and (src / "config.json").is_file() and \
            json.loads((src / "config.json").read_text())["num_hidden_layers"] == a.layers:
        peer_transformers(src, a.n)
        if a.offload_peer and a.vram_frac:
            peer_transformers(src, 4, gpu_bytes=vram_used)
    shutil.rmtree(src, ignore_errors=True)


def disk_arms(out: Path, fmt: str, bank_bytes: int, a) -> None:
    """An expert budget of --budget-frac of the bank, the rest read from disk; arms in --rounds rounds, their order
    turned each round, each arm a fresh load after the page cache is dropped (so every arm reads the same records
    from the same cold store, the feed seeded by the round): the step as graphs cut at the MoE layers with each group
    of experts a graph (main), the groups eager, the whole step eager. Before each round, the disk as the store's
    reads see it (aio_probe); each arm's read rate against that probe's best and the 8 MiB one-thread rate."""
    arms = ("cut graphs", "cut, eager groups", "eager")
    banks = sorted(p for p in (out / "experts").iterdir() if p.is_file())
    res: dict[str, list] = {}
    for r in range(a.rounds):
        c = open_container(out)
        try:
            pr = aio_probe(c, a.probe)
        finally:
            c.close()
        best = max(g for g, _ in pr.values()) * 1e9
        print(f"round {r + 1}: AIO probe (random records, in flight: GB/s, ms a record) " + ", ".join(
            f"{d}: {g:.2f} GB/s {ms:.2f} ms" for d, (g, ms) in pr.items()), flush=True)
        for arm in arms[r % 3:] + arms[:r % 3]:
            drop = subprocess.run("sync && echo 3 > /proc/sys/vm/drop_caches", shell=True).returncode == 0
            disk = disk_rate(banks, limit=1 << 30)
            with waste.load(out, device="cuda", dtype="bfloat16", budget=int(bank_bytes * a.budget_frac)) as eng:
                if eng.model.graphs is not None:
                    eng.model.graphs.cut_on = arm != "eager"
                    eng.model.graphs.rows.on = arm == "cut graphs"
                snap = []
                steps, _ = decode(eng.model, a.n, torch.Generator().manual_seed(r),
                                  lambda: snap.append(eng.experts.stats.snapshot()))
                st = eng.experts.stats
                read = (st.bytes_read - snap[0].bytes_read) / (len(steps) + 8)
                med = statistics.median(steps)
                res.setdefault(arm, []).append((1 / med, read / med / best))
                print(f"{a.layers} layers, {fmt} experts, budget {a.budget_frac:.2f} of the {bank_bytes / 1e9:.1f} GB "
                      f"bank (pinned host slab: {eng.experts.pinned}, page cache dropped: {drop}), {arm}, round "
                      f"{r + 1}: {1 / med:.1f} tok/s ({1e3 * med:.2f} ms per token); {read / 1e6:.1f} MB read per "
                      f"token ({read / med / 1e9:.2f} GB/s: {100 * read / med / best:.0f}% of the probe's best "
                      f"{best / 1e9:.2f} GB/s); the 8 MiB one-thread rate {disk / 1e9:.2f} GB/s: a bound of "
                      f"{disk / max(read, 1):.1f} tok/s ({100 * read / med / disk:.0f}% of it)", flush=True)
    for arm, v in res.items():
        tok, share = [t for t, _ in v], [s for _, s in v]
        print(f"disk arm {arm}: median {statistics.median(tok):.1f} tok/s over {len(v)} rounds ({min(tok):.1f}-"
              f"{max(tok):.1f}); {100 * statistics.median(share):.0f}% of the round's probe best "
              f"({100 * min(share):.0f}-{100 * max(share):.0f}%)", flush=True)


def tier_arms(out: Path, fmt: str, bank_bytes: int, rec: int, a) -> None:
    """The whole bank in pinned host memory, a VRAM tier of --vram-frac of it; arms interleaved over --rounds:
    sync = one blocking copy per run of slots on the compute stream (the tier's first form); stream = copies on
    their own stream, compute waiting on their event; prefetch = stream + the next layer's predicted records
    copied up while this layer computes. Link GB/s = bytes / the copy stream's CUDA-event time of each batch."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()       # the peer's offload gets what this engine's peak was
    with waste.load(out, device="cuda", dtype="bfloat16", vram=int(bank_bytes * a.vram_frac)) as eng:
        eng.experts.wait_fill()
        ex, tier = eng.experts, eng.experts.tier
        if a.trace:     # a recorded routing and its recorded predictions, scaled to this model (runtime/trace.py)
            route, eng.model.predictor = trace.replay(eng.model, trace.load(a.trace))
            eng.model.router = lambda i, x: tuple(t.to(x.device) for t in route(i, x))   # (replayed on the host)
        stream = tier.stream
        res: dict[str, list] = {}
        for _ in range(a.rounds):
            for arm in ("sync", "stream", "prefetch"):
                tier.stream = None if arm == "sync" else stream
                ex.wants_prefetch = ex.tier_prefetch = arm == "prefetch"
                tier.timing(arm != "sync")
                c0, p0, u0, k0 = tier.copies, tier.prefetches, tier.prefetch_used, tier.copy_calls
                steps, _ = decode(eng.model, a.n)
                calls = len(steps) + 8 + 1
                nb, secs = tier.link()
                res.setdefault(arm, []).append((statistics.median(steps), (tier.copies - c0) * rec / calls,
                                                (tier.prefetches - p0) * rec / calls, tier.prefetch_used - u0,
                                                tier.prefetches - p0, (tier.copy_calls - k0) / calls,
                                                nb / secs if secs else 0.0))
        tier.stream = stream
        for arm, rows in res.items():
            meds = [r[0] for r in rows]
            med = statistics.median(meds)
            up, pf = statistics.median(r[1] for r in rows), statistics.median(r[2] for r in rows)
            used = sum(r[3] for r in rows) / sum(r[4] for r in rows) if arm == "prefetch" else 0.0
            link = [r[6] / 1e9 for r in rows]
            print(f"{a.layers} layers, {fmt} experts{', trace ' + Path(a.trace).stem if a.trace else ''}, VRAM tier {a.vram_frac:.2f} of the {bank_bytes / 1e9:.1f} GB bank "
                  f"over pinned host (pinned: {ex.pinned}), arm {arm}: {1 / med:.1f} tok/s ({1e3 * med:.2f} ms per "
                  f"token, rounds {', '.join(f'{1e3 * m:.2f}' for m in meds)}); {up / 1e6:.1f} MB copied on demand + "
                  f"{pf / 1e6:.1f} MB prefetched per token (prefetched records used: {100 * used:.0f}%), "
                  f"{statistics.median(r[5] for r in rows):.1f} copies per token; link bound at 55 GB/s for the "
                  f"demand bytes {55e9 / max(up, 1):.0f} tok/s ({up / med / 55e9 * 100:.1f}% of it); link during "
                  f"copies {', '.join(f'{x:.1f}' for x in link)} GB/s", flush=True)


@torch.inference_mode()
def peer_transformers(src: Path, n: int, gpu_bytes: int = 0) -> None:
    """transformers' own Qwen3-MoE on the same release, bf16 on the GPU, greedy decode after the same prompt;
    gpu_bytes: accelerate's offload instead, at most that much on the GPU (the rest of the weights in host memory,
    moved up by its hooks as each module runs)."""
    import transformers
    t = time.perf_counter()
    place = dict(device_map="auto", max_memory={0: gpu_bytes, "cpu": 200 << 30}) if gpu_bytes else \
        dict(device_map="cuda")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, **place)
    print(f"transformers {transformers.__version__} loaded in {time.perf_counter() - t:.0f} s", flush=True)
    ids = torch.arange(3, 35, device="cuda")[None]
    out = model(ids, use_cache=True)
    pkv, steps = out.past_key_values, []
    for i in range(n + 8):
        nxt = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(nxt, past_key_values=pkv, use_cache=True)
        torch.cuda.synchronize()
        pkv = out.past_key_values
        if i >= 8:
            steps.append(time.perf_counter() - t)
    med = statistics.median(steps)
    how = f"accelerate offload, {gpu_bytes / 2**30:.1f} GiB on the GPU" if gpu_bytes else "on the GPU"
    print(f"peer: transformers bf16 {how}, eager: {1 / med:.1f} tok/s ({1e3 * med:.2f} ms per token, "
          f"{len(steps)} steps)", flush=True)
    del model
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
