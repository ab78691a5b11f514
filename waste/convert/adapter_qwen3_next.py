"""Qwen3-Next (`qwen3_next`): Gated DeltaNet layers beside gated full attention (`layer_types`, 3:1 in the
releases), zero-centred RMSNorms (x-hat * (1 + w); the trunk keeps the release's w, the model adds the 1), partial
rotary, a softmax top-k router over many small experts and a shared expert scaled by sigmoid(shared_expert_gate x).
The release's multi-token-prediction weights (`mtp.*`) are left out with a note."""
from __future__ import annotations

from ..errors import WasteError
from .adapter_base import _first, _rope_theta
from .adapter_qwen3_moe import Qwen3MoeAdapter


class Qwen3NextAdapter(Qwen3MoeAdapter):
    family = "qwen3_next"
    keep_f32 = ("mlp.gate.weight", "A_log", "dt_bias", "conv1d.weight", "shared_expert_gate.weight")

    def normalise(self, hf):
        n = hf["num_hidden_layers"]
        interval = hf.get("full_attention_interval", 4) or 4
        kinds = hf.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                          for i in range(n)]
        if len(kinds) != n or set(kinds) - {"linear_attention", "full_attention"}:
            raise WasteError(f"qwen3_next layer_types must list linear_attention / full_attention for each of the "
                             f"{n} layers, not {kinds!r}: fix config.json")
        rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if (rp.get("rope_type") or rp.get("type") or "default") != "default":
            raise WasteError(f"qwen3_next with rope type {rp.get('rope_type') or rp.get('type')!r} is not supported "
                             "(default)")
        cfg = super().normalise({**hf, "rope_scaling": None})
        for layer, kind in zip(cfg["layers"], kinds):
            layer["attn"] = "gdn" if kind == "linear_attention" else "gqa"
        g = cfg["gqa"]
        if g["bias"]:
            raise WasteError("qwen3_next with attention_bias=true is not supported")
        factor = float(_first(rp, "partial_rotary_factor", default=hf.get("partial_rotary_factor", 0.25)))
        g.update(rope_theta=_rope_theta(hf), rot_dim=int(g["head_dim"] * factor), output_gate=True,
                 norm_plus_one=True)
        cfg["gdn"] = {"num_k_heads": hf["linear_num_key_heads"], "num_v_heads": hf["linear_num_value_heads"],
                      "k_dim": hf["linear_key_head_dim"], "v_dim": hf["linear_value_head_dim"],
                      "conv_kernel": hf.get("linear_conv_kernel_dim", 4)}
        if cfg["gdn"]["num_v_heads"] % cfg["gdn"]["num_k_heads"]:
            raise WasteError("qwen3_next: linear_num_value_heads must be a multiple of linear_num_key_heads")
        cfg["norm_plus_one"] = True          # every RMSNorm but the DeltaNet output norm: x-hat * (1 + w)
        cfg["moe"]["shared_gate_intermediate_size"] = hf.get("shared_expert_intermediate_size") or 0
        return cfg

    def dropped(self, name):
        if name.startswith(("mtp.", "model.mtp.")):
            return "multi-token-prediction weights (not used for generation)"
        return None

    def layer_names(self, i, layer, p):
        return list(self._layer_shapes(i, layer, p))

    def expected_shapes(self) -> dict:
        c = self.config
        D, V = c["hidden_size"], c["vocab_size"]
        out = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D]}
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = [V, D]
        for i, layer in enumerate(c["layers"]):
            p = f"model.layers.{i}"
            out.update({f"{p}.input_layernorm.weight": [D], f"{p}.post_attention_layernorm.weight": [D]})
            out.update(self._layer_shapes(i, layer, p))
        return out

    def _layer_shapes(self, i, layer, p) -> dict:
        c = self.config
        D, g, n = c["hidden_size"], c["gqa"], c["gdn"]
        out = {}
        if layer["attn"] == "gdn":
            a = f"{p}.linear_attn"
            Hk, Hv, dk, dv = n["num_k_heads"], n["num_v_heads"], n["k_dim"], n["v_dim"]
            C = 2 * Hk * dk + Hv * dv
            out.update({f"{a}.in_proj_qkvz.weight": [2 * Hk * dk + 2 * Hv * dv, D], f"{a}.in_proj_ba.weight": [2 * Hv, D],
                        f"{a}.conv1d.weight": ("numel", C * n["conv_kernel"]), f"{a}.A_log": [Hv],
                        f"{a}.dt_bias": [Hv], f"{a}.norm.weight": [dv], f"{a}.out_proj.weight": [D, Hv * dv]})
        else:
            a = f"{p}.self_attn"
            H, KV, d = g["num_heads"], g["num_kv_heads"], g["head_dim"]
            out.update({f"{a}.q_proj.weight": [2 * H * d, D], f"{a}.k_proj.weight": [KV * d, D],
                        f"{a}.v_proj.weight": [KV * d, D], f"{a}.o_proj.weight": [D, H * d],
                        f"{a}.q_norm.weight": [d], f"{a}.k_norm.weight": [d]})
        if layer["mlp"] == "moe":
            S, m = c["moe"]["shared_gate_intermediate_size"], f"{p}.mlp"
            out[f"{m}.gate.weight"] = [c["moe"]["num_experts"], D]
            if S:
                out.update({f"{m}.shared_expert.gate_proj.weight": [S, D], f"{m}.shared_expert.up_proj.weight": [S, D],
                            f"{m}.shared_expert.down_proj.weight": [D, S], f"{m}.shared_expert_gate.weight": [1, D]})
        else:
            I = c["intermediate_size"]
            out.update({f"{p}.mlp.gate_proj.weight": [I, D], f"{p}.mlp.up_proj.weight": [I, D],
                        f"{p}.mlp.down_proj.weight": [D, I]})
        return out
