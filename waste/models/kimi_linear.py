"""Kimi-Linear: KDA linear attention on most layers, MLA without rotary on the rest; sigmoid router with
correction bias, shared experts, dense first layers."""
from __future__ import annotations

from ..layers.kda import KDAConfig, KDAState, kda_forward
from ..layers.mla import MLACache, MLAConfig, mla_forward
from .base import DecoderModel
from .family import Family


class KimiLinear(DecoderModel):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset(), **kw):
        super().__init__(config, trunk, experts, dtype, f32_names, **kw)
        k, m = config["kda"], config["mla"]
        self.kda_cfg = KDAConfig(k["num_heads"], k["head_dim"], k["conv_kernel"], config["rms_norm_eps"])
        self.mla_cfg = MLAConfig(m["num_heads"], m["q_lora_rank"], m["kv_lora_rank"], m["qk_nope_head_dim"],
                                 m["qk_rope_head_dim"], m["v_head_dim"], m.get("norm_eps", 1e-6),
                                 (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]) ** -0.5, None)
        self.kinds = [l["attn"] for l in config["layers"]]
        self.attn_w = [{k[len("self_attn."):]: v for k, v in lw.items() if k.startswith("self_attn.")}
                       for lw in self.layers]

    def new_layer_state(self, i):
        if self.kinds[i] == "kda":
            return KDAState.empty(self.kda_cfg, self.dtype, self.device)
        return MLACache.empty(self.mla_cfg, self.dtype, self.device, self.capacity)

    def fixed_state(self, i, st):
        # a KDA layer's state has fixed shapes: the whole layer's decode row is captured (graphs.py `layer`)
        return (st.tensors(), KDAState.of) if self.kinds[i] == "kda" and isinstance(st, KDAState) else None

    def attend(self, i, x, state, positions, scratch):
        if self.kinds[i] == "kda":
            return kda_forward(x, self.attn_w[i], self.kda_cfg, state)
        return mla_forward(x, self.attn_w[i], self.mla_cfg, state, positions)


FAMILY = Family("kimi_linear", KimiLinear, "adapter_kimi_linear:KimiLinearAdapter",
                chat="kimi", title="Kimi-Linear")
