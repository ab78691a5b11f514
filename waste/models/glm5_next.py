"""GLM-5.3-Flash (`glm5_next`), text: KDA with a lower-bound gate on most layers, DSA over k-pools on the MLA layers
(no rotary), mHC residual streams around every sublayer, clamped SwiGLU in every MLP, a sigmoid router with
correction bias and shared experts.

The layer loop differs from the shared skeleton's only in the residual: hc_mult streams instead of one
(layers/mhc.py). Set `dsa_trace = []` to record every DSA selection, or WASTE_DUMP_DSA=1 (or `dump_dsa = True`)
to print, per layer and query, which pools won and on what scores.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from ..layers.dsa import DSACache, DSAConfig, dsa_forward, trace_lines
from ..layers.kda import KDAConfig, KDAState, kda_forward
from ..layers.mhc import MHCConfig, hc_expand, hc_mean, hc_merge, hc_split
from ..layers.mla import MLAConfig
from ..layers.norm import rms_norm
from ..quant.linear import linear
from .base import DecoderModel


class Glm5Next(DecoderModel):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset()):
        super().__init__(config, trunk, experts, dtype, f32_names)
        k, m, d, h = config["kda"], config["mla"], config["dsa"], config["mhc"]
        self.kda_cfg = KDAConfig(k["num_heads"], k["head_dim"], k["conv_kernel"], config["rms_norm_eps"],
                                 k.get("gate_lower_bound"))
        self.mla_cfg = MLAConfig(m["num_heads"], m["q_lora_rank"], m["kv_lora_rank"], m["qk_nope_head_dim"],
                                 m["qk_rope_head_dim"], m["v_head_dim"], m["norm_eps"],
                                 (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]) ** -0.5, None)
        self.dsa_cfg = DSAConfig(d["index_n_heads"], d["index_head_dim"], d["index_topk"], d["index_kpool"])
        self.hc_cfg = MHCConfig(h["hc_mult"], h["sinkhorn_iters"], h["eps"], config["rms_norm_eps"])
        self.kinds = [l["attn"] for l in config["layers"]]
        self.indexer = d["indexer_types"]
        self.attn_w = [{k[len("self_attn."):]: v for k, v in lw.items() if k.startswith("self_attn.")}
                       for lw in self.layers]
        self.dsa_trace: list | None = None      # set to [] to record (layer, start, Selection) per DSA layer call
        self.dump_dsa = os.environ.get("WASTE_DUMP_DSA", "0") not in ("", "0")
        self._shared = None                     # the last full indexer layer's selection, within one forward

    def new_layer_state(self, i):
        if self.kinds[i] == "kda":
            return KDAState.empty(self.kda_cfg, self.dtype)
        return DSACache.empty(self.mla_cfg, self.dsa_cfg, self.indexer[i] == "full", self.dtype)

    def attend(self, i, x, state, positions):
        if self.kinds[i] == "kda":
            return kda_forward(x, self.attn_w[i], self.kda_cfg, state)
        tracing = self.dsa_trace is not None or self.dump_dsa
        start = len(state)
        out, state, sel = dsa_forward(x, self.attn_w[i], self.mla_cfg, self.dsa_cfg, state, positions,
                                      shared=self._shared, want_scores=tracing)
        if self.indexer[i] == "full":
            self._shared = sel
        if self.dsa_trace is not None:
            self.dsa_trace.append((i, start, sel))
        if self.dump_dsa and self.indexer[i] == "full":
            print("\n".join(trace_lines(i, start, sel, self.dsa_cfg.kpool)), file=sys.stderr, flush=True)
        return out, state

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, state: list, start: int, last_only: bool = False) -> torch.Tensor:
        """ids [T] continuing a sequence of `start` tokens; returns float32 logits [T, V] (or [1, V])."""
        X = hc_expand(F.embedding(ids, self.embed), self.hc_cfg.hc_mult)
        positions = torch.arange(start, start + ids.shape[0])
        self._shared = None
        for i, lw in enumerate(self.layers):
            u, post, M = hc_split(X, lw["hc_attn_fn"], lw["hc_attn_base"], lw["hc_attn_scale"], self.hc_cfg)
            a, state[i] = self.attend(i, rms_norm(u, lw["input_layernorm.weight"], self.eps), state[i], positions)
            X = hc_merge(X, a, post, M)
            u, post, M = hc_split(X, lw["hc_ffn_fn"], lw["hc_ffn_base"], lw["hc_ffn_scale"], self.hc_cfg)
            X = hc_merge(X, self.mlp(i, rms_norm(u, lw["post_attention_layernorm.weight"], self.eps)), post, M)
        self._shared = None
        x = hc_mean(X)
        if last_only:
            x = x[-1:]
        return linear(rms_norm(x, self.norm, self.eps), self.head).float()
