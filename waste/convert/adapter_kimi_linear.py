"""Kimi-Linear's adapter (`kimi_linear`): KDA layers beside MLA ones, a sigmoid router with correction bias, shared
experts, dense first layers. Kimi K3's adapter (adapter_kimi_k3.py) extends it."""
from __future__ import annotations

import re

from ..errors import WasteError
from .adapter_base import Adapter, _first, sigmoid_moe

# keys only K3 has: a flat text config carrying them is a K3 (model_type kimi_linear too), never a Kimi-Linear one
K3_KEYS = ("attn_res_block_size", "routed_expert_hidden_size", "activation_situ_beta")


def is_k3(hf: dict) -> bool:
    return "kimi_k3" in (hf.get("model_type"), hf.get("outer_model_type")) or any(hf.get(k) is not None for k in K3_KEYS)


class KimiLinearAdapter(Adapter):
    family = "kimi_linear"
    expert_re = re.compile(r"model\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<name>w1|w2|w3)\.weight")
    expert_fmt = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}.weight"
    expert_names = {"w1": "gate", "w3": "up", "w2": "down"}
    keep_f32 = ("mlp.gate.weight", "A_log", "dt_bias", "e_score_correction_bias")
    keep_float = ("kv_b_proj.weight",)   # MLA's kv_b_proj is split per head in the absorbed decode path

    @classmethod
    def claims(cls, hf):
        return not is_k3(hf)

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
