"""Qwen3-MoE: GQA with RoPE and per-head q/k norm; softmax top-k router; optional dense layers."""
from __future__ import annotations

from ..layers.attention import GQAConfig, KVCache, gqa_forward
from .base import DecoderModel


class Qwen3Moe(DecoderModel):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset()):
        super().__init__(config, trunk, experts, dtype, f32_names)
        g = config["gqa"]
        self.attn_cfg = GQAConfig(g["num_heads"], g["num_kv_heads"], g["head_dim"], g["rope_theta"], g["qk_norm"],
                                  config["rms_norm_eps"])
        self.attn_w = [{k[len("self_attn."):]: v for k, v in lw.items() if k.startswith("self_attn.")}
                       for lw in self.layers]

    def new_layer_state(self, i):
        return KVCache.empty(self.attn_cfg, self.dtype)

    def attend(self, i, x, state, positions):
        return gqa_forward(x, self.attn_w[i], self.attn_cfg, state, positions)
