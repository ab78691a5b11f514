"""The decoder skeleton every family shares: embed, N x (attention, MLP) with pre-norm residuals, norm, head.

A family subclass says how one layer attends and what state it carries. The routed experts are not
here: the model asks the runtime's expert store to apply the chosen experts to its rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.mlp import dense_mlp
from ..layers.norm import rms_norm
from ..layers.router import sigmoid_grouped_topk, softmax_topk


class DecoderModel:
    def __init__(self, config: dict, trunk: dict[str, torch.Tensor], experts, dtype: torch.dtype,
                 f32_names: set[str] = frozenset()):
        self.cfg, self.experts, self.dtype = config, experts, dtype
        self.eps = config["rms_norm_eps"]
        w = {k: (v if k in f32_names else v.to(dtype)) for k, v in trunk.items()}
        self.embed = w["embed_tokens.weight"]
        self.norm = w["norm.weight"]
        self.head = self.embed if config["tie_word_embeddings"] else w["lm_head.weight"]
        self.layers = []
        for i in range(config["num_layers"]):
            p = f"layers.{i}."
            self.layers.append({k[len(p):]: v for k, v in w.items() if k.startswith(p)})
        self.moe = config.get("moe") or {}
        self.top_k = self.moe.get("top_k")
        self.route_trace: list | None = None   # set to [] to record (layer, expert ids) per forward

    # -- family hooks --------------------------------------------------------------------------------
    def new_layer_state(self, i: int):
        raise NotImplementedError

    def attend(self, i: int, x: torch.Tensor, state, positions: torch.Tensor):
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------------
    def new_state(self) -> list:
        return [self.new_layer_state(i) for i in range(len(self.layers))]

    def route(self, i: int, x: torch.Tensor):
        lw, m = self.layers[i], self.moe
        if m["scoring"] == "softmax":
            return softmax_topk(x, lw["mlp.gate.weight"], self.top_k, m["norm_topk_prob"])
        return sigmoid_grouped_topk(x, lw["mlp.gate.weight"], lw.get("mlp.gate.e_score_correction_bias"), self.top_k,
                                    m["n_group"], m["topk_group"], m["norm_topk_prob"], m["routed_scaling_factor"])

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        lw = self.layers[i]
        if self.cfg["layers"][i]["mlp"] == "dense":
            return dense_mlp(x, lw, "mlp.")
        weights, idx = self.route(i, x)
        if self.route_trace is not None:
            self.route_trace.append((i, idx.clone()))
        y = self.experts.apply(i, x, idx, weights)
        if self.moe.get("num_shared_experts"):
            y = y + dense_mlp(x, lw, "mlp.shared_experts.")
        return y

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, state: list, start: int, last_only: bool = False) -> torch.Tensor:
        """ids [T] continuing a sequence of `start` tokens; returns float32 logits [T, V] (or [1, V])."""
        x = F.embedding(ids, self.embed)
        positions = torch.arange(start, start + ids.shape[0])
        for i, lw in enumerate(self.layers):
            a, state[i] = self.attend(i, rms_norm(x, lw["input_layernorm.weight"], self.eps), state[i], positions)
            x = x + a
            x = x + self.mlp(i, rms_norm(x, lw["post_attention_layernorm.weight"], self.eps))
        if last_only:
            x = x[-1:]
        return F.linear(rms_norm(x, self.norm, self.eps), self.head).float()
