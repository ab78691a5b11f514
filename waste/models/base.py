"""The decoder skeleton every family shares: embed, N x (attention, MLP) with pre-norm residuals, norm, head.

A family subclass says how one layer attends and what state it carries. The routed experts are not
here: the model asks the runtime's expert store to apply the chosen experts to its rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.mlp import dense_mlp
from ..layers.norm import rms_norm
from ..quant.linear import linear
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
        self.swiglu_limit = config.get("swiglu_limit")   # clamped SwiGLU in every MLP (None: plain)

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
            return dense_mlp(x, lw, "mlp.", self.swiglu_limit)
        weights, idx = self.route(i, x)
        if self.route_trace is not None:
            self.route_trace.append((i, idx.clone()))
        y = self.experts.apply(i, x, idx, weights)
        if self.moe.get("num_shared_experts"):
            y = y + dense_mlp(x, lw, "mlp.shared_experts.", self.swiglu_limit)
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
        return linear(rms_norm(x, self.norm, self.eps), self.head).float()

    def mlp_many(self, i: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """mlp(i, x) for each sequence's rows, bit for bit; a MoE layer asks the expert store once for all."""
        if self.cfg["layers"][i]["mlp"] == "dense" or len(xs) == 1 or not hasattr(self.experts, "apply_many"):
            return [self.mlp(i, x) for x in xs]
        lw, routed = self.layers[i], [self.route(i, x) for x in xs]
        if self.route_trace is not None:
            self.route_trace.extend((i, idx.clone()) for _, idx in routed)
        ys = self.experts.apply_many(i, [(x, idx, w) for x, (w, idx) in zip(xs, routed)])
        if self.moe.get("num_shared_experts"):
            ys = [y + dense_mlp(x, lw, "mlp.shared_experts.", self.swiglu_limit) for x, y in zip(xs, ys)]
        return ys

    @torch.inference_mode()
    def forward_batch(self, items: list) -> list[torch.Tensor]:
        """items [(ids [T], state, start)], one per sequence -> float32 logits [1, V] each, bit-identical to
        forward(ids, state, start, last_only=True) on that sequence alone. Rows of different sequences never
        share a matmul (its last bits depend on its row count); they share the expert store: each MoE layer makes
        the union of their experts resident once, so one read serves every sequence routed to an expert. A
        family with its own forward (GLM-5.3's mHC streams) runs its sequences one after another."""
        if type(self).forward is not DecoderModel.forward or len(items) == 1:
            return [self.forward(ids, state, start, last_only=True) for ids, state, start in items]
        xs = [F.embedding(ids, self.embed) for ids, _, _ in items]
        positions = [torch.arange(start, start + ids.shape[0]) for ids, _, start in items]
        for i, lw in enumerate(self.layers):
            hs = []
            for j, (_, state, _) in enumerate(items):
                a, state[i] = self.attend(i, rms_norm(xs[j], lw["input_layernorm.weight"], self.eps), state[i],
                                          positions[j])
                xs[j] = xs[j] + a
                hs.append(rms_norm(xs[j], lw["post_attention_layernorm.weight"], self.eps))
            xs = [x + y for x, y in zip(xs, self.mlp_many(i, hs))]
        return [linear(rms_norm(x[-1:], self.norm, self.eps), self.head).float() for x in xs]
