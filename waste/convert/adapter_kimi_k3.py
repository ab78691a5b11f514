"""Kimi K3 (`kimi_k3`, ../shared/reference/kimi-k3.md): KDA with a full-rank output gate and a lower-bound decay
gate, MLA without rotary and with an output gate, attention residuals over blocks of layers, a latent MoE
(experts read and write `routed_expert_hidden_size`) with SiTU-GLU experts, shared experts, a dense first layer.

The release nests the text model under `text_config` (model_type kimi_linear; read_config flattens it and keeps
the wrapper's model_type as `outer_model_type`) with its weights under `language_model.`; the vision tower
(`vision_tower.*`, `mm_projector.*`) goes to vision.safetensors. Its KDA / full-attention layer lists are
1-indexed. Routed experts come in compressed-tensors mxfp4 (kept as released) or bf16.
"""
from __future__ import annotations

import re

from ..errors import WasteError
from .adapter_base import _first, sigmoid_moe
from .adapter_kimi_linear import KimiLinearAdapter, is_k3

_ALIASES = [
    (re.compile(r"^language_model\."), ""),
    # the attention-residual weights are written either way round (mlx-lm's sanitize accepts both)
    (re.compile(r"\.(self_attention_res|mlp_res|output_attn_res)\.(proj|norm)_weight$"), r".\1_\2.weight"),
]
_VISION = re.compile(r"^(?:language_model\.)?(?:vision_tower|vision_model|mm_projector|multi_modal_projector)\.")
_MTP = re.compile(r"^(?:language_model\.)?(?:model\.)?mtp\.|^(?:language_model\.)?model\.layers\.(\d+)\.")
def _layer_kinds(hf: dict, n: int) -> list[str]:
    """0-based kinds from the 1-indexed linear_attn_config lists (layer i is KDA iff i + 1 is in kda_layers)."""
    lac = hf.get("linear_attn_config") or {}
    kda, full = lac.get("kda_layers"), lac.get("full_attn_layers")
    if kda is None and full is None:
        raise WasteError("kimi_k3 config.json has no linear_attn_config.kda_layers / full_attn_layers: "
                         "the release says which layers are KDA")
    everything = set(range(1, n + 1))
    kda = set(kda) if kda is not None else everything - set(full)
    full = set(full) if full is not None else everything - kda
    if kda & full or (kda | full) != everything:
        bad = sorted((kda & full) | ((kda | full) ^ everything))
        raise WasteError(f"kimi_k3 linear_attn_config: kda_layers and full_attn_layers must split the layers "
                         f"1..{n} (the lists are 1-indexed); layer numbers {bad[:8]} are doubled, missing or out "
                         "of range: fix config.json")
    return ["kda" if i + 1 in kda else "mla" for i in range(n)]


class KimiK3Adapter(KimiLinearAdapter):
    a_log_rule = "numel>="        # A_log stored [H] or wider (Kimi-Linear: [1, 1, H, 1])
    family = "kimi_k3"
    keep_f32 = ("mlp.gate.weight", "A_log", "dt_bias", "e_score_correction_bias", "conv1d.weight", "res_proj.weight")

    @classmethod
    def claims(cls, hf):
        return is_k3(hf)

    def canonical(self, name):
        for pat, rep in _ALIASES:
            name = pat.sub(rep, name)
        return super().canonical(name)

    def classify_expert(self, name):
        return None if self.dropped(name) else super().classify_expert(self.canonical(name))

    def trunk_target(self, name):
        return super().trunk_target(self.canonical(name))

    def vision_target(self, name):
        return name.removeprefix("language_model.") if _VISION.match(name) else None

    def dropped(self, name):
        m = _MTP.match(name)
        if m and (m[1] is None or int(m[1]) >= self.config["num_layers"]):
            return "multi-token-prediction weights (not used for generation)"
        return None

    def normalise(self, hf):
        n = hf["num_hidden_layers"]
        if hf.get("hidden_act", "situ") != "situ":
            raise WasteError(f"kimi_k3 with hidden_act={hf['hidden_act']!r} is not supported (situ)")
        if hf.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise WasteError("kimi_k3 with moe_router_activation_func="
                             f"{hf['moe_router_activation_func']!r} is not supported (sigmoid)")
        if not hf.get("mla_use_nope", True):
            raise WasteError("kimi_k3 with mla_use_nope=false (rotary MLA) is not supported")
        kinds = _layer_kinds(hf, n)
        n_exp = hf.get("num_experts") or 0
        fk, freq = hf.get("first_k_dense_replace", 0) or 0, hf.get("moe_layer_freq", 1) or 1
        mlps = ["moe" if n_exp and i >= fk and i % freq == 0 else "dense" for i in range(n)]
        cfg = self._base(hf, [{"attn": a, "mlp": m} for a, m in zip(kinds, mlps)])
        cfg["rms_norm_eps"] = hf.get("rms_norm_eps", 1e-5)
        heads = hf["num_attention_heads"]
        cfg["mla"] = {"num_heads": heads, "q_lora_rank": hf.get("q_lora_rank"), "kv_lora_rank": hf["kv_lora_rank"],
                      "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
                      "v_head_dim": hf["v_head_dim"], "rope": None, "norm_eps": 1e-6,
                      "output_gate": bool(hf.get("mla_use_output_gate", False))}
        lac = hf.get("linear_attn_config") or {}
        lower = lac.get("gate_lower_bound")
        cfg["kda"] = {"num_heads": lac["num_heads"], "head_dim": lac["head_dim"],
                      "conv_kernel": lac.get("short_conv_kernel_size", 4),
                      "gate_lower_bound": None if lower is None else float(lower),
                      "full_rank_gate": bool(lac.get("use_full_rank_gate", False))}
        beta, lbeta = hf.get("activation_situ_beta"), hf.get("activation_situ_linear_beta")
        cfg["situ"] = {"beta": float(beta or 1.0), "linear_beta": None if lbeta is None else float(lbeta)}
        block = hf.get("attn_res_block_size")
        cfg["attn_res_block_size"] = int(block) if block else None
        top_k = hf.get("num_experts_per_token", 16)
        cfg["moe"] = sigmoid_moe(n_exp, top_k, hf.get("moe_intermediate_size"), hf.get("moe_renormalize", True),
                                 hf.get("routed_scaling_factor", 1.0), hf.get("num_shared_experts", 0) or 0,
                                 _first(hf, "num_expert_group", default=1), _first(hf, "topk_group", default=1))
        latent = hf.get("routed_expert_hidden_size")
        cfg["moe"].update(expert_hidden=int(latent or hf["hidden_size"]), latent=bool(latent),
                          latent_norm=bool(latent and hf.get("latent_moe_use_norm", False)),
                          expert_act="situ_glu", situ_beta=cfg["situ"]["beta"],
                          situ_linear_beta=cfg["situ"]["linear_beta"])
        return cfg

    def trunk_names(self):
        return list(self.expected_shapes())

