"""Qwen3-MoE: GQA with RoPE and per-head q/k norm; softmax top-k router; optional dense layers."""
from __future__ import annotations

from ..layers.attention import GQAConfig, KVCache, gqa_forward
from ..layers.rope import RopeTable
from ..quant.linear import fuse_rows
from .base import DecoderModel
from .family import Family


def fuse_qkv(w: dict) -> dict:
    """q, k and v as one matrix (`qkv_proj.weight`) when their storage stacks (quant/linear.py fuse_rows)."""
    names = [f"{p}_proj.weight" for p in "qkv"]
    if any(f"{p}_proj.bias" in w for p in "qkv"):
        return w
    fused = fuse_rows([w[n] for n in names])
    if fused is None:
        return w
    return {"qkv_proj.weight": fused, **{k: v for k, v in w.items() if k not in names}}


class Qwen3Moe(DecoderModel):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset(), **kw):
        super().__init__(config, trunk, experts, dtype, f32_names, **kw)
        g = config["gqa"]
        self.attn_cfg = GQAConfig(g["num_heads"], g["num_kv_heads"], g["head_dim"], g["rope_theta"], g["qk_norm"],
                                  config["rms_norm_eps"])
        self.attn_w = [fuse_qkv({k[len("self_attn."):]: v for k, v in lw.items() if k.startswith("self_attn.")})
                       for lw in self.layers]
        for lw in self.layers:           # the fused copies replace them (not kept twice)
            for k in [k for k in lw if k.startswith("self_attn.") and k.endswith(("q_proj.weight", "k_proj.weight",
                                                                                   "v_proj.weight"))]:
                del lw[k]
        self.rope = RopeTable(g["head_dim"], g["rope_theta"], self.capacity, dtype, self.device)

    def new_layer_state(self, i):
        return KVCache.empty(self.attn_cfg, self.dtype, self.capacity, self.device)

    def attend(self, i, x, state, positions, scratch):
        static = scratch.get("static")       # a captured decode step: the position is a tensor (models/graphs.py)
        if "rope" not in scratch:            # once per sequence and step, shared by every layer
            if static is not None:
                at = static[0]
                scratch["rope"] = (self.rope.cos.index_select(0, at), self.rope.sin.index_select(0, at), self.rope.R)
            else:
                scratch["rope"] = (*self.rope.at(scratch["start"], x.shape[0]), self.rope.R)
        if static is not None:              # the whole tables: a fused GPU row reads its position's own
            static = (*static, (self.rope.cos, self.rope.sin))
        return gqa_forward(x, self.attn_w[i], self.attn_cfg, state, scratch["rope"], static)

    def graph_state(self, state, start: int):
        """The buffers a captured decode step of this sequence writes (the key of its graph), or None where one
        cannot run: a cache that would branch or grow, or a position past the rope table."""
        if start + 1 > self.rope.cos.shape[0] or not all(s.can_put(1) for s in state):
            return None
        return tuple(b.data_ptr() for s in state for b in s.buffers())


FAMILY = Family("qwen3_moe", Qwen3Moe, "adapter_qwen3_moe:Qwen3MoeAdapter",
                chat="chatml", title="Qwen3-MoE")
