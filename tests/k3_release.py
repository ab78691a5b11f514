"""Tiny random Kimi K3 releases in the release's own layout (../shared/reference/kimi-k3.md): config.json with the
text model under `text_config` (model_type kimi_linear, 1-indexed layer lists), weights under `language_model.`
in two shards with an index, bf16 matrices and float32 A_log / dt_bias / convs / correction bias, a vision
tower beside them, and routed experts in compressed-tensors mxfp4 (`weight_packed` uint8 E2M1 pairs +
`weight_scale` uint8 E8M0 per 32) or bf16. Written here, tensor by tensor, from a seeded generator: no oracle
code writes them, so mlx-lm's loader reading them is a check of the layout too.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TEXT = dict(
    model_type="kimi_linear", vocab_size=384, hidden_size=80, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=4, intermediate_size=112, rms_norm_eps=1e-5, max_position_embeddings=4096,
    hidden_act="situ", activation_situ_beta=1.5, activation_situ_linear_beta=2.0,   # low: the caps bite here
    attn_res_block_size=2, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, mla_use_nope=True, mla_use_output_gate=True, num_experts=8, num_experts_per_token=3,
    num_shared_experts=2, moe_intermediate_size=96, moe_router_activation_func="sigmoid", moe_renormalize=True,
    routed_scaling_factor=1.7, first_k_dense_replace=1, moe_layer_freq=1, use_grouped_topk=True,
    num_expert_group=1, topk_group=1, routed_expert_hidden_size=64, latent_moe_use_norm=True,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=0,
    linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                        "gate_lower_bound": -5.0, "full_attn_layers": [3, 6], "kda_layers": [1, 2, 4, 5]},
)
MXFP4_CONFIG = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "float", "group_size": 32, "symmetric": True, "strategy": "group",
                    "scale_dtype": "torch.uint8"}}},
                "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                           "lm_head", "re:vision_tower.*", "re:mm_projector.*"]}
MLA_LAYERS = [2, 5]          # 0-based: full_attn_layers [3, 6] are 1-indexed
# MoonViT (mlx-vlm 0.7.10's kimi_k3 VisionConfig keys), tiny: q/k/v wider than the residual as in the release
# (1536 for 1024), an 8x8 position table that every image's grid resizes, two blocks
VISION_CONFIG = dict(model_type="moonvit3d", patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8,
                     init_pos_emb_time=4, pos_emb_type="divided_fixed", pos_emb_interpolation_mode="bilinear",
                     vt_num_attention_heads=2, vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=64,
                     qkv_hidden_size=48, norm_type="rmsnorm", mlp_type="mlp2", activation_func="gelu_pytorch_tanh",
                     attn_bias=False, linear_bias=False, patch_embed_proj_bias=False, merge_kernel_size=[2, 2],
                     merge_type="sd2_tpool", mm_projector_type="patchmergerv2", mm_hidden_size=32,
                     projector_hidden_act="gelu", projector_ln_eps=1e-5, text_hidden_size=TEXT["hidden_size"])


def vision_shapes(v: dict = VISION_CONFIG, text_hidden: int = TEXT["hidden_size"]) -> dict[str, list[int]]:
    """The tower's and projector's checkpoint names -> shapes (the release's `vision_tower.*`, `mm_projector.*`)."""
    d, q, i, p = v["vt_hidden_size"], v["qkv_hidden_size"], v["vt_intermediate_size"], v["patch_size"]
    m = d * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
    out = {"vision_tower.patch_embed.proj.weight": [d, 3, p, p],
           "vision_tower.patch_embed.pos_emb.weight": [v["init_pos_emb_height"], v["init_pos_emb_width"], d],
           "vision_tower.encoder.final_layernorm.weight": [d],
           "mm_projector.proj.0.weight": [m, m], "mm_projector.proj.2.weight": [text_hidden, m],
           "mm_projector.post_norm.weight": [text_hidden]}
    for b in range(v["vt_num_hidden_layers"]):
        k = f"vision_tower.encoder.blocks.{b}."
        out.update({k + "norm0.weight": [d], k + "norm1.weight": [d], k + "wqkv.weight": [3 * q, d],
                    k + "wo.weight": [d, q], k + "mlp.fc0.weight": [i, d], k + "mlp.fc1.weight": [d, i]})
    return out


VISION = vision_shapes()


def _matrix(g, shape, scale=1.0):
    return (torch.randn(shape, generator=g) * shape[-1] ** -0.5 * scale).to(torch.bfloat16)


def _norm(g, n, dtype=torch.bfloat16):
    return (1.0 + 0.2 * torch.randn(n, generator=g)).to(dtype)


def release_tensors(cfg: dict, experts: str, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the release under its checkpoint name, in the release's dtypes."""
    g = torch.Generator().manual_seed(seed)
    D, V, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    lac = cfg["linear_attn_config"]
    H, d, K = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    C = H * d
    Hm, nope, rope, vd = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    E, I, MI, L = cfg["num_experts"], cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["routed_expert_hidden_size"]
    S = MI * cfg["num_shared_experts"]
    t = {"model.embed_tokens.weight": (torch.randn(V, D, generator=g)).to(torch.bfloat16),
         "lm_head.weight": _matrix(g, [V, D]), "model.norm.weight": _norm(g, [D]),
         "model.output_attn_res_norm.weight": _norm(g, [D]),
         "model.output_attn_res_proj.weight": _matrix(g, [1, D], 1.5)}
    for i in range(n):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        t.update({f"{p}.input_layernorm.weight": _norm(g, [D]), f"{p}.post_attention_layernorm.weight": _norm(g, [D])})
        for r in ("self_attention_res", "mlp_res"):
            t.update({f"{p}.{r}_norm.weight": _norm(g, [D]), f"{p}.{r}_proj.weight": _matrix(g, [1, D], 1.5)})
        if (i + 1) in lac["kda_layers"]:
            t.update({f"{a}.{x}_proj.weight": _matrix(g, [C, D]) for x in "qkv"})
            t.update({f"{a}.{x}_conv1d.weight": 0.5 * torch.randn(C, 1, K, generator=g) for x in "qkv"})
            t.update({f"{a}.f_a_proj.weight": _matrix(g, [d, D]), f"{a}.f_b_proj.weight": _matrix(g, [C, d]),
                      f"{a}.b_proj.weight": _matrix(g, [H, D]), f"{a}.g_proj.weight": _matrix(g, [C, D]),
                      # stored wider than the head count, as the release's A_log [128] for 96 heads
                      f"{a}.A_log": torch.log(torch.empty(max(H, d)).uniform_(1, 16, generator=g)),
                      f"{a}.dt_bias": 0.5 * torch.randn(C, generator=g), f"{a}.o_norm.weight": _norm(g, [d], torch.float32),
                      f"{a}.o_proj.weight": _matrix(g, [D, C])})
        else:
            qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            t.update({f"{a}.q_a_proj.weight": _matrix(g, [qr, D]), f"{a}.q_a_layernorm.weight": _norm(g, [qr]),
                      f"{a}.q_b_proj.weight": _matrix(g, [Hm * (nope + rope), qr]),
                      f"{a}.kv_a_proj_with_mqa.weight": _matrix(g, [kvr + rope, D]),
                      f"{a}.kv_a_layernorm.weight": _norm(g, [kvr]),
                      f"{a}.kv_b_proj.weight": _matrix(g, [Hm * (nope + vd), kvr]),
                      f"{a}.g_proj.weight": _matrix(g, [Hm * vd, D]), f"{a}.o_proj.weight": _matrix(g, [D, Hm * vd])})
        if i < cfg["first_k_dense_replace"]:
            t.update({f"{p}.mlp.gate_proj.weight": _matrix(g, [I, D]), f"{p}.mlp.up_proj.weight": _matrix(g, [I, D]),
                      f"{p}.mlp.down_proj.weight": _matrix(g, [D, I])})
            continue
        b = f"{p}.block_sparse_moe"
        t.update({f"{b}.gate.weight": _matrix(g, [E, D], 2.0),
                  f"{b}.gate.e_score_correction_bias": 0.3 * torch.randn(E, generator=g),
                  f"{b}.routed_expert_down_proj.weight": _matrix(g, [L, D]),
                  f"{b}.routed_expert_norm.weight": _norm(g, [L]),
                  f"{b}.routed_expert_up_proj.weight": _matrix(g, [D, L]),
                  f"{b}.shared_experts.gate_proj.weight": _matrix(g, [S, D]),
                  f"{b}.shared_experts.up_proj.weight": _matrix(g, [S, D]),
                  f"{b}.shared_experts.down_proj.weight": _matrix(g, [D, S])})
        for e in range(E):
            for w, (rows, cols) in (("w1", (MI, L)), ("w3", (MI, L)), ("w2", (L, MI))):
                name = f"{b}.experts.{e}.{w}"
                if experts == "mxfp4":
                    # random E2M1 code pairs and E8M0 exponents 2^-6 .. 2^-3: values up to 6 * 2^-3
                    t[f"{name}.weight_packed"] = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
                    t[f"{name}.weight_scale"] = torch.randint(121, 125, (rows, cols // 32), generator=g, dtype=torch.uint8)
                else:
                    t[f"{name}.weight"] = _matrix(g, [rows, cols], 2.0)
    out = {f"language_model.{k}": v.contiguous() for k, v in t.items()}
    for k, shape in vision_shapes(text_hidden=D).items():
        if "pos_emb" in k:
            out[k] = (0.5 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        elif len(shape) == 1:
            out[k] = _norm(g, shape)
        else:
            out[k] = _matrix(g, shape) if len(shape) == 2 else (torch.randn(shape, generator=g) * 0.03).to(torch.bfloat16)
    return out


def write_release(dst: Path, experts: str = "mxfp4", seed: int = 0, shards: int = 2, **over) -> Path:
    """A K3-layout release directory (config.json, sharded safetensors + index); no tokenizer files."""
    dst.mkdir(parents=True, exist_ok=True)
    text = {**TEXT, **over}
    if experts == "mxfp4":
        text["quantization_config"] = MXFP4_CONFIG
    cfg = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
           "vision_config": {**VISION_CONFIG, "text_hidden_size": text["hidden_size"]}, "bos_token_id": 1, "eos_token_id": 0,
           "tie_word_embeddings": False}
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors = release_tensors(text, experts, seed)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        f = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(dst / f), metadata={"format": "pt"})
        weight_map.update({k: f for k in part})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return dst


# Kimi's tiktoken layout: 256 reserved ids after the BPE ranks. The config pins bos (+0), eos (+2), the image
# pad (+21: media_placeholder_token_id 163605, `<|media_pad|>` since Kimi-VL, its markers before it as in Kimi
# K2.5's config) and pad (+255); the XTML markers' and the template's image placeholder's ids are this fixture's.
K3_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
               18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
               22: "<|kimi_image_placeholder|>", 255: "[PAD]"}


def write_k3_tokenizer(d: Path, ranks: dict[bytes, int]) -> int:
    """tiktoken.model + a Moonshot tokenizer_config.json (TikTokenTokenizer through tokenization_kimi) carrying the
    XTML markers; returns the vocabulary size (ranks + 256 reserved)."""
    import base64

    from waste.text.tokenizer import KIMI_PATTERN_BRANCHES

    n = len(ranks)
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                              for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    (d / "tokenization_kimi.py").write_text("pat_str = '|'.join([\n" + "".join(
        f"    r\"\"\"{b}\"\"\",\n" for b in KIMI_PATTERN_BRANCHES) + "])\n")
    decoder = {str(n + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True} for off, name in K3_SPECIALS.items()}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>", "pad_token": "[PAD]"}))
    return n + 256


def train_ranks(text: str, n_merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks learnt on text pre-split by Kimi's pattern (most frequent pair first, ties by bytes)."""
    from fixtures import bpe_merges

    from waste.text.tokenizer import KIMI_PATTERN

    ranks = {bytes([b]): b for b in range(256)}
    for a, b in bpe_merges(text, KIMI_PATTERN, n_merges):
        ranks.setdefault(a + b, len(ranks))
    return ranks
