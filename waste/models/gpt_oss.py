"""gpt-oss: GQA with biases and per-head sinks, sliding-window layers between full ones, YaRN rotary (half-split),
a biased router softmaxed over its top-k, routed experts with biases and a clamped GLU (runtime/experts.py's
`oai_glu`, their records carry the biases). No shared experts, no dense layers."""
from __future__ import annotations

import torch

from ..layers.attention import GQAConfig, KVCache
from ..layers.rope import rotate_half_matrix
from ..layers.router import biased_topk_softmax
from ..layers.sinks import sink_gqa_forward
from ..layers.yarn import rope_frequencies
from .base import DecoderModel
from .family import Family


class YarnTable:
    """cos / sin [positions, 1, d] of half-split rotary with YaRN's frequencies and attention factor (as
    transformers: angles in float32, the factor applied before the cast), built once for the planned context."""

    def __init__(self, rope: dict, d: int, capacity: int, dtype, device):
        self.inv_freq, self.factor = rope_frequencies(rope, d)
        self.inv_freq = self.inv_freq.to(device)
        self.dtype, self.device = dtype, device
        self.cos, self.sin = self._make(torch.arange(capacity, device=device))
        self.R = rotate_half_matrix(d, dtype, device)

    def _make(self, positions):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.factor).to(self.dtype)[:, None, :],
                (emb.sin() * self.factor).to(self.dtype)[:, None, :])

    def at(self, start: int, T: int):
        if start + T <= self.cos.shape[0]:
            return self.cos[start:start + T], self.sin[start:start + T], self.R
        return (*self._make(torch.arange(start, start + T, device=self.device)), self.R)


class GptOss(DecoderModel):
    def __init__(self, config, trunk, experts, dtype, f32_names=frozenset(), **kw):
        super().__init__(config, trunk, experts, dtype, f32_names, **kw)
        g = config["gqa"]
        self.attn_cfg = GQAConfig(g["num_heads"], g["num_kv_heads"], g["head_dim"], g["rope_theta"], False,
                                  config["rms_norm_eps"])
        self.attn_w = [{k[len("self_attn."):]: v for k, v in lw.items() if k.startswith("self_attn.")}
                       for lw in self.layers]
        self.windows = [l.get("window") for l in config["layers"]]
        for lw in self.layers:            # routing math is float32
            for k in ("mlp.router.weight", "mlp.router.bias"):
                lw[k] = lw[k].float()
        self.rope = YarnTable(g["rope"], g["head_dim"], self.capacity, dtype, self.device)

    def new_layer_state(self, i):
        return KVCache.empty(self.attn_cfg, self.dtype, self.capacity, self.device)

    def attend(self, i, x, state, positions, scratch):
        if "rope" not in scratch:            # once per sequence and step, shared by every layer
            scratch["rope"] = self.rope.at(scratch["start"], x.shape[0])
        return sink_gqa_forward(x, self.attn_w[i], self.attn_cfg, state, scratch["rope"], self.windows[i])

    def route(self, i, x):
        lw = self.layers[i]
        return biased_topk_softmax(x, lw["mlp.router.weight"], lw["mlp.router.bias"], self.top_k)


def _features(cfg: dict) -> list[str]:
    g, m, kinds = cfg["gqa"], cfg["moe"], [l.get("window") for l in cfg["layers"]]
    windows = sorted({w for w in kinds if w})
    out = [f"attention sinks: a learned logit per head ({g['num_heads']} heads) in every softmax",
           f"sliding-window attention on {sum(1 for w in kinds if w)} of {len(kinds)} layers "
           f"(window {', '.join(map(str, windows)) or '-'}), full attention on the rest",
           f"router with a bias, softmax over its top-{m['top_k']} logits",
           f"expert GLU: (clamp(up, +-{m['glu_limit']:g}) + 1) * g * sigmoid({m['glu_alpha']:g} g), "
           f"g = min(gate, {m['glu_limit']:g}); biases on every expert matrix and on q, k, v, o"]
    r = g["rope"]
    if r["type"] == "yarn":
        out.append(f"rotary: yarn, theta {r['theta']:g}, factor {r['factor']:g} over "
                   f"{r['original_max_position_embeddings']} positions")
    return out


FAMILY = Family("gpt_oss", GptOss, "adapter_gpt_oss:GptOssAdapter", features=_features,
                title="gpt-oss-20b, gpt-oss-120b")
