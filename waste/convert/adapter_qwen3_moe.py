"""Qwen3-MoE's adapter: GQA with per-head q/k norm, a softmax router, experts under `mlp.experts.N`."""
from __future__ import annotations

import re

from ..errors import WasteError
from .adapter_base import Adapter, _first, _rope_theta


class Qwen3MoeAdapter(Adapter):
    family = "qwen3_moe"
    expert_re = re.compile(r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<name>gate_proj|up_proj|down_proj)\.weight")
    expert_fmt = "model.layers.{layer}.mlp.experts.{expert}.{name}.weight"
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    keep_f32 = ("mlp.gate.weight",)

    def normalise(self, hf):
        n_layers = hf["num_hidden_layers"]
        n_exp = _first(hf, "num_experts", "num_local_experts", default=0)
        only = set(hf.get("mlp_only_layers") or [])
        step = hf.get("decoder_sparse_step", 1) or 1
        layers = [{"attn": "gqa", "mlp": "moe" if (i not in only and n_exp > 0 and (i + 1) % step == 0) else "dense"}
                  for i in range(n_layers)]
        heads = hf["num_attention_heads"]
        cfg = self._base(hf, layers)
        cfg["gqa"] = {"num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads", heads),
                      "head_dim": _first(hf, "head_dim", default=hf["hidden_size"] // heads),
                      "rope_theta": _rope_theta(hf), "qk_norm": True, "bias": bool(hf.get("attention_bias", False))}
        if (hf.get("rope_scaling") or {}).get("rope_type", "default") not in ("default", None):
            raise WasteError(f"qwen3_moe with rope_scaling {hf['rope_scaling']} is not supported yet")
        if hf.get("use_sliding_window"):
            raise WasteError("qwen3_moe with use_sliding_window=true is not supported yet")
        cfg["moe"] = {"num_experts": n_exp, "top_k": _first(hf, "num_experts_per_tok", "num_experts_per_token"),
                      "intermediate_size": hf["moe_intermediate_size"], "scoring": "softmax",
                      "norm_topk_prob": bool(hf.get("norm_topk_prob", False)), "routed_scaling_factor": 1.0,
                      "num_shared_experts": 0, "n_group": 1, "topk_group": 1, "correction_bias": False}
        return cfg

    def layer_names(self, i, layer, p):
        names = [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"]
        if self.config["gqa"]["bias"]:
            names += [f"{p}.self_attn.{x}_proj.bias" for x in "qkv"]
        names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        return names + ([f"{p}.mlp.gate.weight"] if layer["mlp"] == "moe" else self._dense_mlp(p))

    def expected_shapes(self) -> dict:
        """Every trunk tensor's shape from config.json (a matrix of the wrong shape is refused by name)."""
        c = self.config
        D, V, g = c["hidden_size"], c["vocab_size"], c["gqa"]
        H, KV, d = g["num_heads"], g["num_kv_heads"], g["head_dim"]
        out = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D]}
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = [V, D]
        for i, layer in enumerate(c["layers"]):
            p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
            out.update({f"{p}.input_layernorm.weight": [D], f"{p}.post_attention_layernorm.weight": [D],
                        f"{a}.q_proj.weight": [H * d, D], f"{a}.k_proj.weight": [KV * d, D],
                        f"{a}.v_proj.weight": [KV * d, D], f"{a}.o_proj.weight": [D, H * d],
                        f"{a}.q_norm.weight": [d], f"{a}.k_norm.weight": [d]})
            if g["bias"]:
                out.update({f"{a}.q_proj.bias": [H * d], f"{a}.k_proj.bias": [KV * d], f"{a}.v_proj.bias": [KV * d]})
            if layer["mlp"] == "moe":
                out[f"{p}.mlp.gate.weight"] = [c["moe"]["num_experts"], D]
            else:
                inter = c["intermediate_size"]
                out.update({f"{p}.mlp.gate_proj.weight": [inter, D], f"{p}.mlp.up_proj.weight": [inter, D],
                            f"{p}.mlp.down_proj.weight": [D, inter]})
        return out
