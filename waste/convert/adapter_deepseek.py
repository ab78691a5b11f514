"""DeepSeek-V3 / R1 and Kimi-K2 (`deepseek_v3`, `kimi_k2`): MLA with q-LoRA and YaRN rotary on every layer, dense
first layers, sigmoid router with correction bias and grouped top-k (noaux_tc), shared experts, fp8 block weights
(architectures.md §2). The multi-token-prediction layers stored after the last decoder layer
(`model.layers.{num_hidden_layers}.*`) are left out with a note: generation does not use them.
"""
from __future__ import annotations

import re

from ..errors import WasteError
from .adapter_base import Adapter, _first, sigmoid_moe

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _rope(hf: dict) -> dict:
    """The manifest's mla.rope: transformers' rope_parameters, or the releases' older rope_scaling + rope_theta."""
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(_first(rp, "rope_theta", default=hf.get("rope_theta", 10000.0)))
    kind = rp.get("rope_type") or rp.get("type") or "default"
    out = {"type": "default", "theta": theta, "interleave": bool(hf.get("rope_interleave", True))}
    if kind == "default":
        return out
    if kind != "yarn":
        raise WasteError(f"deepseek_v3 with rope type {kind!r} is not supported (default, yarn)")
    original = _first(rp, "original_max_position_embeddings", default=hf.get("original_max_position_embeddings"))
    original = original or hf.get("max_position_embeddings")
    factor = rp.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    out.update(type="yarn", factor=float(factor), original_max_position_embeddings=original,
               beta_fast=rp.get("beta_fast") or 32, beta_slow=rp.get("beta_slow") or 1,
               mscale=rp.get("mscale"), mscale_all_dim=rp.get("mscale_all_dim"),
               attention_factor=rp.get("attention_factor"), truncate=rp.get("truncate", True))
    return out


class DeepseekV3Adapter(Adapter):
    family = "deepseek_v3"
    expert_re = re.compile(r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<name>gate_proj|up_proj|down_proj)\.weight")
    expert_fmt = "model.layers.{layer}.mlp.experts.{expert}.{name}.weight"
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    keep_f32 = ("mlp.gate.weight", "e_score_correction_bias")
    keep_float = ("kv_b_proj.weight",)   # split per head in the absorbed decode path

    def dropped(self, name):
        m = _LAYER.match(name)
        if m and int(m[1]) >= self.config["num_layers"]:
            return f"multi-token-prediction layer {m[1]} (not used for generation)"
        return None

    def classify_expert(self, name):
        return None if self.dropped(name) else super().classify_expert(name)

    def normalise(self, hf):
        n = hf["num_hidden_layers"]
        n_exp = _first(hf, "n_routed_experts", "num_local_experts", default=0)
        fk = hf.get("first_k_dense_replace", 0) or 0
        freq = hf.get("moe_layer_freq", 1) or 1
        layers = [{"attn": "mla", "mlp": "moe" if n_exp and i >= fk and i % freq == 0 else "dense"} for i in range(n)]
        cfg = self._base(hf, layers)
        heads = hf["num_attention_heads"]
        if hf.get("attention_bias"):
            raise WasteError("deepseek_v3 with attention_bias=true is not supported")
        method = hf.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise WasteError(f"deepseek_v3 with topk_method={method!r} is not supported (noaux_tc)")
        scoring = hf.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise WasteError(f"deepseek_v3 with scoring_func={scoring!r} is not supported (sigmoid)")
        # transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, 1e-6, not rms_norm_eps
        cfg["mla"] = {"num_heads": heads, "q_lora_rank": hf.get("q_lora_rank"), "kv_lora_rank": hf["kv_lora_rank"],
                      "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
                      "v_head_dim": hf["v_head_dim"], "rope": _rope(hf), "norm_eps": 1e-6}
        n_shared = hf.get("n_shared_experts", 0) or 0
        inter = hf.get("moe_intermediate_size")
        cfg["moe"] = sigmoid_moe(n_exp, hf.get("num_experts_per_tok"), inter, hf.get("norm_topk_prob", True),
                                 hf.get("routed_scaling_factor", 1.0), n_shared, hf.get("n_group"), hf.get("topk_group"))
        cfg["mtp_layers"] = _first(hf, "num_nextn_predict_layers", "num_mtp_layers", default=0)
        return cfg

    def layer_names(self, i, layer, p):
        return self._mla_names(f"{p}.self_attn") + self._sigmoid_mlp_names(p, layer)
