"""Train the bundled tiny Qwen3-MoE code model, end to end, into one output folder.

    python3 training/train.py --out RUN_DIR --corpus CORPUS.tar.xz [--budget-min 6.5] [--max-epochs 20] [--finalize-partial]
    python3 training/train.py --out PREP_DIR --corpus CORPUS.tar.xz --prepare-only   # stages 1-3 only (CPU)

Stages (each skipped when its output already exists in RUN_DIR, so the same command resumes):
  1. corpus     : the .py files (prepare_corpus.py) -> RUN_DIR/corpus/{manifest.tsv,summary.json}
  2. tokenizer  : byte-level BPE trained on the train split with `tokenizers` -> RUN_DIR/model/tokenizer.json
                  (skipped when RUN_DIR/model/tokenizer.json exists: gpu_slice_v2.sh copies in the one trained
                  with --prepare-only on a CPU machine, which saves GPU time)
  3. tokens     : each split encoded, files joined by <|endoftext|> -> RUN_DIR/tokens_{split}.npy; also
                  test_stdlib, the standard-library files of the test split (the first corpus's test split)
  4. train      : Qwen3MoeForCausalLM from transformers, bf16 weights with fp32 master copy and AdamW,
                  cosine schedule, per-layer Switch load-balancing loss; checkpoint RUN_DIR/ckpt.pt every
                  --ckpt-every-s seconds and at the end of the budget; keeps the weights of the best
                  validation loss
  5. evaluate   : held-out (test split) loss/perplexity/bits per byte, also on test_stdlib; routing trace,
                  expert load per layer, LRU expert-cache hit rates per layer at several budgets; greedy
                  samples in bf16 on the training device and in float32 on the CPU; with --compare-model,
                  the same held-out bits per byte for another HF model folder (with its own tokenizer)
  6. export     : RUN_DIR/model/ in HF format (model.safetensors bf16, config.json, generation_config.json,
                  tokenizer.json, tokenizer_config.json) and RUN_DIR/record.json

The number of optimizer steps is fixed on the first invocation: --steps if given, else the smaller of
--max-epochs worth of tokens and what the measured step time allows inside --budget-min (and before
--train-until-s seconds after the script started, when given). A later
invocation with the same RUN_DIR resumes from ckpt.pt with that same step count. When the budget runs
out first, the checkpoint is saved and the script exits with status 3 (run it again to continue), or,
with --finalize-partial, it evaluates and exports what it has.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prepare_corpus  # noqa: E402

EOT = "<|endoftext|>"
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------- stages 1-3
def stage_corpus(run: str, root: str | None, max_files: int | None) -> dict:
    cdir = os.path.join(run, "corpus")
    corpus = prepare_corpus.collect(root, max_files=max_files)
    s = prepare_corpus.summary(corpus)
    if os.path.exists(os.path.join(cdir, "summary.json")):
        old = json.load(open(os.path.join(cdir, "summary.json")))
        if old["all"]["sha256_of_path_sha256_list"] != s["all"]["sha256_of_path_sha256_list"]:
            raise SystemExit("the stdlib here differs from the one this run started on; use a new --out")
    os.makedirs(cdir, exist_ok=True)
    with open(os.path.join(cdir, "manifest.tsv"), "w") as f:
        f.write(prepare_corpus.manifest_tsv(corpus))
    with open(os.path.join(cdir, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    log(f"corpus: {s['all']['files']} files, {s['all']['bytes']/1e6:.2f} MB "
        f"(train {s['train']['files']}, val {s['val']['files']}, test {s['test']['files']}) from {s['read_from']} (Python {s.get('python_version')})")
    return corpus


def stage_tokenizer(run: str, corpus: dict, vocab_size: int, ctx: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    mdir = os.path.join(run, "model")
    path = os.path.join(mdir, "tokenizer.json")
    if os.path.exists(path):
        tok = Tokenizer.from_file(path)
        log(f"tokenizer: reused {path} (vocab {tok.get_vocab_size()})")
        return tok
    os.makedirs(mdir, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = prepare_corpus.split_texts(corpus, "train")
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.save(path)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": EOT, "pad_token": EOT, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": ctx,
    }
    with open(os.path.join(mdir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    log(f"tokenizer: trained byte-level BPE, vocab {tok.get_vocab_size()}, eot id {tok.token_to_id(EOT)}")
    return tok


SPLITS = {"train": ("train", None), "val": ("val", None), "test": ("test", None), "test_stdlib": ("test", "stdlib")}


def encode_texts(tok, texts: list[str]) -> np.ndarray:
    """Each text encoded and followed by <|endoftext|>, concatenated."""
    eot = np.asarray([tok.token_to_id(EOT)], dtype=np.int32)
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(eot)
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def split_bytes(corpus: dict, name: str) -> int:
    sp, src = SPLITS[name]
    return sum(f["bytes"] for f in corpus["files"] if f["split"] == sp and (src is None or f["source"] == src))


def stage_tokens(run: str, corpus: dict, tok) -> dict:
    out = {}
    for name, (sp, src) in SPLITS.items():
        path = os.path.join(run, f"tokens_{name}.npy")
        if not os.path.exists(path):
            np.save(path, encode_texts(tok, prepare_corpus.split_texts(corpus, sp, src)))
        out[name] = np.load(path)
    nbytes = {sp: split_bytes(corpus, sp) for sp in out}
    log("tokens: " + ", ".join(f"{sp} {len(v):,} ({nbytes[sp] / max(1, len(v)):.2f} bytes/token)" for sp, v in out.items()))
    return out


# ----------------------------------------------------------------------------------------- model
def make_config(a, vocab_size: int, eot: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 3,  # dense MLP size: unused (every layer is MoE)
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        hidden_act="silu",
        max_position_embeddings=a.max_pos,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
        attention_bias=False,
        use_sliding_window=False,
        decoder_sparse_step=1,
        moe_intermediate_size=a.moe_inter,
        num_experts_per_tok=a.top_k,
        num_experts=a.experts,
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=a.aux_coef,
        mlp_only_layers=[],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )


def build_model(cfg, device):
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(cfg)
    model.to(device=device, dtype=torch.bfloat16)
    return model


def count_params(cfg, model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    per_expert = expert // (cfg.num_experts * cfg.num_hidden_layers)
    emb = model.model.embed_tokens.weight.numel()
    active = total - expert + per_expert * cfg.num_experts_per_tok * cfg.num_hidden_layers
    return {"total": total, "experts": expert, "per_expert": per_expert, "trunk": total - expert,
            "active_per_token": active, "active_per_token_excluding_embedding": active - emb}


def per_layer_balance_loss(router_logits, top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, computed per layer and averaged (1.0 when balanced)."""
    losses = []
    for lg in router_logits:
        probs = torch.softmax(lg.float(), dim=-1)
        e = probs.shape[-1]
        idx = torch.topk(probs, top_k, dim=-1).indices
        frac = torch.zeros(e, device=lg.device).scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel(), device=lg.device))
        frac = frac / idx.numel()
        losses.append(e * (frac * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def lr_at(step: int, a, total: int) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    p = min(1.0, (step - a.warmup) / max(1, total - a.warmup))
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * p))


@torch.no_grad()
def eval_loss(model, tokens: np.ndarray, ctx: int, device, batch: int = 16, trace: bool = False):
    """Mean next-token loss over non-overlapping ctx windows of `tokens` (last partial window kept).

    With trace=True, also returns the routing trace: int16 array [n_tokens, layers, top_k] in text order."""
    model.eval()
    t = torch.from_numpy(tokens.astype(np.int64))
    windows = [t[i:i + ctx] for i in range(0, len(t) - 1, ctx)]
    windows = [w for w in windows if len(w) >= 2]
    captured = []
    hooks = []
    if trace:
        for layer in model.model.layers:
            hooks.append(layer.mlp.gate.register_forward_hook(lambda m, i, o: captured.append(o[2].detach())))
    tot_loss, tot_n, traces = 0.0, 0, []
    try:
        for b in range(0, len(windows), batch):
            group = windows[b:b + batch]
            lens = {len(w) for w in group}
            subgroups = [group] if len(lens) == 1 else [[w] for w in group]
            for sg in subgroups:
                x = torch.stack(sg).to(device)
                captured.clear()
                logits = model(input_ids=x, use_cache=False).logits
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1),
                                       reduction="sum")
                tot_loss += loss.item()
                tot_n += x[:, 1:].numel()
                if trace:
                    # each captured: [B*L, k]; stack layers -> [B*L, layers, k]
                    tr = torch.stack(captured, dim=1).reshape(x.shape[0] * x.shape[1], len(captured), -1)
                    traces.append(tr.to(torch.int16).cpu())
    finally:
        for h in hooks:
            h.remove()
        model.train()
    mean = tot_loss / max(1, tot_n)
    if trace:
        return mean, torch.cat(traces).numpy()
    return mean


# ----------------------------------------------------------------------------------------- cache sim
def lru_hit_rate(seq: np.ndarray, budget: int) -> tuple[float, float]:
    """seq: [n_tokens, k] expert ids of one layer. Per token, the k experts are looked up against the
    cache as it stood before that token, then become most-recent; least-recent are evicted down to
    `budget`. Returns (hit rate over all lookups, mean misses per token)."""
    cache: OrderedDict = OrderedDict()
    hits = lookups = 0
    for row in seq.tolist():
        for e in row:
            lookups += 1
            if e in cache:
                hits += 1
        for e in row:
            cache[e] = None
            cache.move_to_end(e)
        while len(cache) > budget:
            cache.popitem(last=False)
    return hits / max(1, lookups), (lookups - hits) / max(1, len(seq))


def _sim_job(args):
    seq, budget = args
    return lru_hit_rate(seq, budget)


def cache_simulation(trace: np.ndarray, num_experts: int, top_k: int) -> dict:
    budgets = sorted({top_k, 2 * top_k, 4 * top_k, num_experts // 2, (3 * num_experts) // 4} - {0})
    budgets = [b for b in budgets if top_k <= b <= num_experts]
    n_layers = trace.shape[1]
    jobs = [(np.ascontiguousarray(trace[:, l, :]), b) for b in budgets for l in range(n_layers)]
    try:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
            res = pool.map(_sim_job, jobs)
    except Exception:  # noqa: BLE001 - no fork here: do it serially
        res = [_sim_job(j) for j in jobs]
    out = {"tokens": int(trace.shape[0]), "budgets": {}}
    i = 0
    for b in budgets:
        per_layer = []
        for _ in range(n_layers):
            per_layer.append(res[i][0])
            i += 1
        out["budgets"][str(b)] = {"experts_per_layer": b, "fraction_of_experts": b / num_experts,
                                  "hit_rate_mean": float(np.mean(per_layer)),
                                  "hit_rate_per_layer": [round(float(h), 4) for h in per_layer],
                                  # with uniformly random routing an LRU cache of b holds any expert with p = b/E
                                  "uniform_random_routing_reference": round(b / num_experts, 4)}
    # temporal locality: fraction of a token's experts that the previous token also used, per layer
    reuse = []
    for l in range(n_layers):
        s = trace[:, l, :]
        prev = s[:-1]
        cur = s[1:]
        same = (cur[:, :, None] == prev[:, None, :]).any(-1).mean()
        reuse.append(round(float(same), 4))
    out["reuse_of_previous_token_experts_per_layer"] = reuse
    return out


# ----------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-min", type=float, default=6.5, help="wall-clock minutes for the training loop")
    ap.add_argument("--max-epochs", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=0, help="fixed number of optimizer steps (0: calibrate)")
    ap.add_argument("--finalize-partial", action="store_true")
    ap.add_argument("--train-until-s", type=float, default=0.0,
                    help="also stop the training loop this many seconds after the script started (0: no limit)")
    ap.add_argument("--prepare-only", action="store_true", help="stop after the corpus, tokenizer and token stages")
    ap.add_argument("--compare-model", default=None,
                    help="an HF model folder to evaluate on the same held-out text (bits per byte), e.g. the previous bundled model")
    ap.add_argument("--corpus", default=None,
                    help="tarball from prepare_corpus.py --pack, or a stdlib folder (default: this interpreter's "
                         "stdlib and the pinned packages)")
    ap.add_argument("--max-files", type=int, default=0, help="debug: cap the corpus")
    ap.add_argument("--seed", type=int, default=1234)
    # model
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=320)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=10)
    ap.add_argument("--kv-heads", type=int, default=5)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=96)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    # optimisation
    ap.add_argument("--ctx", type=int, default=1024, help="training sequence length")
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--ckpt-every-s", type=float, default=120.0)
    ap.add_argument("--sample-prompts", nargs="+", default=["def fibonacci(n):", "import os\n\ndef ", "class Stack:\n"],
                    help="greedy-sample prompts (escapes like \\n are decoded)")
    a = ap.parse_args(argv)

    run = os.path.abspath(a.out)
    os.makedirs(run, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import tokenizers
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                "numpy": np.__version__,
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu"}
    log(f"versions: {versions}")

    corpus = stage_corpus(run, a.corpus, a.max_files or None)
    tok = stage_tokenizer(run, corpus, a.vocab, a.max_pos)
    toks = stage_tokens(run, corpus, tok)
    split_nbytes = {sp: split_bytes(corpus, sp) for sp in SPLITS}
    heldout_texts = {sp: prepare_corpus.split_texts(corpus, *SPLITS[sp]) for sp in ("test", "test_stdlib")}
    del corpus
    if a.prepare_only:
        log("prepared; stopping (--prepare-only)")
        return 0
    eot = tok.token_to_id(EOT)
    vocab_size = tok.get_vocab_size()

    cfg = make_config(a, vocab_size, eot)
    torch.manual_seed(a.seed)
    model = build_model(cfg, device)
    params = count_params(cfg, model)
    log(f"model: {params}; experts_implementation={getattr(model.config, '_experts_implementation', '?')} "
        f"attn={getattr(model.config, '_attn_implementation', '?')}")

    names = [n for n, _ in model.named_parameters()]
    live = [p for _, p in model.named_parameters()]
    master = [p.detach().float().clone().requires_grad_(True) for p in live]
    decay = [m for n, m in zip(names, master) if m.ndim >= 2 and "norm" not in n]
    no_decay = [m for n, m in zip(names, master) if not (m.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    train_t = torch.from_numpy(toks["train"].astype(np.int64)).to(device)
    n_train = train_t.numel()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(a.seed)

    state = {"step": 0, "total_steps": a.steps or 0, "train_seconds": 0.0, "history": [], "val_history": [],
             "best_val": float("inf"), "best_step": -1, "invocations": 0}
    best_state = None
    ckpt_path = os.path.join(run, "ckpt.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        with torch.no_grad():
            for m, v in zip(master, ck["master"]):
                m.copy_(v)
            for p, m in zip(live, master):
                p.copy_(m)
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        state = ck["state"]
        best_state = ck.get("best_state")
        log(f"resumed from {ckpt_path} at step {state['step']}/{state['total_steps']}")
    state["invocations"] += 1

    def save_ckpt():
        tmp = ckpt_path + ".tmp"
        torch.save({"master": [m.detach() for m in master], "opt": opt.state_dict(), "gen": gen.get_state(),
                    "state": state, "best_state": best_state, "args": vars(a)}, tmp)
        os.replace(tmp, ckpt_path)

    def get_batch():
        starts = torch.randint(0, n_train - a.ctx - 1, (a.batch,), generator=gen)
        idx = starts[:, None] + torch.arange(a.ctx)[None, :]
        return train_t[idx.to(device)]

    tokens_per_step = a.batch * a.ctx
    max_steps_epochs = int(a.max_epochs * n_train / tokens_per_step)
    loop_t0 = time.time()      # start of this invocation's loop: the budget counts from here
    budget_s = a.budget_min * 60.0
    if a.train_until_s:
        budget_s = max(0.0, min(budget_s, T0 + a.train_until_s - loop_t0))
        log(f"training budget: {budget_s:.0f} s (--budget-min {a.budget_min}, --train-until-s {a.train_until_s})")
    seg_t0 = loop_t0           # start of the stretch not yet added to state["train_seconds"]
    last_ckpt = time.time()
    run_loss, run_aux, run_n = 0.0, 0.0, 0
    calib_t0 = None
    finished = False
    model.train()
    while True:
        step = state["step"]
        if state["total_steps"] and step >= state["total_steps"]:
            finished = True
            break
        if time.time() - loop_t0 > budget_s:
            break
        lr = lr_at(step, a, state["total_steps"] or max_steps_epochs)
        for g in opt.param_groups:
            g["lr"] = lr
        x = get_batch()
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        logits = out.logits
        lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        aux = per_layer_balance_loss(out.router_logits, cfg.num_experts_per_tok)
        loss = lm + a.aux_coef * aux
        loss.backward()
        with torch.no_grad():
            for m, p in zip(master, live):
                m.grad = p.grad.float()
                p.grad = None
            gn = torch.nn.utils.clip_grad_norm_(master, a.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch._foreach_copy_(live, master)
        state["step"] = step = step + 1
        run_loss += lm.detach()
        run_aux += aux.detach()
        run_n += 1
        # calibrate the step count on the first invocation: time steps 10..40
        if not state["total_steps"]:
            if step == 10:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                calib_t0 = time.time()
            elif step == 40:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = (time.time() - calib_t0) / 30
                te = time.time()
                eval_loss(model, toks["val"], a.ctx, device)  # time one validation pass
                t_eval = time.time() - te
                remaining = budget_s - (time.time() - loop_t0)
                fit = 40 + int(0.95 * remaining / (dt + t_eval / a.eval_every))
                state["total_steps"] = max(41, min(max_steps_epochs, fit))
                state["step_seconds"] = dt
                log(f"calibrated: {dt*1000:.1f} ms/step, {tokens_per_step/dt/1e3:.0f} k tok/s; "
                    f"validation pass {t_eval:.2f} s; {max_steps_epochs} steps = {a.max_epochs} epochs, "
                    f"{fit} fit the budget -> total {state['total_steps']}")
        if step % a.log_every == 0:
            avg = float(run_loss) / run_n
            state["history"].append({"step": step, "tokens": step * tokens_per_step, "lr": lr,
                                     "train_loss": round(avg, 4), "balance_loss": round(float(run_aux) / run_n, 4),
                                     "grad_norm": round(float(gn), 3),
                                     "seconds": round(state["train_seconds"] + time.time() - seg_t0, 1)})
            log(f"step {step}/{state['total_steps']} loss {avg:.4f} bal {float(run_aux)/run_n:.3f} lr {lr:.2e} gn {float(gn):.2f}")
            run_loss, run_aux, run_n = 0.0, 0.0, 0
        if step % a.eval_every == 0 or step == state["total_steps"]:
            vl = eval_loss(model, toks["val"], a.ctx, device)
            state["val_history"].append({"step": step, "epochs": round(step * tokens_per_step / n_train, 2),
                                         "val_loss": round(vl, 4)})
            if vl < state["best_val"]:
                state["best_val"], state["best_step"] = vl, step
                best_state = [p.detach().clone() for p in live]
            log(f"val step {step}: {vl:.4f} (best {state['best_val']:.4f} @ {state['best_step']})")
        if time.time() - last_ckpt > a.ckpt_every_s:
            now = time.time()
            state["train_seconds"] += now - seg_t0
            seg_t0 = now
            save_ckpt()
            last_ckpt = time.time()
    state["train_seconds"] += time.time() - seg_t0
    save_ckpt()
    if not finished and not a.finalize_partial:
        log(f"budget spent at step {state['step']}/{state['total_steps']}: checkpoint saved; run again to resume")
        return 3
    log(f"training {'finished' if finished else 'stopped (partial)'} at step {state['step']}, "
        f"{state['train_seconds']:.0f} s of training")

    # ------------------------------------------------------------------------------ evaluate
    final_val = eval_loss(model, toks["val"], a.ctx, device)
    final_test = eval_loss(model, toks["test"], a.ctx, device)
    if best_state is not None and final_val > state["best_val"]:
        with torch.no_grad():
            torch._foreach_copy_(live, best_state)
        chosen = {"step": state["best_step"], "why": "lowest validation loss"}
    else:
        chosen = {"step": state["step"], "why": "final step (validation loss no worse than the best periodic one)"}
    test_loss, trace = eval_loss(model, toks["test"], a.ctx, device, trace=True)
    std_loss, std_trace = eval_loss(model, toks["test_stdlib"], a.ctx, device, trace=True)
    val_loss = eval_loss(model, toks["val"], a.ctx, device)

    def bpb(loss, name):
        return round(loss * len(toks[name]) / math.log(2) / max(1, split_nbytes[name]), 4)

    log(f"chosen weights: step {chosen['step']}; held-out loss {test_loss:.4f} ppl {math.exp(test_loss):.2f} "
        f"{bpb(test_loss, 'test')} bits/byte; stdlib part {std_loss:.4f} ({bpb(std_loss, 'test_stdlib')} bits/byte)")
    E, K = cfg.num_experts, cfg.num_experts_per_tok

    def expert_load(tr):
        load = []
        for l in range(tr.shape[1]):
            c = np.bincount(tr[:, l, :].reshape(-1).astype(np.int64), minlength=E)
            load.append([round(float(v), 4) for v in c / c.sum()])
        return load

    load = expert_load(trace)
    np.save(os.path.join(run, "routing_trace_test.npy"), trace)
    sim = cache_simulation(trace, E, K)
    log("cache hit rates: " + ", ".join(f"{b}: {v['hit_rate_mean']:.3f}" for b, v in sim["budgets"].items()))
    sim_std = cache_simulation(std_trace, E, K)
    log("cache hit rates (stdlib test files): " + ", ".join(f"{b}: {v['hit_rate_mean']:.3f}" for b, v in sim_std["budgets"].items()))

    # ------------------------------------------------------------------------------ export
    mdir = os.path.join(run, "model")
    model.config.output_router_logits = False
    model.save_pretrained(mdir, safe_serialization=True)
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=False,
                     max_new_tokens=256).save_pretrained(mdir)
    cpath = os.path.join(mdir, "config.json")
    c = json.load(open(cpath))
    # the Qwen3-MoE releases name the expert count `num_experts`; transformers 5 writes `num_local_experts`;
    # older readers (llama.cpp's converter, transformers 4) want `rope_theta` at the top level
    c["num_experts"] = E
    c["num_local_experts"] = E
    c["rope_theta"] = a.rope_theta
    c["output_router_logits"] = False
    c["dtype"] = "bfloat16"
    c["torch_dtype"] = "bfloat16"
    with open(cpath, "w") as f:
        json.dump(dict(sorted(c.items())), f, indent=2)

    summary = json.load(open(os.path.join(run, "corpus", "summary.json")))
    record = {
        "versions": versions,
        "args": vars(a),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "corpus": summary,
        "tokens": {sp: int(len(v)) for sp, v in toks.items()},
        "bytes_per_token": {sp: round(split_nbytes[sp] / max(1, len(v)), 3) for sp, v in toks.items()},
        "tokenizer": {"vocab_size": vocab_size, "eot_id": eot,
                      "sha256": sha256_file(os.path.join(mdir, "tokenizer.json"))},
        "params": params,
        "config": {k: c[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                     "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                     "vocab_size", "max_position_embeddings", "norm_topk_prob", "rope_theta")},
        "training": {"steps": state["step"], "total_steps": state["total_steps"], "finished": finished,
                     "tokens_per_step": tokens_per_step, "tokens_seen": state["step"] * tokens_per_step,
                     "epochs": round(state["step"] * tokens_per_step / n_train, 2),
                     "train_seconds": round(state["train_seconds"], 1),
                     "step_seconds": state.get("step_seconds"), "invocations": state["invocations"],
                     "final_train_loss": state["history"][-1]["train_loss"] if state["history"] else None,
                     "loss_curve": state["history"], "val_curve": state["val_history"],
                     "best_val_loss": round(state["best_val"], 4), "best_step": state["best_step"]},
        "eval": {"chosen_weights": chosen,
                 "final_step_val_loss": round(final_val, 4), "final_step_test_loss": round(final_test, 4),
                 "val_loss": round(val_loss, 4), "heldout_test_loss": round(test_loss, 4),
                 "heldout_test_ppl": round(math.exp(test_loss), 3),
                 "heldout_test_bits_per_byte": bpb(test_loss, "test"),
                 "heldout_test_stdlib_loss": round(std_loss, 4),
                 "heldout_test_stdlib_ppl": round(math.exp(std_loss), 3),
                 "heldout_test_stdlib_bits_per_byte": bpb(std_loss, "test_stdlib"),
                 "expert_load_per_layer": load,
                 "expert_load_per_layer_test_stdlib": expert_load(std_trace),
                 "cache_simulation": sim,
                 "cache_simulation_test_stdlib": sim_std},
        "samples": {},
        "model_files": {},
        "wall_seconds_total_this_invocation": None,
    }

    def write_record():
        record["model_files"] = {fn: {"bytes": os.path.getsize(os.path.join(mdir, fn)),
                                      "sha256": sha256_file(os.path.join(mdir, fn)),}
                                 for fn in sorted(os.listdir(mdir))}
        record["wall_seconds_total_this_invocation"] = round(time.time() - T0, 1)
        with open(os.path.join(run, "record.json"), "w") as f:
            json.dump(record, f, indent=1)

    write_record()  # what matters is on disk before the extras below, any of which may fail
    log(f"wrote {mdir} and {os.path.join(run, 'record.json')}")

    # ------------------------------------------------------------------------------ extras
    prompts = [p.encode().decode("unicode_escape") for p in a.sample_prompts]

    def greedy(m, dev, label):
        out = {}
        for p in prompts:
            try:
                ids = tok.encode(p, add_special_tokens=False).ids
                x = torch.tensor([ids], device=dev)
                with torch.no_grad():
                    g = m.generate(input_ids=x, max_new_tokens=48, do_sample=False, eos_token_id=eot,
                                   pad_token_id=eot)
                out[p] = tok.decode(g[0].tolist(), skip_special_tokens=False)
                log(f"sample ({label}):\n{out[p]}\n----")
            except Exception as e:  # noqa: BLE001
                out[p] = f"FAILED: {e!r}"
                log(f"sample ({label}) failed: {e!r}")
        return out

    model.eval()
    record["samples"][f"bf16_{device.type}"] = greedy(model, device, f"bf16 on {device.type}")
    write_record()
    try:
        from transformers import AutoModelForCausalLM

        try:
            m32 = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32, attn_implementation="eager",
                                                       experts_implementation="eager").eval()
        except Exception:  # noqa: BLE001 - an older transformers without that keyword
            m32 = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
        record["samples"]["float32_cpu"] = greedy(m32, torch.device("cpu"), "float32 on cpu")
        del m32
    except Exception as e:  # noqa: BLE001
        log(f"float32 samples failed: {e!r}")
    write_record()

    if a.compare_model:
        try:
            from tokenizers import Tokenizer
            from transformers import AutoModelForCausalLM

            om = AutoModelForCausalLM.from_pretrained(a.compare_model, dtype=torch.bfloat16).to(device).eval()
            otok = Tokenizer.from_file(os.path.join(a.compare_model, "tokenizer.json"))
            cmp = {"model": a.compare_model, "dtype": "bfloat16", "device": device.type,
                   "config_sha256": sha256_file(os.path.join(a.compare_model, "config.json")),
                   "weights_sha256": sha256_file(os.path.join(a.compare_model, "model.safetensors"))}
            for name in ("test", "test_stdlib"):
                ot = encode_texts(otok, heldout_texts[name])
                ol = eval_loss(om, ot, a.ctx, device)
                cmp[name] = {"tokens": int(len(ot)), "loss": round(ol, 4), "ppl": round(math.exp(ol), 3),
                             "bits_per_byte": round(ol * len(ot) / math.log(2) / max(1, split_nbytes[name]), 4),
                             "this_model_bits_per_byte": bpb(test_loss if name == "test" else std_loss, name)}
            record["eval"]["compare_model"] = cmp
            log(f"compare {a.compare_model}: {json.dumps(cmp)}")
            del om
        except Exception as e:  # noqa: BLE001
            log(f"compare failed: {e!r}")
    write_record()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
