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
    a_log_rule = "numel"      # A_log stored [1, 1, H, 1]: its values, not its layout (shape_ok)

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

    def expected_shapes(self) -> dict[str, tuple]:
        """Every trunk tensor's checkpoint name -> its shape from config.json; ("numel", n) where releases store
        one tensor in more than one layout (conv weights [C, 1, K] or [C, K]; A_log, dt_bias). Kimi K3's parts
        (attention residuals, full-rank gates, output gates, latent MoE) where its config has them."""
        c = self.config
        D, V, (k, m, moe) = c["hidden_size"], c["vocab_size"], (c["kda"], c["mla"], c["moe"])
        out = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D]}
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = [V, D]
        res = c.get("attn_res_block_size") is not None
        if res:
            out.update({"model.output_attn_res_norm.weight": [D], "model.output_attn_res_proj.weight": [1, D]})
        H, d, C = k["num_heads"], k["head_dim"], k["num_heads"] * k["head_dim"]
        Hm, nope, rope, vd = m["num_heads"], m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
        for i, l in enumerate(c["layers"]):
            p = f"model.layers.{i}"
            a = f"{p}.self_attn"
            out.update({f"{p}.input_layernorm.weight": [D], f"{p}.post_attention_layernorm.weight": [D]})
            if res:
                for r in ("self_attention_res", "mlp_res"):
                    out.update({f"{p}.{r}_norm.weight": [D], f"{p}.{r}_proj.weight": [1, D]})
            if l["attn"] == "kda":
                out.update({f"{a}.{x}_proj.weight": [C, D] for x in "qkv"})
                out.update({f"{a}.{x}_conv1d.weight": ("numel", C * k["conv_kernel"]) for x in "qkv"})
                out.update({f"{a}.f_a_proj.weight": [d, D], f"{a}.f_b_proj.weight": [C, d],
                            f"{a}.b_proj.weight": [H, D], f"{a}.A_log": (self.a_log_rule, H),
                            f"{a}.dt_bias": ("numel", C), f"{a}.o_norm.weight": [d], f"{a}.o_proj.weight": [D, C]})
                if k.get("full_rank_gate"):
                    out[f"{a}.g_proj.weight"] = [C, D]
                else:
                    out.update({f"{a}.g_a_proj.weight": [d, D], f"{a}.g_b_proj.weight": [C, d]})
            else:
                qr, kvr = m["q_lora_rank"], m["kv_lora_rank"]
                if qr:
                    out.update({f"{a}.q_a_proj.weight": [qr, D], f"{a}.q_a_layernorm.weight": [qr],
                                f"{a}.q_b_proj.weight": [Hm * (nope + rope), qr]})
                else:
                    out[f"{a}.q_proj.weight"] = [Hm * (nope + rope), D]
                out.update({f"{a}.kv_a_proj_with_mqa.weight": [kvr + rope, D], f"{a}.kv_a_layernorm.weight": [kvr],
                            f"{a}.kv_b_proj.weight": [Hm * (nope + vd), kvr], f"{a}.o_proj.weight": [D, Hm * vd]})
                if m.get("output_gate"):
                    out[f"{a}.g_proj.weight"] = [Hm * vd, D]
            if l["mlp"] == "dense":
                I = c["intermediate_size"]
                out.update({f"{p}.mlp.gate_proj.weight": [I, D], f"{p}.mlp.up_proj.weight": [I, D],
                            f"{p}.mlp.down_proj.weight": [D, I]})
                continue
            b = f"{p}.block_sparse_moe"
            out.update({f"{b}.gate.weight": [moe["num_experts"], D],
                        f"{b}.gate.e_score_correction_bias": [moe["num_experts"]]})
            if moe.get("latent"):
                L = moe["expert_hidden"]
                out.update({f"{b}.routed_expert_down_proj.weight": [L, D], f"{b}.routed_expert_up_proj.weight": [D, L]})
                if moe["latent_norm"]:
                    out[f"{b}.routed_expert_norm.weight"] = [L]
            if moe["num_shared_experts"]:
                S = moe["shared_intermediate_size"]
                out.update({f"{b}.shared_experts.gate_proj.weight": [S, D], f"{b}.shared_experts.up_proj.weight": [S, D],
                            f"{b}.shared_experts.down_proj.weight": [D, S]})
        return out

    def layer_names(self, i, layer, p):
        a = f"{p}.self_attn"
        attn = self._kda_names(a) if layer["attn"] == "kda" else self._mla_names(a)
        return attn + self._sigmoid_mlp_names(p, layer, "block_sparse_moe")
