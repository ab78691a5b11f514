"""Synthetic releases: a byte-level tokenizer and seeded random checkpoints in the Hugging Face layout.

Used for the default model until a trained one is bundled, for tests that need a tokenizer, and for
benchmarks that need a large model shape without a download. Byte-for-byte reproducible for a seed.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_tokenizer_json(merges_text: str | None = None, vocab_size: int = 512, specials=SPECIALS) -> str:
    """A ByteLevel BPE tokenizer.json. With merges_text, BPE merges are trained on it (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([merges_text or ""], trainer=trainer)
    return tok.to_str()


def write_tokenizer(dst: Path, merges_text: str | None = None, vocab_size: int = 512, specials=SPECIALS) -> int:
    """Writes tokenizer.json + tokenizer_config.json; returns the vocabulary size. `specials` (the ChatML
    markers by default) become special tokens; the first is the end-of-sequence token."""
    from tokenizers import Tokenizer

    js = byte_level_tokenizer_json(merges_text, vocab_size, specials)
    (dst / "tokenizer.json").write_text(js)
    n = Tokenizer.from_str(js).get_vocab_size()
    added = {str(Tokenizer.from_str(js).token_to_id(s)): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                                            "normalized": False, "single_word": False} for s in specials}
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": specials[0], "pad_token": specials[0],
        "bos_token": None, "model_max_length": 4096, "added_tokens_decoder": added}, indent=1))
    return n


def qwen3_moe_config(**over) -> dict:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
           "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
           "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
           "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": 0, "attention_bias": False,
           "hidden_act": "silu", "torch_dtype": "bfloat16"}
    cfg.update(over)
    return cfg


def qwen3_moe_shapes(cfg: dict):
    """(name, shape) of every tensor of a Qwen3-MoE checkpoint, layer by layer."""
    H, I, MI = cfg["hidden_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    nh, kv, hd, E = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_experts"]
    yield "model.embed_tokens.weight", (cfg["vocab_size"], H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        layer = [(f"{p}.input_layernorm.weight", (H,)), (f"{p}.post_attention_layernorm.weight", (H,)),
                 (f"{p}.self_attn.q_proj.weight", (nh * hd, H)), (f"{p}.self_attn.k_proj.weight", (kv * hd, H)),
                 (f"{p}.self_attn.v_proj.weight", (kv * hd, H)), (f"{p}.self_attn.o_proj.weight", (H, nh * hd)),
                 (f"{p}.self_attn.q_norm.weight", (hd,)), (f"{p}.self_attn.k_norm.weight", (hd,))]
        if i in cfg["mlp_only_layers"]:
            layer += [(f"{p}.mlp.gate_proj.weight", (I, H)), (f"{p}.mlp.up_proj.weight", (I, H)),
                      (f"{p}.mlp.down_proj.weight", (H, I))]
        else:
            layer.append((f"{p}.mlp.gate.weight", (E, H)))
            for e in range(E):
                layer += [(f"{p}.mlp.experts.{e}.gate_proj.weight", (MI, H)),
                          (f"{p}.mlp.experts.{e}.up_proj.weight", (MI, H)),
                          (f"{p}.mlp.experts.{e}.down_proj.weight", (H, MI))]
        yield from layer
    yield "model.norm.weight", (H,)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (cfg["vocab_size"], H)


def write_random_qwen3_moe(dst: Path, cfg: dict, seed: int = 0, shard_bytes: int = 2 << 30,
                           tokenizer_text: str | None = None, progress: bool = False) -> Path:
    """A seeded random Qwen3-MoE release in bf16, sharded so that memory stays bounded."""
    from tqdm import tqdm

    dst.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg)
    cfg["vocab_size"] = max(cfg["vocab_size"], write_tokenizer(dst, tokenizer_text))
    g = torch.Generator().manual_seed(seed)
    shapes = list(qwen3_moe_shapes(cfg))
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(dst / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    for name, shape in tqdm(shapes, desc="writing weights", disable=not progress, unit="tensor"):
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * (shape[1] ** -0.5)
        shard[name] = t.to(torch.bfloat16)
        size += shard[name].numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
    return dst
