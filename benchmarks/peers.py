"""waste against its peers on the same model and machine: llama.cpp (through llama-cpp-python) and transformers.

Each figure is waste's tok/s over the peer's, prefill and decode apart, measured in one run with the arms
interleaved (A, B, C, A, B, C, ...), each arm a fresh process, the same prompt token ids, the same number of
greedy tokens (EOS ignored), the same thread count; medians and ranges over the repeats, the load average
recorded beside each run, and the physical bound beside each figure:

- prefill: compute, 2 x active parameters x prompt tokens / the fp32 GEMM rate measured in this run (no AMX
  here: the fastest dense route on this CPU; int8/int4 kernels dequantize into it);
- resident decode: the bytes one token must read (trunk less the embedding table, plus top_k experts per MoE
  layer, in the arm's own format) / the memory bandwidth measured in this run (2-thread torch sum of 1 GiB);
- cold decode under a memory limit: trunk bytes / memory bandwidth + the expert bytes that miss / the disk's
  O_DIRECT bandwidth, a miss rate of 1 - budget / bank (uniform routing: the weights are seeded random).

Benchmark-only dependencies (NOT waste's dependencies, install them yourself):
    pip install llama-cpp-python==0.3.36 diskcache     # builds from the sdist: ~4.5 min on 2 cores
    pip install accelerate gguf                          # transformers' disk offload; GGUF tensor sizes for the bounds
llama.cpp's HF -> GGUF converter is not part of this repository: `gguf` below extracts it (convert_hf_to_gguf.py,
conversion/, gguf-py/) from the llama-cpp-python sdist into a temporary folder at run time:
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    python benchmarks/peers.py gguf SRC_DIR OUT_DIR --types bf16,q8_0,q4_0 \\
        --sdist /tmp/lcp/llama_cpp_python-0.3.36.tar.gz
Its tokenizer check hashes the pre-tokenizer's output; a byte-level BPE it does not know (waste's bundled
model, the synthetic releases) is mapped to llama.cpp's "gpt-2" pre-tokenizer by patching the extracted copy.
The prompt is given to every engine as token ids, so tokenization never enters the timings.

    python benchmarks/peers.py compare --tokenizer SRC/tokenizer.json --src SRC --repeat 3 -n 64 --prompt-len 128 \\
        --arm waste=/tmp/m_q4.waste --arm llama=/tmp/m-q4_0.gguf --arm hf=SRC [--laptop 1100M] [--json OUT]

Every waste arm is set over every peer arm (ratio = waste tok/s / peer tok/s). Arm labels: `waste@1` runs that arm
on 1 thread, `+passive` with OMP_WAIT_POLICY=PASSIVE, `+bf16` with waste's --dtype bfloat16 (diagnostics).
`--laptop SIZE` runs every arm cold under ../shared/tools/laptop (drop caches, a memory cgroup of SIZE) with
waste's budget planned for it and llama.cpp reading through mmap.
`--feed random` feeds every arm's decode steps the same seeded random tokens (its greedy tokens are still
reported): a random-weight model's greedy output repeats one token, whose experts then always hit the cache.
docs/LEARNED.md §7 has the results and the exact commands. Nothing here is a test.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
BENCH_TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
              "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
              "The expert cache keeps the most useful experts in memory and reads the rest from disk. ")


# ----------------------------------------------------------------------------------------------- GGUF conversion
def extract_converter(sdist: Path, dst: Path) -> Path:
    """Extracts llama.cpp's converter from the sdist into dst and patches the copy's pre-tokenizer check."""
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name and (
            m.name.endswith("/convert_hf_to_gguf.py") or "/vendor/llama.cpp/conversion/" in m.name
            or "/vendor/llama.cpp/gguf-py/" in m.name)]
        tf.extractall(dst, members=members, filter="data")
    root = next(dst.glob("*/vendor/llama.cpp"))
    base = root / "conversion" / "base.py"
    text = base.read_text()
    hook = "        if res is None:\n            logger.warning(\"\\n\")"
    assert hook in text, "the converter's pre-tokenizer check moved: update the patch"
    base.write_text(text.replace(hook, "        if res is None and os.environ.get('PEERS_GGUF_PRE'):\n"
                                       "            res = os.environ['PEERS_GGUF_PRE']\n" + hook, 1))
    return root


def gguf(src: Path, out: Path, types: list[str], sdist: Path, pre: str = "gpt-2") -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    made = []
    with tempfile.TemporaryDirectory(prefix="peers-conv-") as tmp:
        root = extract_converter(sdist, Path(tmp))
        env = dict(os.environ, PEERS_GGUF_PRE=pre, PYTHONPATH=f"{root / 'gguf-py'}:{root}")
        base_type = "bf16" if "bf16" in types else "f16"
        base = out / f"{src.name}-{base_type}.gguf"
        if not base.is_file():
            subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(src), "--outfile", str(base),
                            "--outtype", base_type], env=env, check=True)
        made.append(base)
    if not json.loads((src / "tokenizer.json").read_text())["model"].get("merges"):
        add_dummy_merge(base)
    if all(t == base_type for t in types):
        return made
    import llama_cpp

    ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
             "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}
    for t in types:
        if t == base_type:
            continue
        dst = out / f"{src.name}-{t}.gguf"
        if not dst.is_file():
            p = llama_cpp.llama_model_quantize_default_params()
            p.ftype, p.nthread = ftype[t], 2
            t0 = time.time()
            rc = llama_cpp.llama_model_quantize(str(base).encode(), str(dst).encode(), p)
            if rc != 0:
                raise SystemExit(f"llama_model_quantize -> {t} failed ({rc})")
            print(f"quantized {dst} in {time.time() - t0:.0f} s", flush=True)
        made.append(dst)
    return made


def add_dummy_merge(path: Path) -> None:
    """llama.cpp refuses a BPE vocabulary without merges (the synthetic releases' byte-level tokenizer has none):
    rewrite the file with one merge. The prompt is given as ids, so the merge never takes part."""
    import gguf as g
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = g.GGUFReader(str(path))
    if "tokenizer.ggml.merges" in reader.fields:
        return
    tmp = path.with_suffix(".merges.tmp")
    arch = reader.fields["general.architecture"]
    writer = g.GGUFWriter(str(tmp), arch=bytes(arch.parts[arch.data[0]]).decode(), endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {"tokenizer.ggml.merges": MetadataDetails(
        g.GGUFValueType.ARRAY, ["\u0120 \u0120"], sub_type=g.GGUFValueType.STRING)}, [])
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------- arms (one process)
def arm_waste(path, ids, n, threads, budget, resident, dtype="auto", feed=None):
    import torch

    from waste.engine import Engine

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    eng = Engine.load(path, budget=budget, preload=resident, dtype=dtype)
    if resident:
        eng.experts.wait_fill()
    load = time.perf_counter() - t0
    model, cache = eng.model, eng.experts

    def run(ids, n):
        state = model.new_state()
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = model.forward(torch.tensor(ids), state, 0, last_only=True)[-1]
            t1 = time.perf_counter()
            pos, out = len(ids), []
            for i in range(n):
                nxt = int(torch.argmax(logits))
                out.append(nxt)
                nxt = nxt if feed is None else feed[i]
                logits = model.forward(torch.tensor([nxt]), state, pos, last_only=True)[-1]
                pos += 1
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out

    if resident:
        run(ids[:8], 2)                       # warm-up (kernels, allocator), as for every arm
    s = cache.stats
    h0, m0, b0 = s.hits, s.misses, s.bytes_read
    pre, dec, out = run(ids, n)
    return {"load_s": load, "prefill_s": pre, "decode_s": dec, "tokens": out[:16],
            "budget_bytes": cache.budget_bytes, "bank_bytes": eng.plan.bank_bytes,
            "misses": s.misses - m0, "hits": s.hits - h0, "bytes_read": s.bytes_read - b0}


def arm_llama(path, ids, n, threads, resident, feed=None):
    import numpy as np
    from llama_cpp import Llama

    import llama_cpp.llama_cpp as ll

    if not resident:                         # no repacked copy in anonymous memory: every weight read through the mmap
        default = ll.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p
        ll.llama_model_default_params = params
    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=len(ids) + n + 16, n_batch=max(512, len(ids)), n_ubatch=max(512, len(ids)),
                n_threads=threads, n_threads_batch=threads, use_mmap=True, verbose=False)
    load = time.perf_counter() - t0
    nv = llm.n_vocab()

    def run(ids, n):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        out = []
        for i in range(n):
            nxt = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(nv,))))
            out.append(nxt)
            llm.eval([nxt if feed is None else feed[i]])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out

    if resident:
        run(ids[:8], 2)
    pre, dec, out = run(ids, n)
    return {"load_s": load, "prefill_s": pre, "decode_s": dec, "tokens": out[:16], "extra_bufts": resident}


def arm_hf(path, ids, n, threads, offload_dir, max_memory):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    if offload_dir:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="auto",
                                                     max_memory={"cpu": max_memory}, offload_folder=offload_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    load = time.perf_counter() - t0

    def run(ids, n):
        with torch.inference_mode():
            t0 = time.perf_counter()
            o = model(input_ids=torch.tensor([ids]), use_cache=True)
            t1 = time.perf_counter()
            past, logits, out = o.past_key_values, o.logits[0, -1], []
            for _ in range(n):
                nxt = int(torch.argmax(logits))
                out.append(nxt)
                o = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past, logits = o.past_key_values, o.logits[0, -1]
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out

    if not offload_dir:
        run(ids[:8], 2)
    pre, dec, out = run(ids, n)
    return {"load_s": load, "prefill_s": pre, "decode_s": dec, "tokens": out[:16]}


def arm_main(a):
    ids = json.loads(Path(a.ids).read_text())
    feed = None
    if isinstance(ids, dict):          # compare --feed random: the prompt and the tokens each decode step is fed
        ids, feed = ids["prompt"], ids["feed"]
    if feed is not None and a.engine == "hf":
        raise SystemExit("--feed random: the hf arm feeds its greedy tokens only")
    if a.engine == "waste":
        r = arm_waste(a.model, ids, a.n, a.threads, a.budget, not a.cold, a.dtype, feed)
    elif a.engine == "llama":
        r = arm_llama(a.model, ids, a.n, a.threads, not a.cold, feed)
    else:
        r = arm_hf(a.model, ids, a.n, a.threads, a.offload_dir, a.max_memory)
    r.update(prompt=len(ids), n=a.n)
    print("PEERS_RESULT " + json.dumps(r), flush=True)


# -------------------------------------------------------------------------------------------- sizes and bounds
def bytes_per_token(engine: str, path: str) -> tuple[int, int, int]:
    """(trunk bytes read per token without the embedding table, expert bytes per token, bank bytes)."""
    if engine == "waste":
        info = json.loads(subprocess.run([sys.executable, "-m", "waste", "info", path, "--json"], capture_output=True,
                                         text=True, check=True).stdout)
        vocab, hidden, top_k = _vocab_hidden(path)
        p = info["params"]
        trunk = int(info["trunk_bytes"] * (p["trunk"] - vocab * hidden) / p["trunk"])
        return trunk, info["moe_layers"] * top_k * info["record_bytes"], info["bank_bytes"]
    sizes = []
    if engine == "llama":
        from gguf import GGUFReader

        r = GGUFReader(path)
        sizes = [(t.name, int(t.n_bytes)) for t in r.tensors]
        top_k = int(next(f for k, f in r.fields.items() if k.endswith("expert_used_count")).parts[-1][0])
        n_exp = int(next(f for k, f in r.fields.items() if k.endswith(".expert_count")).parts[-1][0])
        emb, exp = "token_embd", "_exps"
    else:
        from safetensors import safe_open

        cfg = json.loads((Path(path) / "config.json").read_text())
        top_k, n_exp = cfg["num_experts_per_tok"], cfg["num_experts"]
        for f in Path(path).glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                for k in sf.keys():
                    sl = sf.get_slice(k)
                    numel = 1
                    for d in sl.get_shape():
                        numel *= d
                    sizes.append((k, numel * 2))
        emb, exp = "embed_tokens", ".experts."
    trunk = sum(b for k, b in sizes if emb not in k and exp not in k)
    bank = sum(b for k, b in sizes if exp in k)
    return trunk, bank * top_k // n_exp, bank


def _vocab_hidden(waste_path):
    m = json.loads((Path(waste_path) / "manifest.json").read_text())
    c = m.get("config", m)
    return c["vocab_size"], c["hidden_size"], c["moe"]["top_k"]


def measure_machine(threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(1 << 28)                        # 1 GiB of float32
    x.sum()
    t = min(_timed(lambda: x.sum()) for _ in range(5))
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    g = min(_timed(lambda: a @ b) for _ in range(5))
    return {"mem_gb_per_s": x.numel() * 4 / t / 1e9, "gemm_gflop_per_s": 2 * 2048 ** 3 / g / 1e9}


def _timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def disk_bandwidth(waste_path: str) -> float:
    from waste.container import open_container
    from waste.runtime.bankio import measure_direct_bandwidth

    c = open_container(waste_path)
    try:
        bank = max(c.banks.values(), key=lambda b: b.num_experts * b.record_bytes)
        return measure_direct_bandwidth(bank, 2.0)[0] / 1e9
    finally:
        c.close()


# ------------------------------------------------------------------------------------------------------ compare
def compare(a) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(a.tokenizer)
    ids = []
    while len(ids) < a.prompt_len:
        ids += tok.encode(BENCH_TEXT).ids
    ids = ids[:a.prompt_len]
    ids_file = Path(tempfile.mkstemp(prefix="peers-ids-", suffix=".json")[1])
    if a.feed == "random":   # distinct tokens: a random model's greedy output repeats one token, and its experts
        rng = random.Random(0)
        feed = [rng.randrange(tok.get_vocab_size()) for _ in range(a.n)]
        ids_file.write_text(json.dumps({"prompt": ids, "feed": feed}))
    else:
        ids_file.write_text(json.dumps(ids))
    arms = [tuple(s.split("=", 1)) for s in a.arm]
    machine = measure_machine(a.threads)
    wpath = next(p for e, p in arms if e.startswith("waste"))
    info = json.loads(subprocess.run([sys.executable, "-m", "waste", "info", wpath, "--json"], capture_output=True,
                                     text=True, check=True).stdout)
    active = info["params"]["active"]
    if a.laptop:
        machine["disk_gb_per_s"] = disk_bandwidth(wpath)
    print(f"machine: {json.dumps(machine)}; active params {active / 1e6:.1f} M; prompt {len(ids)} tok, "
          f"decode {a.n} tok, {a.threads} threads", flush=True)
    sizes = {f"{e}={p}": bytes_per_token(e.split("@")[0].split("+")[0], p) for e, p in arms}
    runs = {f"{e}={p}": [] for e, p in arms}
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads),
               OPENBLAS_NUM_THREADS="1")
    for rep in range(a.repeat):
        for e, p in arms:
            label, e = e, e.split("@")[0].split("+")[0]    # the label's modifiers: see the docstring
            threads = int(label.split("@")[1].split("+")[0]) if "@" in label else a.threads
            arm_env = dict(env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
            if "+passive" in label:
                arm_env["OMP_WAIT_POLICY"] = "PASSIVE"
            cmd = [sys.executable, __file__, "arm", "--engine", e, "--model", p, "--ids", str(ids_file), "-n", str(a.n),
                   "--threads", str(threads)] + (["--dtype", "bfloat16"] if "+bf16" in label else [])
            if a.laptop:
                cmd += ["--cold"]
                if e == "waste" and a.budget:  # noqa
                    cmd += ["--budget", a.budget]
                if e == "hf":
                    if not a.hf_offload:
                        continue
                    off = tempfile.mkdtemp(prefix="peers-offload-")
                    cmd += ["--offload-dir", off, "--max-memory", a.hf_offload]
                cmd = [str(SHARED / "tools" / "laptop"), "--drop-caches", a.laptop, "--"] + cmd
            load = os.getloadavg()[0]
            pr = subprocess.run(cmd, capture_output=True, text=True, env=arm_env, timeout=a.timeout)
            line = next((l for l in pr.stdout.splitlines() if l.startswith("PEERS_RESULT ")), None)
            if line is None:
                print(f"  {e} failed ({pr.returncode}): {pr.stderr[-1500:]}", flush=True)
                continue
            r = json.loads(line[len("PEERS_RESULT "):])
            r["load_avg_before"] = load
            r["load_avg_after"] = os.getloadavg()[0]
            r["laptop"] = pr.stderr.strip().splitlines()[-1] if a.laptop and pr.stderr.strip() else None
            r["prefill_tps"] = len(ids) / r["prefill_s"]
            r["decode_tps"] = a.n / r["decode_s"]
            runs[f"{label}={p}"].append(r)
            print(f"  rep {rep} {label:<13} prefill {r['prefill_tps']:8.1f} tok/s  decode {r['decode_tps']:7.2f} "
                  f"tok/s  load avg {load:.2f}  first tokens {r['tokens'][:8]}"
                  + (f"  | {r['laptop']}" if r["laptop"] else ""), flush=True)
            if e == "hf" and a.laptop and "--offload-dir" in cmd:
                shutil.rmtree(cmd[cmd.index("--offload-dir") + 1], ignore_errors=True)
    ids_file.unlink()
    # bounds and the table
    flops_tok = 2 * active
    pre_bound = machine["gemm_gflop_per_s"] * 1e9 / flops_tok
    out = {"machine": machine, "active_params": active, "prompt": len(ids), "n": a.n, "threads": a.threads,
           "feed": a.feed,
           "laptop": a.laptop, "arms": {}}
    for key, rs in runs.items():
        e = key.split("=", 1)[0].split("@")[0].split("+")[0]
        trunk, exp_tok, bank = sizes[key]
        if a.laptop and e == "waste" and rs:
            budget = rs[0]["budget_bytes"]
            miss = max(0.0, 1 - budget / bank)
            dec_bound = 1 / (trunk / (machine["mem_gb_per_s"] * 1e9)
                             + miss * exp_tok / (machine["disk_gb_per_s"] * 1e9))
        elif a.laptop:
            dec_bound = None
        else:
            dec_bound = machine["mem_gb_per_s"] * 1e9 / (trunk + exp_tok)
        summ = {"bytes_per_token": trunk + exp_tok, "prefill_bound_tps": pre_bound, "decode_bound_tps": dec_bound,
                "runs": rs}
        for ph in ("prefill", "decode"):
            v = [r[f"{ph}_tps"] for r in rs]
            summ[ph] = {"median": statistics.median(v), "min": min(v), "max": max(v)} if v else None
        out["arms"][key] = summ
    print(f"\n{'arm':<60} {'prefill tok/s (range)':>26} {'bound':>8} {'decode tok/s (range)':>24} {'bound':>8}")
    for key, s in out["arms"].items():
        if not s["prefill"]:
            print(f"{key:<60} no result")
            continue
        p, d = s["prefill"], s["decode"]
        db = f"{s['decode_bound_tps']:.1f}" if s["decode_bound_tps"] else "-"
        print(f"{key[-60:]:<60} {p['median']:9.1f} ({p['min']:.1f}-{p['max']:.1f}) {s['prefill_bound_tps']:8.0f} "
              f"{d['median']:8.2f} ({d['min']:.2f}-{d['max']:.2f}) {db:>8}")
    keys = [k for k, s in out["arms"].items() if s["prefill"]]
    for wk in [k for k in keys if k.startswith("waste")]:
        w = out["arms"][wk]
        for key in [k for k in keys if not k.startswith("waste")]:
            s = out["arms"][key]
            rp = w["prefill"]["median"] / s["prefill"]["median"]
            rd = w["decode"]["median"] / s["decode"]["median"]
            out.setdefault("ratios", {})[f"{wk} / {key}"] = {"prefill": rp, "decode": rd}
            print(f"ratio {wk} / {key}: prefill {rp:.2f}x, decode {rd:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gguf", help="convert an HF release to GGUF with the converter from the llama-cpp-python sdist")
    g.add_argument("src")
    g.add_argument("out")
    g.add_argument("--types", default="bf16,q8_0,q4_0")
    g.add_argument("--sdist", default="/tmp/lcp/llama_cpp_python-0.3.36.tar.gz")
    g.add_argument("--pre", default="gpt-2", help="llama.cpp pre-tokenizer for an unrecognized byte-level BPE")
    r = sub.add_parser("arm", help="one measurement in this process (compare runs these)")
    r.add_argument("--engine", choices=["waste", "llama", "hf"], required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--ids", required=True)
    r.add_argument("-n", type=int, default=64)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--budget")
    r.add_argument("--dtype", default="auto", help="waste's compute dtype")
    r.add_argument("--cold", action="store_true")
    r.add_argument("--offload-dir")
    r.add_argument("--max-memory")
    c = sub.add_parser("compare", help="interleaved arms, medians, bounds and ratios")
    c.add_argument("--tokenizer", required=True)
    c.add_argument("--src", required=True, help="the HF release (config)")
    c.add_argument("--arm", action="append", required=True, help="ENGINE=PATH, ENGINE in waste, llama, hf")
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("-n", type=int, default=64)
    c.add_argument("--prompt-len", type=int, default=128)
    c.add_argument("--feed", choices=["greedy", "random"], default="greedy",
                   help="each decode step takes the arm's greedy token, or the same seeded random tokens in every arm "
                        "(cold runs of a random-weight model: its greedy output repeats one token and hits the cache)")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--laptop", help="memory limit: every arm cold under ../shared/tools/laptop")
    c.add_argument("--budget", help="waste's expert budget under --laptop (default: planned)")
    c.add_argument("--hf-offload", help="under --laptop: run the hf arm with accelerate disk offload, max cpu memory")
    c.add_argument("--timeout", type=float, default=900)
    c.add_argument("--json")
    a = ap.parse_args()
    if a.what == "gguf":
        for p in gguf(Path(a.src), Path(a.out), a.types.split(","), Path(a.sdist), a.pre):
            print(p)
    elif a.what == "arm":
        arm_main(a)
    else:
        compare(a)


if __name__ == "__main__":
    main()
