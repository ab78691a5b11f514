"""GLM-5.3-Flash (`glm5_next`), text: KDA with a lower-bound gate on most layers, DSA over k-pools on the MLA layers
(no rotary), mHC residual streams around every sublayer, clamped SwiGLU in every MLP, a sigmoid router with
correction bias and shared experts.

The layer loop differs from the shared skeleton's only in the residual: hc_mult streams instead of one
(layers/mhc.py), plugged in through the skeleton's block hooks, so GLM-5.3 is batched like every family. Set `dsa_trace = []` to record every DSA selection, or WASTE_DUMP_DSA=1 (or `dump_dsa = True`)
to print, per layer and query, which pools won and on what scores.
"""
from __future__ import annotations


from ..layers.dsa import DSACache, DSAConfig, dsa_forward, trace_lines
from ..layers.kda import KDAConfig, KDAState, kda_forward
from ..layers.mhc import MHCConfig, hc_expand, hc_mean, hc_merge, hc_split
from ..layers.mla import MLAConfig
from .base import DecoderModel
from .family import Family


class Glm5Next(DecoderModel):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset(), **kw):
        super().__init__(config, trunk, experts, dtype, f32_names, **kw)
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
        self.dsa_dump = None      # callable(lines): each indexer selection in words (Engine.load(dump_dsa=True))

    def new_layer_state(self, i):
        if self.kinds[i] == "kda":
            return KDAState.empty(self.kda_cfg, self.dtype, self.device)
        return DSACache.empty(self.mla_cfg, self.dsa_cfg, self.indexer[i] == "full", self.dtype, self.device,
                              self.capacity)

    def fixed_state(self, i, st):
        # a KDA layer's state has fixed shapes: the whole layer's decode row is captured (graphs.py `layer`)
        return (st.tensors(), KDAState.of) if self.kinds[i] == "kda" and isinstance(st, KDAState) else None

    def attend(self, i, x, state, positions, scratch):
        if self.kinds[i] == "kda":
            return kda_forward(x, self.attn_w[i], self.kda_cfg, state)
        tracing = self.dsa_trace is not None or self.dsa_dump is not None
        start = len(state)
        # a layer without its own indexer reuses the selection of the last one with it, within this step
        out, state, sel = dsa_forward(x, self.attn_w[i], self.mla_cfg, self.dsa_cfg, state, positions,
                                      shared=scratch.get("dsa"), want_scores=tracing)
        if self.indexer[i] == "full":
            scratch["dsa"] = sel
        if self.dsa_trace is not None:
            self.dsa_trace.append((i, start, sel))
        if self.dsa_dump is not None and self.indexer[i] == "full":
            self.dsa_dump(trace_lines(i, start, sel, self.dsa_cfg.kpool))
        return out, state

    # -- mHC: hc_mult residual streams instead of one --------------------------------------------------
    def stream_in(self, x):
        return hc_expand(x, self.hc_cfg.hc_mult)

    def block_in(self, i, which, X):
        lw, p = self.layers[i], "hc_attn_" if which == "attn" else "hc_ffn_"
        u, post, M = hc_split(X, lw[p + "fn"], lw[p + "base"], lw[p + "scale"], self.hc_cfg)
        return u, (post, M)

    def block_out(self, i, which, X, y, ctx):
        return hc_merge(X, y, *ctx)

    def stream_out(self, X):
        return hc_mean(X)


def _features(cfg: dict) -> list[str]:
    h = cfg["mhc"]
    return [f"mHC: {h['hc_mult']} residual streams, Sinkhorn-projected mixing ({h['sinkhorn_iters']} "
            f"iterations, eps {h['eps']:g}), mean collapse at the end"]


FAMILY = Family("glm5_next", Glm5Next, "adapter_glm5:Glm5NextAdapter",
                model_types=("glm5_next", "glm5_next_text"), chat="glm5", features=_features, title="GLM-5.3-Flash")
