"""Kimi K3 (`kimi_k3`), text: KDA (full-rank output gate, lower-bound decay gate) on most layers, MLA without
rotary and with an output gate on the rest, attention residuals over blocks of layers, a latent MoE with SiTU-GLU
experts, SiTU-GLU shared experts and dense first layer, a sigmoid router with correction bias.

The layer loop differs from the shared skeleton's in the residual: each sublayer reads a softmax mix of the
finished block summaries and the current block's partial sum (layers/attn_res.py), and in the MoE, whose routed
experts run in the latent width (layers/latent_moe.py); the expert store applies them as for any family.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.attn_res import inv_rms, res_key, res_mix
from ..layers.kda import KDAConfig, KDAState, kda_forward
from ..layers.latent_moe import from_latent, to_latent
from ..layers.mla import MLACache, MLAConfig, mla_forward
from ..layers.mlp import situ_mlp
from ..layers.norm import rms_norm
from ..layers.router import sigmoid_grouped_topk
from ..quant.linear import linear
from .base import DecoderModel


class KimiK3(DecoderModel):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset()):
        super().__init__(config, trunk, experts, dtype, f32_names)
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
            self.out_key = res_key(t["output_attn_res_norm.weight"], t["output_attn_res_proj.weight"])

    def new_layer_state(self, i):
        if self.kinds[i] == "kda":
            return KDAState.empty(self.kda_cfg, self.dtype)
        return MLACache.empty(self.mla_cfg, self.dtype)

    def attend(self, i, x, state, positions):
        if self.kinds[i] == "kda":
            return kda_forward(x, self.attn_w[i], self.kda_cfg, state)
        return mla_forward(x, self.attn_w[i], self.mla_cfg, state, positions)

    def route(self, i, x):
        m = self.moe   # renormalised only with more than one expert, as the release's router does
        return sigmoid_grouped_topk(x, self.layers[i]["mlp.gate.weight"], self.layers[i].get(
            "mlp.gate.e_score_correction_bias"), self.top_k, m["n_group"], m["topk_group"],
            m["norm_topk_prob"] and self.top_k > 1, m["routed_scaling_factor"])

    def mlp(self, i, x):
        lw = self.layers[i]
        if self.cfg["layers"][i]["mlp"] == "dense":
            return situ_mlp(x, lw, "mlp.", *self.situ)
        weights, idx = self.route(i, x)
        if self.route_trace is not None:
            self.route_trace.append((i, idx.clone()))
        if self.moe.get("latent"):
            y = from_latent(self.experts.apply(i, to_latent(x, lw, "mlp."), idx, weights), lw, "mlp.", self.eps)
        else:
            y = self.experts.apply(i, x, idx, weights)
        if self.moe.get("num_shared_experts"):
            y = y + situ_mlp(x, lw, "mlp.shared_experts.", *self.situ)
        return y

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, state: list, start: int, last_only: bool = False) -> torch.Tensor:
        """ids [T] continuing a sequence of `start` tokens; returns float32 logits [T, V] (or [1, V])."""
        x = F.embedding(ids, self.embed)
        positions = torch.arange(start, start + ids.shape[0])
        if not self.block:
            for i, lw in enumerate(self.layers):
                a, state[i] = self.attend(i, rms_norm(x, lw["input_layernorm.weight"], self.eps), state[i], positions)
                x = x + a
                x = x + self.mlp(i, rms_norm(x, lw["post_attention_layernorm.weight"], self.eps))
        else:
            x = self._residual_blocks(x, state, positions)
        if last_only:
            x = x[-1:]
        return linear(rms_norm(x, self.norm, self.eps), self.head).float()

    def _residual_blocks(self, x, state, positions):
        """The layers under attention residuals (layers/attn_res.py says when a block closes); the final mix."""
        blocks, scales, partial = [], [], x
        for i, lw in enumerate(self.layers):
            k_attn, k_mlp = self.res_keys[i]
            h = res_mix(blocks, scales, partial, k_attn, self.eps)
            if i % self.block == 0:
                blocks.append(partial)
                scales.append(inv_rms(partial, self.eps))
                partial = None
            a, state[i] = self.attend(i, rms_norm(h, lw["input_layernorm.weight"], self.eps), state[i], positions)
            partial = a if partial is None else partial + a
            h = res_mix(blocks, scales, partial, k_mlp, self.eps)
            partial = partial + self.mlp(i, rms_norm(h, lw["post_attention_layernorm.weight"], self.eps))
        return res_mix(blocks, scales, partial, self.out_key, self.eps)
