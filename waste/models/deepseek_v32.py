"""DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3 (MLA with q-LoRA and interleaved YaRN rotary, sigmoid grouped
router, shared experts, dense first layers) with DSA on every layer: a lightning indexer per layer scores every
visible token and each query attends to its index_topk best (dense while the context is not longer).

The indexer is GLM-5.3's (layers/dsa.py) at kpool 1 without the compress gate, plus the rotary V3.2 puts on the
first qk_rope_head_dim channels of the index query and key, half-split (not interleaved as MLA's), with MLA's
frequencies and YaRN factor. Set `dsa_trace = []` to record each layer's selection (the tests compare it).
"""
from __future__ import annotations

from ..layers.dsa import DSACache, DSAConfig, dsa_forward
from ..layers.yarn import make_rope
from .deepseek_v3 import DeepseekV3
from .family import Family


class DeepseekV32(DeepseekV3):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset(), **kw):
        super().__init__(config, trunk, experts, dtype, f32_names, **kw)
        m, d = config["mla"], config["dsa"]
        r = d["index_rope_dim"]
        rope = make_rope(dict(m["rope"], interleave=False), r) if r else None
        self.dsa_cfg = DSAConfig(d["index_n_heads"], d["index_head_dim"], d["index_topk"], 1, pooled=False,
                                 rope=rope, rope_dim=r)
        self.dsa_trace: list | None = None      # set to [] to record (layer, start, Selection) per layer call

    def new_layer_state(self, i):
        return DSACache.empty(self.mla_cfg, self.dsa_cfg, True, self.dtype, self.device, self.capacity)

    def attend(self, i, x, state, positions, scratch):
        start = len(state)
        out, state, sel = dsa_forward(x, self.attn_w[i], self.mla_cfg, self.dsa_cfg, state, positions,
                                      want_scores=self.dsa_trace is not None)
        if self.dsa_trace is not None:
            self.dsa_trace.append((i, start, sel))
        return out, state


FAMILY = Family("deepseek_v32", DeepseekV32, "adapter_deepseek_v32:DeepseekV32Adapter",
                title="DeepSeek-V3.2, DeepSeek-V3.2-Exp")
