"""GLM-4.5 / 4.6 (`glm4_moe`): GQA with partial rotary (the first `partial_rotary_factor` of each head rotates),
q/k/v biases, optional per-head q/k norm; dense first layers (`first_k_dense_replace`), then a sigmoid router with a
correction bias (grouped top-k when n_group > 1) beside one shared expert. The release's experts are
`mlp.experts.N.{gate,up,down}_proj`, as transformers' save_pretrained writes them; its multi-token-prediction layer,
stored after the last decoder layer (`model.layers.{num_hidden_layers}.*`), is left out with a note."""
from __future__ import annotations

import re

from ..errors import WasteError
from .adapter_base import Adapter, _first, _rope_theta, sigmoid_moe

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeAdapter(Adapter):
    family = "glm4_moe"
    expert_re = re.compile(r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
                           r"(?P<name>gate_proj|up_proj|down_proj)\.weight")
    expert_fmt = "model.layers.{layer}.mlp.experts.{expert}.{name}.weight"
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    keep_f32 = ("mlp.gate.weight", "e_score_correction_bias")

    def dropped(self, name):
        m = _LAYER.match(name)
        if m and int(m[1]) >= self.config["num_layers"]:
            return f"multi-token-prediction layer {m[1]} (not used for generation)"
        return None

    def classify_expert(self, name):
        return None if self.dropped(name) else super().classify_expert(name)

    def normalise(self, hf):
        rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rp.get("rope_type", rp.get("type", "default")) not in ("default", None):
            raise WasteError(f"glm4_moe with rope scaling {rp} is not supported yet: waste runs plain RoPE")
        if hf.get("hidden_act", "silu") != "silu":
            raise WasteError(f"glm4_moe with hidden_act={hf['hidden_act']!r} is not supported (silu)")
        n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
        n_exp = _first(hf, "n_routed_experts", "num_local_experts", default=0)
        fk = hf.get("first_k_dense_replace", 0) or 0
        cfg = self._base(hf, [{"attn": "gqa", "mlp": "moe" if n_exp and i >= fk else "dense"} for i in range(n)])
        d = _first(hf, "head_dim", default=hf["hidden_size"] // heads)
        factor = float(_first(rp, "partial_rotary_factor", default=hf.get("partial_rotary_factor", 1.0)))
        rotary = int(d * factor)
        if not 0 < rotary <= d or rotary % 2:
            raise WasteError(f"glm4_moe: partial_rotary_factor {factor} of head_dim {d} gives {rotary} rotary "
                             "dimensions; it must give an even number between 2 and head_dim")
        cfg["gqa"] = {"num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads", heads), "head_dim": d,
                      "rope_theta": _rope_theta(hf), "qk_norm": bool(hf.get("use_qk_norm", False)),
                      "bias": bool(hf.get("attention_bias", False)), "rotary_dim": rotary}
        n_shared = hf.get("n_shared_experts", 0) or 0
        cfg["moe"] = sigmoid_moe(n_exp, hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                                 hf.get("norm_topk_prob", True), hf.get("routed_scaling_factor", 1.0), n_shared,
                                 hf.get("n_group"), hf.get("topk_group"))
        cfg["mtp_layers"] = _first(hf, "num_nextn_predict_layers", "num_mtp_layers", default=0)
        return cfg

    def layer_names(self, i, layer, p):
        a, g = f"{p}.self_attn", self.config["gqa"]
        names = [f"{a}.{x}_proj.weight" for x in "qkvo"]
        names += [f"{a}.{x}_proj.bias" for x in "qkv"] if g["bias"] else []
        names += [f"{a}.q_norm.weight", f"{a}.k_norm.weight"] if g["qk_norm"] else []
        return names + self._sigmoid_mlp_names(p, layer)

    def expected_shapes(self) -> dict:
        c = self.config
        D, V, g, m = c["hidden_size"], c["vocab_size"], c["gqa"], c["moe"]
        H, KV, d = g["num_heads"], g["num_kv_heads"], g["head_dim"]
        out = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D]}
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = [V, D]
        for i, layer in enumerate(c["layers"]):
            p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
            out.update({f"{p}.input_layernorm.weight": [D], f"{p}.post_attention_layernorm.weight": [D],
                        f"{a}.q_proj.weight": [H * d, D], f"{a}.k_proj.weight": [KV * d, D],
                        f"{a}.v_proj.weight": [KV * d, D], f"{a}.o_proj.weight": [D, H * d]})
            if g["bias"]:
                out.update({f"{a}.q_proj.bias": [H * d], f"{a}.k_proj.bias": [KV * d], f"{a}.v_proj.bias": [KV * d]})
            if g["qk_norm"]:
                out.update({f"{a}.q_norm.weight": [d], f"{a}.k_norm.weight": [d]})
            if layer["mlp"] == "moe":
                s = m["shared_intermediate_size"]
                out.update({f"{p}.mlp.gate.weight": [m["num_experts"], D],
                            f"{p}.mlp.gate.e_score_correction_bias": [m["num_experts"]]})
                if s:
                    out.update({f"{p}.mlp.shared_experts.gate_proj.weight": [s, D],
                                f"{p}.mlp.shared_experts.up_proj.weight": [s, D],
                                f"{p}.mlp.shared_experts.down_proj.weight": [D, s]})
            else:
                inter = c["intermediate_size"]
                out.update({f"{p}.mlp.gate_proj.weight": [inter, D], f"{p}.mlp.up_proj.weight": [inter, D],
                            f"{p}.mlp.down_proj.weight": [D, inter]})
        return out
