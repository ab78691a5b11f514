"""Tiny random Hugging Face checkpoints written by transformers' own save_pretrained (seeded, reproducible).

Weights are rounded to bf16 first, so that the default bf16 container holds them exactly and the engine
can be held to float32 accuracy against the oracle on the same weights.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.modules.setdefault("fla", None)   # the oracle must take transformers' pure-torch KDA paths on CPU

from waste.convert.synthetic import write_tokenizer  # noqa: E402

TOKENIZER_TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
                  "The quick brown fox jumps over the lazy dog. Hello, world! 0123456789 ") * 4
VOCAB = 384


def _randomise(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1 or "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * fan_in ** -0.5)
        for name, b in sorted(model.named_buffers()):
            if "e_score_correction_bias" in name:
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
            # A_log / dt_bias are parameters in transformers' Kimi-Linear and were randomised above
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
        for name, b in model.named_buffers():   # saved buffers only: rotary inv_freq is computed, not stored
            if "e_score_correction_bias" in name:
                b.copy_(b.to(torch.bfloat16).to(b.dtype))


def oracle_model(config, seed: int):
    """transformers' causal LM for `config` in float32 with eager attention and experts, its weights seeded and
    randomised (_randomise)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                         experts_implementation="eager").float().eval()
    _randomise(m, seed)
    return m


def qwen3_moe_model(seed: int = 0, **over):
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, mlp_only_layers=[0], rms_norm_eps=1e-6, max_position_embeddings=512,
              tie_word_embeddings=False, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    kw.update(over)
    m = oracle_model(Qwen3MoeConfig(**kw), seed)
    return m


def kimi_linear_model(seed: int = 0, **over):
    from transformers import KimiLinearConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=4,
              linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                  "kda_layers": [1, 2, 4], "full_attn_layers": [3, 5]},
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
              num_experts_per_token=2, num_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.446,
              pad_token_id=0, bos_token_id=1, eos_token_id=0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    kw.update(over)
    m = oracle_model(KimiLinearConfig(**kw), seed)
    return m


def save_release(model, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    write_tokenizer(dst, TOKENIZER_TEXT, vocab_size=300)
    return dst


def split_and_whole(model, ids: torch.Tensor, n_decode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ids as a prefill of all but the last n_decode tokens followed by one decode step each, and as one
    forward: equal when the cached state carries everything."""
    full = model.forward(ids, model.new_state(), 0)
    st, split = model.new_state(), len(ids) - n_decode
    parts = [model.forward(ids[:split], st, 0)] + [model.forward(ids[t:t + 1], st, t) for t in range(split, len(ids))]
    return torch.cat(parts), full


def greedy_pair(hf, engine, ids: torch.Tensor, n: int = 32) -> tuple[list[int], list[int]]:
    """transformers' and the engine's greedy continuations of ids, n tokens each, neither stopping at an eos."""
    from waste.quant.quality import greedy

    with torch.no_grad():
        ref = hf.generate(ids[None], max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    return ref, greedy(engine, ids.tolist(), n)


def chat_release(dst: Path, model, specials: list[str], template: Path, **tokenizer_config) -> dict[str, int]:
    """A release with a chat template at dst: a byte-level tokenizer whose `specials` are single tokens (the first
    the end of text; `tokenizer_config` merged into tokenizer_config.json), the model by its save_pretrained, and
    `template` as chat_template.jinja where that file exists. Returns the specials' ids."""
    import json
    import shutil

    dst.mkdir(parents=True)
    write_tokenizer(dst, TOKENIZER_TEXT, vocab_size=300, specials=specials)
    tc = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**tc, **tokenizer_config}))
    model.save_pretrained(dst)
    if template.is_file():
        shutil.copy(template, dst / "chat_template.jinja")
    return {v["content"]: int(k) for k, v in tc["added_tokens_decoder"].items()}


def mtp_layer(src: Path, n_layers: int, extra: tuple = (), config: dict | None = None) -> None:
    """What DeepSeek's and GLM's releases carry after the last decoder layer: the MTP module at
    model.layers.{n_layers} (a copy of the last layer plus `extra` (name, shape) tensors of ones); `config` merged
    into config.json."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(src / "model.safetensors"))
    last = f"model.layers.{n_layers - 1}."
    for k in [k for k in t if k.startswith(last)]:
        t[k.replace(last, f"model.layers.{n_layers}.")] = t[k].clone()
    for name, shape in extra:
        t[f"model.layers.{n_layers}.{name}"] = torch.ones(shape)
    save_file(t, str(src / "model.safetensors"))
    if config:
        import json

        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, **config}))


def converted(root: Path, hf, src: Path, name: str, **fmt) -> dict:
    """An oracle test's fixture: the release at src converted (bf16 experts and trunk unless `fmt` says) and
    loaded in float32 beside its transformers model; the caller closes d["eng"]."""
    import waste
    from waste.convert.convert import convert

    kw = {"experts": "bf16", "trunk": "bf16", **fmt}
    out = convert(src, root / f"{name}.waste", progress=False, **kw)
    return {"hf": hf, "src": src, "out": out, "eng": waste.load(out, dtype="float32"), "root": root}


def hf_routes(model, ids: torch.Tensor, router: str = "gate"):
    """transformers' all-position logits and the experts each MoE layer's router (`mlp.<router>`) chose."""
    routes, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, router):
            hooks.append(getattr(layer.mlp, router).register_forward_hook(
                lambda mod, inp, out, i=i: routes.__setitem__(i, out[2].clone())))
    return hooked_logits(model, ids, hooks), routes


def check_logits_and_routes(hf, model, ids: torch.Tensor, bound: float, moe_layers, name: str,
                            router: str = "gate") -> float:
    """All-position logits within `bound` relative L2 of transformers', the same experts on every MoE layer (exactly
    `moe_layers`) and token. Returns the error."""
    ref, ref_routes = hf_routes(hf, ids, router)
    logits, ours = routed_forward(model, ids)
    err = rel_l2(logits, ref)
    print(f"{name} logits rel L2 {err:.2e}")
    assert err < bound
    assert sorted(ours) == list(moe_layers)
    assert_same_routes(ours, ref_routes)
    return err


def check_split(model, ids: torch.Tensor, n_decode: int, bound: float, name: str) -> None:
    """A prefill then n_decode single-token steps equal one forward: within `bound`, the same argmax everywhere."""
    split, full = split_and_whole(model, ids, n_decode)
    print(f"{name} split {rel_l2(split, full):.2e}")
    assert rel_l2(split, full) < bound
    assert torch.equal(split.argmax(-1), full.argmax(-1))


def check_greedy(hf, engine, ids: torch.Tensor) -> None:
    """32 greedy tokens identical to transformers'."""
    ref, got = greedy_pair(hf, engine, ids)
    assert got == ref and len(ref) == 32


def hooked_logits(hf, ids: torch.Tensor, hooks: list) -> torch.Tensor:
    """The transformers model's all-position logits, run with its hooks in place, which are removed afterwards."""
    try:
        with torch.no_grad():
            return hf(ids[None]).logits[0]
    finally:
        for h in hooks:
            h.remove()


def routed_forward(model, ids: torch.Tensor):
    """One forward's all-position logits and the experts each MoE layer chose: {layer: [T, k] expert ids}."""
    model.route_trace = []
    try:
        logits = model.forward(ids, model.new_state(), 0)
        return logits, dict(model.route_trace)
    finally:
        model.route_trace = None


def assert_same_routes(ours: dict, ref: dict) -> None:
    """The same experts per layer and token, as sets (their order within a token changes nothing)."""
    assert sorted(ours) == sorted(ref) and ours
    for layer, idx in ours.items():
        for t in range(len(idx)):
            assert set(idx[t].tolist()) == set(ref[layer][t].tolist()), (layer, t)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    """n seeded token ids inside every fixture's vocabulary."""
    return torch.randint(3, 290, (n,), generator=torch.Generator().manual_seed(seed))


def engine_forward(engine, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """routed_forward on an engine's model."""
    return routed_forward(engine.model, ids)


def bpe_merges(text: str, pattern: str, n_merges: int, version1: bool = True) -> list[tuple[bytes, bytes]]:
    """Deterministic byte-level BPE training on text pre-split by pattern: most frequent pair, ties by the pair's
    bytes (the tests' tokenizers; tests/text/conftest.py and tests/k3_release.py)."""
    from collections import Counter

    import regex

    words = Counter(tuple(bytes([b]) for b in w.encode())
                    for w in regex.findall(pattern, text, flags=regex.V1 if version1 else 0))
    merges = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        new = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return merges
