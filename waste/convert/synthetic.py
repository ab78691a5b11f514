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



class _Shards:
    """Tensors written into safetensors shards of about shard_bytes each, with the index a sharded release has."""

    def __init__(self, dst: Path, shard_bytes: int):
        self.dst, self.shard_bytes = dst, shard_bytes
        self.weight_map, self.shard, self.size, self.n = {}, {}, 0, 0

    def add(self, name: str, t: torch.Tensor) -> None:
        self.shard[name] = t
        self.size += t.numel() * t.element_size()
        if self.size >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if self.shard:
            name = f"model-{self.n:05d}.safetensors"
            save_file(self.shard, str(self.dst / name), metadata={"format": "pt"})
            self.weight_map.update({k: name for k in self.shard})
            self.shard, self.size, self.n = {}, 0, self.n + 1

    def close(self) -> None:
        self.flush()
        (self.dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": self.weight_map}, indent=1))

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
    out = _Shards(dst, shard_bytes)
    for name, shape in tqdm(shapes, desc="writing weights", disable=not progress, unit="tensor"):
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * (shape[1] ** -0.5)
        out.add(name, t.to(torch.bfloat16))
    out.close()
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
    return dst


def kimi_k3_text_config(**over) -> dict:
    """Kimi K3's text config at its real widths (../shared/reference/kimi-k3.md), KDA on every layer unless
    `linear_attn_config` says otherwise; `num_hidden_layers` and the rest by keyword."""
    n = over.get("num_hidden_layers", 1)
    cfg = {"model_type": "kimi_linear", "vocab_size": 512, "hidden_size": 7168, "num_hidden_layers": n,
           "num_attention_heads": 96, "num_key_value_heads": 96, "intermediate_size": 33792, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096, "hidden_act": "situ", "activation_situ_beta": 4.0,
           "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
           "mla_use_output_gate": True, "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
           "moe_intermediate_size": 3072, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
           "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, "use_grouped_topk": True, "num_expert_group": 1,
           "topk_group": 1, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
           "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": 0,
           "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                                  "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                                  "kda_layers": list(range(1, n + 1)), "full_attn_layers": []}}
    cfg.update(over)
    return cfg


def kimi_k3_shapes(cfg: dict):
    """(name, shape, kind) of every tensor of a KDA-only K3 text checkpoint as released (`language_model.`
    prefix, experts as compressed-tensors mxfp4 parts); kind: "norm", "f32", "matrix", "packed" or "scale"."""
    D, V, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    lac = cfg["linear_attn_config"]
    H, d, C = lac["num_heads"], lac["head_dim"], lac["num_heads"] * lac["head_dim"]
    E, MI, L = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["routed_expert_hidden_size"]
    S = MI * cfg["num_shared_experts"]
    p0 = "language_model.model"
    yield f"{p0}.embed_tokens.weight", (V, D), "matrix"
    for i in range(n):
        p, a, b = f"{p0}.layers.{i}", f"{p0}.layers.{i}.self_attn", f"{p0}.layers.{i}.block_sparse_moe"
        for x in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            yield f"{p}.{x}.weight", (D,), "norm"
        for x in ("self_attention_res_proj", "mlp_res_proj"):
            yield f"{p}.{x}.weight", (1, D), "matrix"
        for x in "qkvg":
            yield f"{a}.{x}_proj.weight", (C, D), "matrix"
        for x in "qkv":
            yield f"{a}.{x}_conv1d.weight", (C, 1, lac["short_conv_kernel_size"]), "f32"
        yield from ((f"{a}.f_a_proj.weight", (d, D), "matrix"), (f"{a}.f_b_proj.weight", (C, d), "matrix"),
                    (f"{a}.b_proj.weight", (H, D), "matrix"), (f"{a}.A_log", (H,), "f32"),
                    (f"{a}.dt_bias", (C,), "f32"), (f"{a}.o_norm.weight", (d,), "norm"),
                    (f"{a}.o_proj.weight", (D, C), "matrix"), (f"{b}.gate.weight", (E, D), "matrix"),
                    (f"{b}.gate.e_score_correction_bias", (E,), "f32"),
                    (f"{b}.routed_expert_down_proj.weight", (L, D), "matrix"), (f"{b}.routed_expert_norm.weight", (L,), "norm"),
                    (f"{b}.routed_expert_up_proj.weight", (D, L), "matrix"),
                    (f"{b}.shared_experts.gate_proj.weight", (S, D), "matrix"),
                    (f"{b}.shared_experts.up_proj.weight", (S, D), "matrix"),
                    (f"{b}.shared_experts.down_proj.weight", (D, S), "matrix"))
        for e in range(E):
            for w, (rows, cols) in (("w1", (MI, L)), ("w3", (MI, L)), ("w2", (L, MI))):
                yield f"{b}.experts.{e}.{w}.weight_packed", (rows, cols // 2), "packed"
                yield f"{b}.experts.{e}.{w}.weight_scale", (rows, cols // 32), "scale"
    yield from ((f"{p0}.norm.weight", (D,), "norm"), (f"{p0}.output_attn_res_norm.weight", (D,), "norm"),
                (f"{p0}.output_attn_res_proj.weight", (1, D), "matrix"), ("language_model.lm_head.weight", (V, D), "matrix"))


def write_random_kimi_k3(dst: Path, text_cfg: dict, seed: int = 0, shard_bytes: int = 2 << 30,
                         progress: bool = False) -> Path:
    """A seeded random K3 release in its published layout (nested text config, bf16 trunk, mxfp4 experts as random
    E2M1 codes with E8M0 exponents 2^-6..2^-4), sharded so that memory stays bounded. For benchmarks: the values
    mean nothing, the sizes and the layout are the release's."""
    from tqdm import tqdm

    dst.mkdir(parents=True, exist_ok=True)
    text = dict(text_cfg)
    text["vocab_size"] = max(text["vocab_size"], write_tokenizer(dst))
    text["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    g = torch.Generator().manual_seed(seed)
    out = _Shards(dst, shard_bytes)
    specs = list(kimi_k3_shapes(text))
    for name, shape, kind in tqdm(specs, desc="writing weights", disable=not progress, unit="tensor"):
        if kind == "packed":
            t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        elif kind == "scale":
            t = torch.randint(121, 124, shape, generator=g, dtype=torch.uint8)
        elif kind == "norm":
            t = (1.0 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        elif kind == "f32":
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            t = (torch.randn(shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)
        out.add(name, t)
    out.close()
    (dst / "config.json").write_text(json.dumps({"architectures": ["KimiK3ForConditionalGeneration"],
                                                 "model_type": "kimi_k3", "text_config": text}, indent=1))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": text["eos_token_id"]}))
    return dst
