"""DeepSeek-V3 / R1 and Kimi-K2 (`deepseek_v3`): MLA with q-LoRA and YaRN rotary on every layer (absorbed for
decode), dense first layers, sigmoid router with correction bias and grouped top-k (noaux_tc), shared experts."""
from __future__ import annotations

from ..layers.mla import MLACache, MLAConfig, mla_forward
from ..layers.yarn import make_rope, softmax_mscale
from .base import DecoderModel
from .family import Family


class DeepseekV3(DecoderModel):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset(), **kw):
        super().__init__(config, trunk, experts, dtype, f32_names, **kw)
        m = config["mla"]
        r = m["qk_rope_head_dim"]
        rope = make_rope(m["rope"], r) if m.get("rope") and r else None
        scale = (m["qk_nope_head_dim"] + r) ** -0.5 * softmax_mscale(m.get("rope"))
        self.mla_cfg = MLAConfig(m["num_heads"], m["q_lora_rank"], m["kv_lora_rank"], m["qk_nope_head_dim"], r,
                                 m["v_head_dim"], m.get("norm_eps", 1e-6), scale, rope)
        self.attn_w = [{k[len("self_attn."):]: v for k, v in lw.items() if k.startswith("self_attn.")}
                       for lw in self.layers]

    def new_layer_state(self, i):
        return MLACache.empty(self.mla_cfg, self.dtype, self.device, self.capacity)

    def attend(self, i, x, state, positions, scratch):
        return mla_forward(x, self.attn_w[i], self.mla_cfg, state, positions)


FAMILY = Family("deepseek_v3", DeepseekV3, "adapter_deepseek:DeepseekV3Adapter",
                model_types=("deepseek_v3", "kimi_k2"), title="DeepSeek-V3 / R1, Kimi-K2")
