"""Qwen3-Next: Gated DeltaNet layers (layers/gdn.py) beside gated full attention with partial rotary
(layers/gated_attention.py), zero-centred RMSNorms, a softmax top-k router and a shared expert scaled by
sigmoid(shared_expert_gate x)."""
from __future__ import annotations

import torch

from ..layers.attention import GQAConfig, KVCache
from ..layers.gated_attention import gated_gqa_forward
from ..layers.gdn import GDNConfig, GDNState, gdn_forward
from ..layers.mlp import dense_mlp
from ..layers.rope import RopeTable
from ..quant.linear import linear
from .base import DecoderModel
from .family import Family

PLUS_ONE = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight")


class Qwen3Next(DecoderModel):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset(), **kw):
        super().__init__(config, trunk, experts, dtype, f32_names, **kw)
        if config.get("norm_plus_one"):      # x-hat * (1 + w), as the release's norms compute it (in float32)
            self.norm = self.norm.float() + 1
            for lw in self.layers:
                for k in PLUS_ONE:
                    if k in lw:
                        lw[k] = lw[k].float() + 1
        g, n = config["gqa"], config["gdn"]
        self.attn_cfg = GQAConfig(g["num_heads"], g["num_kv_heads"], g["head_dim"], g["rope_theta"], True,
                                  config["rms_norm_eps"])
        self.gdn_cfg = GDNConfig(n["num_k_heads"], n["num_v_heads"], n["k_dim"], n["v_dim"], n["conv_kernel"],
                                 config["rms_norm_eps"])
        self.kinds = [l["attn"] for l in config["layers"]]
        self.rot_dim = g["rot_dim"]
        self.attn_w = []
        for lw, kind in zip(self.layers, self.kinds):
            pre = "linear_attn." if kind == "gdn" else "self_attn."
            self.attn_w.append({k[len(pre):]: v for k, v in lw.items() if k.startswith(pre)})
        self.rope = RopeTable(self.rot_dim, g["rope_theta"], self.capacity, dtype, self.device)

    def new_layer_state(self, i):
        if self.kinds[i] == "gdn":
            return GDNState.empty(self.gdn_cfg, self.dtype, self.device)
        return KVCache.empty(self.attn_cfg, self.dtype, self.capacity, self.device)

    def attend(self, i, x, state, positions, scratch):
        if self.kinds[i] == "gdn":
            return gdn_forward(x, self.attn_w[i], self.gdn_cfg, state)
        if "rope" not in scratch:
            scratch["rope"] = (*self.rope.at(scratch["start"], x.shape[0]), self.rope.R)
        return gated_gqa_forward(x, self.attn_w[i], self.attn_cfg, state, scratch["rope"], self.rot_dim)

    def mlp_many(self, i, xs, hs=None):
        ys = super().mlp_many(i, xs, hs)
        lw = self.layers[i]
        if self.dense[i] or "mlp.shared_expert_gate.weight" not in lw:
            return ys
        with self.timer.section("trunk matvec"):
            return [y + torch.sigmoid(linear(x, lw["mlp.shared_expert_gate.weight"]))
                    * dense_mlp(x, lw, "mlp.shared_expert.") for x, y in zip(xs, ys)]


def _features(cfg: dict) -> list[str]:
    n, g, kinds = cfg["gdn"], cfg["gqa"], [l["attn"] for l in cfg["layers"]]
    return [f"Gated DeltaNet on {kinds.count('gdn')} of {len(kinds)} layers ({n['num_k_heads']} q/k heads x "
            f"{n['k_dim']}, {n['num_v_heads']} value heads x {n['v_dim']}, conv {n['conv_kernel']}, one decay per "
            "value head), gated full attention on the rest",
            f"partial rotary: {g['rot_dim']} of {g['head_dim']} channels per head; zero-centred RMSNorms (1 + w)",
            "shared expert scaled by sigmoid(shared_expert_gate x)"]


FAMILY = Family("qwen3_next", Qwen3Next, "adapter_qwen3_next:Qwen3NextAdapter", features=_features,
                title="Qwen3-Next-80B-A3B")
