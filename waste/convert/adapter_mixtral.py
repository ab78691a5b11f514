"""Mixtral's adapter (`mixtral`: Mixtral-8x7B, 8x22B): GQA with RoPE and no q/k norm on every layer, a softmax
top-k router renormalised over the chosen experts, every layer MoE; experts under
`block_sparse_moe.experts.N.w1|w2|w3` (gate, down, up) as released and as transformers' save_pretrained writes."""
from __future__ import annotations

import re

from ..errors import WasteError
from .adapter_base import Adapter, _first, _rope_theta


class MixtralAdapter(Adapter):
    family = "mixtral"
    expert_re = re.compile(r"model\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts\.(?P<expert>\d+)\."
                           r"(?P<name>w1|w2|w3)\.weight")
    expert_fmt = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}.weight"
    expert_names = {"w1": "gate", "w3": "up", "w2": "down"}
    keep_f32 = ("mlp.gate.weight",)

    def normalise(self, hf):
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise WasteError(f"mixtral with rope scaling {rope} is not supported yet: waste runs plain RoPE")
        window, ctx = hf.get("sliding_window"), hf.get("max_position_embeddings")
        if window is not None and (ctx is None or window < ctx):
            raise WasteError(f"mixtral with sliding_window={window} is not supported yet (the released Mixtral "
                             "configs say null): set it to null in config.json only if the model was trained so")
        if hf.get("hidden_act", "silu") != "silu":
            raise WasteError(f"mixtral with hidden_act={hf['hidden_act']!r} is not supported (silu)")
        heads = hf["num_attention_heads"]
        cfg = self._base(hf, [{"attn": "gqa", "mlp": "moe"} for _ in range(hf["num_hidden_layers"])])
        cfg["gqa"] = {"num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads", heads),
                      "head_dim": _first(hf, "head_dim", default=hf["hidden_size"] // heads),
                      "rope_theta": _rope_theta(hf), "qk_norm": False, "bias": False}
        cfg["moe"] = {"num_experts": hf["num_local_experts"], "top_k": hf["num_experts_per_tok"],
                      "intermediate_size": hf["intermediate_size"], "scoring": "softmax", "norm_topk_prob": True,
                      "routed_scaling_factor": 1.0, "num_shared_experts": 0, "n_group": 1, "topk_group": 1,
                      "correction_bias": False}
        return cfg

    def trunk_target(self, name):
        return name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")

    def layer_names(self, i, layer, p):
        return [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"] + [f"{p}.block_sparse_moe.gate.weight"]

    def expected_shapes(self) -> dict:
        c = self.config
        D, V, g = c["hidden_size"], c["vocab_size"], c["gqa"]
        H, KV, d = g["num_heads"], g["num_kv_heads"], g["head_dim"]
        out = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D]}
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = [V, D]
        for i in range(c["num_layers"]):
            p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
            out.update({f"{p}.input_layernorm.weight": [D], f"{p}.post_attention_layernorm.weight": [D],
                        f"{a}.q_proj.weight": [H * d, D], f"{a}.k_proj.weight": [KV * d, D],
                        f"{a}.v_proj.weight": [KV * d, D], f"{a}.o_proj.weight": [D, H * d],
                        f"{p}.block_sparse_moe.gate.weight": [c["moe"]["num_experts"], D]})
        return out
