"""Family adapters: a release's config.json -> the engine's normalised config, and checkpoint
tensor names -> trunk names or (layer, expert, matrix) slots in an expert bank.

Trunk names are the checkpoint's names without the `model.` prefix, so a person can match a
container tensor with the release's; only the MoE block is renamed to one spelling (`mlp.`).
"""
from __future__ import annotations

import re

from ..errors import WasteError
from .adapter_base import Adapter, _first, _rope_theta, sigmoid_moe
from .adapter_deepseek import DeepseekV3Adapter
from .adapter_glm5 import Glm5NextAdapter


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


class KimiLinearAdapter(Adapter):
    family = "kimi_linear"
    expert_re = re.compile(r"model\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<name>w1|w2|w3)\.weight")
    expert_fmt = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}.weight"
    expert_names = {"w1": "gate", "w3": "up", "w2": "down"}
    keep_f32 = ("mlp.gate.weight", "A_log", "dt_bias", "e_score_correction_bias")

    _dense_alias = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)")

    def canonical(self, name):
        # transformers' save_pretrained writes the dense layer's MLP under block_sparse_moe too
        return self._dense_alias.sub(r"\1.mlp.\2", name)

    def trunk_target(self, name):
        return name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")

    def normalise(self, hf):
        n = hf["num_hidden_layers"]
        lac = hf.get("linear_attn_config") or {}
        if hf.get("layer_types"):
            kinds = ["kda" if t == "linear_attention" else "mla" for t in hf["layer_types"]]
        else:  # the release's lists are 1-indexed (architectures.md §1.6)
            kda = set(lac.get("kda_layers") or [])
            kinds = ["kda" if (i + 1) in kda else "mla" for i in range(n)]
        if hf.get("mlp_layer_types"):
            mlps = ["moe" if t == "sparse" else "dense" for t in hf["mlp_layer_types"]]
        else:
            fk = hf.get("first_k_dense_replace", 0)
            mlps = ["dense" if i < fk else "moe" for i in range(n)]
        cfg = self._base(hf, [{"attn": a, "mlp": m} for a, m in zip(kinds, mlps)])
        heads = hf["num_attention_heads"]
        cfg["mla"] = {"num_heads": heads, "q_lora_rank": hf.get("q_lora_rank"), "kv_lora_rank": hf["kv_lora_rank"],
                      "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
                      "v_head_dim": hf["v_head_dim"], "rope": None,
                      "norm_eps": 1e-6}   # transformers' kv_a_layernorm keeps RMSNorm's default eps
        cfg["kda"] = {"num_heads": _first(lac, "num_heads", default=hf.get("linear_num_heads")),
                      "head_dim": _first(lac, "head_dim", default=hf.get("linear_head_dim")),
                      "conv_kernel": _first(lac, "short_conv_kernel_size", default=hf.get("linear_conv_kernel_dim", 4))}
        n_exp = _first(hf, "num_experts", "num_local_experts")
        n_shared = _first(hf, "num_shared_experts", "n_shared_experts", default=0)
        act = hf.get("moe_router_activation_func", "sigmoid")
        if act != "sigmoid":
            raise WasteError(f"kimi_linear with moe_router_activation_func={act!r} is not supported (only sigmoid)")
        cfg["moe"] = sigmoid_moe(n_exp, _first(hf, "num_experts_per_token", "num_experts_per_tok"),
                                 hf["moe_intermediate_size"],
                                 _first(hf, "moe_renormalize", "norm_topk_prob", default=True),
                                 hf.get("routed_scaling_factor", 1.0), n_shared,
                                 _first(hf, "num_expert_group", "n_group", default=1), _first(hf, "topk_group", default=1))
        return cfg

    def layer_names(self, i, layer, p):
        a = f"{p}.self_attn"
        attn = self._kda_names(a) if layer["attn"] == "kda" else self._mla_names(a)
        return attn + self._sigmoid_mlp_names(p, layer, "block_sparse_moe")


ADAPTERS = {a.family: a for a in (Qwen3MoeAdapter, KimiLinearAdapter)}
ADAPTERS.update({"glm5_next": Glm5NextAdapter, "glm5_next_text": Glm5NextAdapter,
                 "deepseek_v3": DeepseekV3Adapter, "kimi_k2": DeepseekV3Adapter})


def adapter_for(hf: dict) -> Adapter:
    mt = hf.get("model_type")
    if mt not in ADAPTERS:
        raise WasteError(f"unsupported model_type {mt!r}; waste can convert: {', '.join(ADAPTERS)}")
    return ADAPTERS[mt](hf)
