"""Kimi K3 (`kimi_k3`), text: KDA (full-rank output gate, lower-bound decay gate) on most layers, MLA without
rotary and with an output gate on the rest, attention residuals over blocks of layers, a latent MoE with SiTU-GLU
experts, SiTU-GLU shared experts and dense first layer, a sigmoid router with correction bias.

The shared skeleton runs it; what differs plugs in through its hooks: the residual (block hooks: each sublayer
reads a softmax mix of the finished block summaries and the current block's partial sum, layers/attn_res.py), the
MoE's latent width (expert_in / expert_out, layers/latent_moe.py) and SiTU-GLU in the dense MLPs (ffn).
"""
from __future__ import annotations

from ..layers.attn_res import inv_rms, res_key, res_mix
from ..layers.kda import KDAConfig
from ..layers.latent_moe import from_latent, to_latent
from ..layers.mla import MLAConfig
from ..layers.mlp import situ_mlp
from ..layers.router import sigmoid_grouped_topk
from .base import DecoderModel
from .family import Family
from .kimi_linear import KimiLinear


class KimiK3(KimiLinear):
    """Kimi-Linear's layer state and attention (with K3's gates in its configs); everything else below."""

    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset(), **kw):
        DecoderModel.__init__(self, config, trunk, experts, dtype, f32_names, **kw)   # K3 builds its own configs
        k, m = config["kda"], config["mla"]
        self.kda_cfg = KDAConfig(k["num_heads"], k["head_dim"], k["conv_kernel"], config["rms_norm_eps"],
                                 k.get("gate_lower_bound"), bool(k.get("full_rank_gate")))
        self.mla_cfg = MLAConfig(m["num_heads"], m["q_lora_rank"], m["kv_lora_rank"], m["qk_nope_head_dim"],
                                 m["qk_rope_head_dim"], m["v_head_dim"], m.get("norm_eps", 1e-6),
                                 (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]) ** -0.5, None,
                                 bool(m.get("output_gate")))
        self.kinds = [l["attn"] for l in config["layers"]]
        self.attn_w = [{k[len("self_attn."):]: v for k, v in lw.items() if k.startswith("self_attn.")}
                       for lw in self.layers]
        H = self.kda_cfg.num_heads
        for kind, w in zip(self.kinds, self.attn_w):
            if kind == "kda":   # a release may store A_log wider than the head count: the first H are the heads'
                w["A_log"] = w["A_log"].reshape(-1)[:H]
        s = config["situ"]
        self.situ = (s["beta"], s["linear_beta"])
        self.block = config.get("attn_res_block_size")
        if self.block:
            self.res_keys = [(res_key(lw["self_attention_res_norm.weight"], lw["self_attention_res_proj.weight"]),
                              res_key(lw["mlp_res_norm.weight"], lw["mlp_res_proj.weight"])) for lw in self.layers]
            t = {k: v for k, v in trunk.items() if k.startswith("output_attn_res_")}
            self.out_key = res_key(t["output_attn_res_norm.weight"], t["output_attn_res_proj.weight"]).to(self.device)


    def fixed_state(self, i, st):
        # K3's layers carry attention-residual streams and their own loop: no whole-layer graph (graphs.py `layer`)
        return None
    def route(self, i, x):
        m = self.moe   # renormalised only with more than one expert, as the release's router does
        return sigmoid_grouped_topk(x, self.layers[i]["mlp.gate.weight"], self.layers[i].get(
            "mlp.gate.e_score_correction_bias"), self.top_k, m["n_group"], m["topk_group"],
            m["norm_topk_prob"] and self.top_k > 1, m["routed_scaling_factor"])

    def ffn(self, x, lw, prefix):
        return situ_mlp(x, lw, prefix, *self.situ)

    def expert_in(self, i, x):
        return to_latent(x, self.layers[i], "mlp.") if self.moe.get("latent") else x

    def expert_out(self, i, y):
        return from_latent(y, self.layers[i], "mlp.", self.eps) if self.moe.get("latent") else y

    # -- attention residuals: the stream is the finished blocks' summaries and the current block's partial sum -----
    def stream_in(self, x):
        return _Stream(x) if self.block else x

    def block_in(self, i, which, S):
        if not self.block:
            return S, None
        k_attn, k_mlp = self.res_keys[i]
        h = res_mix(S.blocks, S.scales, S.partial, k_attn if which == "attn" else k_mlp, self.eps)
        if which == "attn" and i % self.block == 0:     # the block closes before this layer's attention
            S.blocks.append(S.partial)
            S.scales.append(inv_rms(S.partial, self.eps))
            S.partial = None
        return h, None

    def block_out(self, i, which, S, y, ctx):
        if not self.block:
            return S + y
        S.partial = y if S.partial is None else S.partial + y
        return S

    def stream_out(self, S):
        return res_mix(S.blocks, S.scales, S.partial, self.out_key, self.eps) if self.block else S


class _Stream:
    """One sequence's residual under attention residuals, within one step (layers/attn_res.py)."""

    __slots__ = ("blocks", "scales", "partial")

    def __init__(self, x):
        self.blocks, self.scales, self.partial = [], [], x


def _features(cfg: dict) -> list[str]:
    return [f"attention residuals: each sublayer reads a softmax mix of the residual stream's block summaries "
            f"(a block every {cfg['attn_res_block_size']} layers) and the current partial sum"]


FAMILY = Family("kimi_k3", KimiK3, "adapter_kimi_k3:KimiK3Adapter",
                model_types=("kimi_k3", "kimi_linear"), features=_features, title="Kimi K3")
