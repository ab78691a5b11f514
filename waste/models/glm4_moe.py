"""GLM-4.5 / 4.6 (`glm4_moe`): the GQA decoder (qwen3_moe.py) with partial rotary and q/k/v biases; the MoE layers'
sigmoid router with correction bias and the shared expert are the skeleton's (base.py), from the config."""
from __future__ import annotations

from dataclasses import replace

from ..layers.rope import RopeTable
from .family import Family
from .qwen3_moe import Qwen3Moe


class Glm4Moe(Qwen3Moe):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset(), **kw):
        super().__init__(config, trunk, experts, dtype, f32_names, **kw)
        g = config["gqa"]
        self.attn_cfg = replace(self.attn_cfg, rotary_dim=g["rotary_dim"])
        self.rope = RopeTable(g["head_dim"], g["rope_theta"], self.capacity, dtype, self.device, g["rotary_dim"])


def _features(cfg: dict) -> list[str]:
    g = cfg["gqa"]
    out = [f"partial rotary: the first {g['rotary_dim']} of {g['head_dim']} dimensions of each head rotate"]
    if g["bias"]:
        out.append("q / k / v projection biases")
    if g["qk_norm"]:
        out.append("per-head q / k RMSNorm")
    return out


FAMILY = Family("glm4_moe", Glm4Moe, "adapter_glm4_moe:Glm4MoeAdapter", features=_features,
                title="GLM-4.5, GLM-4.5-Air, GLM-4.6")
