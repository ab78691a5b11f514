"""gpt-oss (`gpt_oss`, transformers' GptOssForCausalLM): GQA with biases and a learned sink logit per head,
sliding-window and full attention alternating (`layer_types`), YaRN rotary (half-split), a router with a bias
whose top-k logits are softmaxed, and experts with biases and a clamped GLU (`swiglu_alpha`, `swiglu_limit`).

The release stores each layer's experts fused: `mlp.experts.gate_up_proj` with gate and up interleaved column by
column, and `down_proj`, either as mxfp4 (`*_blocks` [E, N, K/32, 16] uint8 E2M1 pairs, low nibble first, and
`*_scales` [E, N, K/32] uint8 E8M0 exponents: the rows are output channels) or as floats transposed ([E, K, N]:
transformers' own save_pretrained), plus `*_bias` [E, N]. `FusedExperts` shows the converter one matrix per
expert, gate and up de-interleaved; for mxfp4 that is a choice of rows, so the blocks and scales are kept bit for
bit (waste's mxfp4 format is the same byte layout, docs/FORMAT.md)."""
from __future__ import annotations

import re


from ..errors import WasteError
from .adapter_base import EXPERT_MATRICES, Adapter, _first
from .adapter_deepseek import _rope

BIASES = tuple(f"{m}.bias" for m in EXPERT_MATRICES)
# transformers' GptOssConfig defaults where a release leaves a key out
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


class GptOssAdapter(Adapter):
    family = "gpt_oss"
    expert_re = re.compile(r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
                           r"(?P<name>gate_proj|up_proj|down_proj)\.(?P<kind>weight|bias)")
    expert_fmt = "model.layers.{layer}.mlp.experts.{expert}.{name}.{kind}"
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    keep_f32 = ("mlp.router.weight",)

    def normalise(self, hf):
        n = hf["num_hidden_layers"]
        kinds = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        if len(kinds) != n or set(kinds) - {"sliding_attention", "full_attention"}:
            raise WasteError(f"gpt_oss layer_types must list sliding_attention / full_attention for each of the {n} "
                             f"layers, not {kinds!r}: fix config.json")
        window = hf.get("sliding_window")
        if window is None and "sliding_attention" in kinds:
            raise WasteError("gpt_oss config.json has sliding_attention layers but no sliding_window")
        layers = [{"attn": "gqa", "mlp": "moe", "window": window if k == "sliding_attention" else None}
                  for k in kinds]
        cfg = self._base(hf, layers)
        cfg["rms_norm_eps"] = hf.get("rms_norm_eps", 1e-5)
        heads = hf["num_attention_heads"]
        rope_src = hf if (hf.get("rope_parameters") or hf.get("rope_scaling")) else {**hf, "rope_parameters": DEFAULT_ROPE}
        rp = rope_src.get("rope_parameters") or rope_src.get("rope_scaling") or {}
        kind = rp.get("rope_type") or rp.get("type") or "default"
        if kind not in ("default", "yarn"):
            raise WasteError(f"gpt_oss with rope type {kind!r} is not supported (default, yarn)")
        rope = _rope({"rope_theta": 150000.0, **rope_src})
        rope["interleave"] = False
        cfg["gqa"] = {"num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads", heads),
                      "head_dim": _first(hf, "head_dim", default=hf["hidden_size"] // heads),
                      "rope_theta": rope["theta"], "qk_norm": False, "bias": bool(hf.get("attention_bias", True)),
                      "sinks": True, "rope": rope}
        cfg["moe"] = {"num_experts": _first(hf, "num_local_experts", "num_experts"),
                      "top_k": _first(hf, "num_experts_per_tok", "experts_per_token"),
                      "intermediate_size": hf["intermediate_size"], "scoring": "softmax_of_topk",
                      "norm_topk_prob": True, "routed_scaling_factor": 1.0, "num_shared_experts": 0,
                      "n_group": 1, "topk_group": 1, "correction_bias": False, "router_bias": True,
                      "expert_bias": True, "expert_act": "oai_glu",
                      "glu_alpha": float(hf.get("swiglu_alpha", 1.702)),
                      "glu_limit": float(hf.get("swiglu_limit", 7.0))}
        return cfg

    def view(self, ckpt):
        return FusedExperts(ckpt, self)

    def layer_names(self, i, layer, p):
        a = f"{p}.self_attn"
        names = [f"{a}.{x}_proj.weight" for x in "qkvo"]
        if self.config["gqa"]["bias"]:
            names += [f"{a}.{x}_proj.bias" for x in "qkvo"]
        return names + [f"{a}.sinks", f"{p}.mlp.router.weight", f"{p}.mlp.router.bias"]

    def expected_shapes(self) -> dict:
        c = self.config
        D, V, g = c["hidden_size"], c["vocab_size"], c["gqa"]
        H, KV, d, E = g["num_heads"], g["num_kv_heads"], g["head_dim"], c["moe"]["num_experts"]
        out = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D]}
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = [V, D]
        for i in range(c["num_layers"]):
            p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
            out.update({f"{p}.input_layernorm.weight": [D], f"{p}.post_attention_layernorm.weight": [D],
                        f"{a}.q_proj.weight": [H * d, D], f"{a}.k_proj.weight": [KV * d, D],
                        f"{a}.v_proj.weight": [KV * d, D], f"{a}.o_proj.weight": [D, H * d], f"{a}.sinks": [H],
                        f"{p}.mlp.router.weight": [E, D], f"{p}.mlp.router.bias": [E]})
            if g["bias"]:
                out.update({f"{a}.q_proj.bias": [H * d], f"{a}.k_proj.bias": [KV * d], f"{a}.v_proj.bias": [KV * d],
                            f"{a}.o_proj.bias": [D]})
        return out

    def expected_expert_names(self):
        n = self.config["moe"]["num_experts"]
        return [self.expert_fmt.format(layer=i, expert=e, name=f"{m}_proj", kind=k)
                for i in self.moe_layers() for e in range(n) for k in ("weight", "bias") for m in EXPERT_MATRICES]

    def classify_expert(self, name):
        m = self.expert_re.fullmatch(name)
        if not m:
            return None
        mat = self.expert_names[m["name"]]
        return int(m["layer"]), int(m["expert"]), mat if m["kind"] == "weight" else f"{mat}.bias"


class FusedExperts:
    """A Checkpoint whose fused per-layer expert tensors are shown as one matrix (and one bias) per expert, under
    the adapter's per-expert names; every other tensor is the checkpoint's own. Each expert is read alone (a
    safetensors slice of the fused tensor)."""

    def __init__(self, ckpt, adapter: GptOssAdapter):
        self._c = ckpt
        c = adapter.config
        D, I, E = c["hidden_size"], c["moe"]["intermediate_size"], c["moe"]["num_experts"]
        self._virtual: dict[str, tuple] = {}      # name -> (fused name, expert, rows, mxfp4, logical shape)
        hidden = set()
        names = set(ckpt.weight_names())
        for i in adapter.moe_layers():
            base = f"model.layers.{i}.mlp.experts."
            for proj, N, K, mats in (("gate_up_proj", 2 * I, D, ("gate", "up")), ("down_proj", D, I, ("down",))):
                f = base + proj
                if f + "_blocks" in names:
                    mx = True
                    want = {f + "_blocks": [E, N, K // 32, 16], f + "_scales": [E, N, K // 32]}
                elif f in names:
                    mx, want = False, {f: [E, K, N]}
                else:
                    raise WasteError(f"{ckpt.src} does not match the gpt_oss layout: neither {f}_blocks (mxfp4) nor "
                                     f"{f} (floats) is in the checkpoint")
                want[f + "_bias"] = [E, N]
                for name, shape in want.items():
                    if name not in names:
                        raise WasteError(f"{ckpt.src} does not match the gpt_oss layout: {name} is missing")
                    if list(ckpt.shape(name)) != shape:
                        raise WasteError(f"{name} has shape {list(ckpt.shape(name))}, expected {shape} from config.json")
                hidden.update(want)
                for e in range(E):
                    for j, m in enumerate(mats):
                        rows = slice(j, None, 2) if len(mats) == 2 else slice(None)
                        n_rows = N // len(mats)
                        self._virtual[f"{base}{e}.{m}_proj.weight"] = (f, e, rows, mx, [n_rows, K])
                        self._virtual[f"{base}{e}.{m}_proj.bias"] = (f + "_bias", e, rows, None, [n_rows])
        self._names = [n for n in ckpt.weight_names() if n not in hidden] + list(self._virtual)

    def __getattr__(self, attr):          # src, config, shards, ...: the checkpoint's own
        return getattr(self._c, attr)

    def weight_names(self):
        return list(self._names)

    def names_in(self, shard):
        return sorted(k for k in self._names if self._where(k) == shard)

    def _where(self, name):
        v = self._virtual.get(name)
        if v is None:
            return self._c.where[name]
        return self._c.where[v[0] + "_blocks" if v[3] else v[0]]

    def shape(self, name):
        v = self._virtual.get(name)
        return list(v[4]) if v else self._c.shape(name)

    def dtype(self, name):
        v = self._virtual.get(name)
        if v is None:
            return self._c.dtype(name)
        return "MXFP4" if v[3] else self._c.dtype(v[0])

    def nbytes(self, name):
        v = self._virtual.get(name)
        if v is None:
            return self._c.nbytes(name)
        n = 1
        for s in v[4]:
            n *= s
        return int(n * {"MXFP4": 0.53, "BF16": 2, "F16": 2}.get(self.dtype(name), 4))

    def released_format(self, name):
        v = self._virtual.get(name)
        if v is None:
            return self._c.released_format(name)
        return "mxfp4" if v[3] else None

    def released_parts(self, name):
        v = self._virtual.get(name)
        if v is None:
            return self._c.released_parts(name)
        if not v[3]:
            return None
        return "mxfp4", self._mx_parts(v)

    def _mx_parts(self, v):
        f, e, rows, _, (N, K) = v
        blocks = self._c.get_index(f + "_blocks", e)[rows]        # [N, K/32, 16]: the rows are output channels
        scales = self._c.get_index(f + "_scales", e)[rows]
        return {"blocks": blocks.reshape(N, K // 2).contiguous(), "scales": scales.contiguous()}

    def get(self, name):
        v = self._virtual.get(name)
        if v is None:
            return self._c.get(name)
        f, e, rows, mx, shape = v
        if mx is None:                                            # a bias [N]
            return self._c.get_index(f, e)[rows].contiguous()
        if mx:
            from ..quant.lowbit import mx_dequantize

            p = self._mx_parts(v)
            return mx_dequantize(p["blocks"], p["scales"], *shape)
        w = self._c.get_index(f, e)                               # [K, N]: transformers' transposed layout
        if not w.is_floating_point():
            raise WasteError(f"{f} has dtype {w.dtype}, which this converter does not read")
        return w[:, rows].t().contiguous()
