"""GLM-5.3-Flash (`glm5_next`): KDA with a lower-bound gate, DSA over k-pools on the MLA layers, mHC residual
streams, clamped SwiGLU, a vision tower stored apart (architectures.md §4.4, §5).

Releases come flat (the text config at the top level) or nested (`text_config` + `vision_config`; read_config
flattens it). The text model nests the other way round from Kimi K3: `model.language_model.layers.N` with
`lm_head` outside the wrapper (K3: `language_model.model.layers.N`, `language_model.lm_head`). Every spelling is
canonicalised to the flat one (`model.layers.N`, `lm_head.weight`), so trunk names read like a flat release's.
"""
from __future__ import annotations

import re

from ..errors import WasteError
from .adapter_base import Adapter, _first, sigmoid_moe

_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
            "index_kpool_compress_ape", "index_kpool_compress_gate")

# (pattern, replacement) applied in order: wrapper prefixes, then transformers' in-memory spellings
_ALIASES = [
    (re.compile(r"^model\.language_model\."), "model."),
    (re.compile(r"^language_model\.model\."), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"\.(attn|ffn)_hc\.(fn|base|scale)$"), r".hc_\1_\2"),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
]
_VISION = re.compile(r"^(?:model\.)?(?:visual|vision_tower|vision_model)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _layer_kinds(hf: dict) -> list[str]:
    """The engine's 0-based attention kinds, from `layer_types` (transformers' default pattern when absent:
    every 4th layer, idx % 4 == 3, is DSA). A `linear_attn_config.kda_layers` list, when present, must agree
    0-based: GLM writes it 0-based where Kimi writes it 1-based, and copying one into the other loads fine and
    answers noise (seed 0.7.0)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    if len(types) != n:
        raise WasteError(f"glm5_next layer_types has {len(types)} entries for {n} layers")
    kinds = []
    for t in types:
        if t == "linear_attention":
            kinds.append("kda")
        elif t in ("indexed_attention", "full_attention"):
            kinds.append("mla")
        else:
            raise WasteError(f"glm5_next layer type {t!r} is not supported (linear_attention, indexed_attention)")
    kda = (hf.get("linear_attn_config") or {}).get("kda_layers")
    if kda is not None:
        ours = [i for i, k in enumerate(kinds) if k == "kda"]
        if sorted(kda) != ours:
            raise WasteError(f"glm5_next linear_attn_config.kda_layers {sorted(kda)} disagrees with layer_types "
                             f"(KDA on 0-based layers {ours}); GLM's list is 0-based: fix config.json")
    return kinds


def _indexer_types(hf: dict, n: int) -> list[str]:
    """Per layer "full" (own indexer) or "shared" (reuses the previous full layer's selection), as transformers."""
    if hf.get("indexer_types"):
        return list(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(hf.get("index_topk_freq", 1) or 1, 1)
    offset = hf.get("index_skip_topk_offset", 2)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]


class Glm5NextAdapter(Adapter):
    family = "glm5_next"
    expert_re = re.compile(r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<name>gate_proj|up_proj|down_proj)\.weight")
    expert_fmt = "model.layers.{layer}.mlp.experts.{expert}.{name}.weight"
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    # mHC is computed in float32 (its 1-D base/scale are f32 anyway); transformers keeps the conv and gates f32 too
    keep_f32 = ("mlp.gate.weight", "A_log", "dt_bias", "e_score_correction_bias", "hc_attn_fn", "hc_ffn_fn",
                "hc_attn_base", "hc_ffn_base", "hc_attn_scale", "hc_ffn_scale", "conv1d.weight")
    keep_float = ("kv_b_proj.weight",)   # split per head in the absorbed decode path

    def canonical(self, name):
        for pat, rep in _ALIASES:
            name = pat.sub(rep, name)
        return name

    def classify_expert(self, name):
        return None if self.dropped(name) else super().classify_expert(self.canonical(name))

    def dropped(self, name):
        """The multi-token-prediction layer stored after the last decoder layer (transformers ignores it too)."""
        c = self.canonical(name)
        m = _LAYER.match(c)
        if (m and int(m[1]) >= self.config["num_layers"]) or ".shared_head." in c:
            return f"multi-token-prediction layer {m[1] if m else ''} (not used for generation)".replace("  ", " ")
        return None

    def vision_target(self, name):
        c = self.canonical(name)
        return c.removeprefix("model.") if _VISION.match(c) else None

    def normalise(self, hf):
        n = hf["num_hidden_layers"]
        kinds = _layer_kinds(hf)
        mlps = hf.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * (n - 3)
        if len(mlps) != n or set(mlps) - {"dense", "sparse"}:
            raise WasteError(f"glm5_next mlp_layer_types must list dense/sparse for each of the {n} layers")
        cfg = self._base(hf, [{"attn": a, "mlp": "moe" if m == "sparse" else "dense"} for a, m in zip(kinds, mlps)])
        cfg["rms_norm_eps"] = hf.get("rms_norm_eps", 1e-5)
        heads = hf.get("num_attention_heads", 64)
        if hf.get("num_key_value_heads", heads) != heads:
            raise WasteError("glm5_next needs num_key_value_heads == num_attention_heads (MLA)")
        if hf.get("attention_bias"):
            raise WasteError("glm5_next with attention_bias=true is not supported")
        if not hf.get("q_lora_rank"):
            raise WasteError("glm5_next DSA layers need q_lora_rank (the indexer reads the q latent)")
        if hf.get("qk_rope_head_dim", 0):
            raise WasteError(f"glm5_next DSA layers are NoPE; qk_rope_head_dim={hf['qk_rope_head_dim']} is not supported")
        # transformers builds q_a_layernorm / kv_a_layernorm with rms_norm_eps here (DeepSeek-V3: RMSNorm's 1e-6)
        cfg["mla"] = {"num_heads": heads, "q_lora_rank": hf["q_lora_rank"], "kv_lora_rank": hf["kv_lora_rank"],
                      "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": 0,
                      "v_head_dim": hf["v_head_dim"], "rope": None, "norm_eps": cfg["rms_norm_eps"]}
        lac = hf.get("linear_attn_config") or {}
        lower = hf.get("linear_lower_bound", -5.0)
        if lac:
            lower = lac.get("gate_lower_bound", lower)
            if lac.get("safe_gate", True) and lower is None:
                lower = -5.0
        cfg["kda"] = {"num_heads": _first(lac, "num_heads", default=hf.get("linear_num_heads", 64)),
                      "head_dim": _first(lac, "head_dim", default=hf.get("linear_head_dim", 128)),
                      "conv_kernel": _first(lac, "short_conv_kernel_size", default=hf.get("linear_conv_kernel_dim", 4)),
                      "gate_lower_bound": None if lower is None else float(lower)}
        topk, kpool = hf.get("index_topk", 2048), hf.get("index_kpool", 16)
        if kpool < 1 or topk % kpool:
            raise WasteError(f"glm5_next index_topk ({topk}) must be a multiple of index_kpool ({kpool})")
        if not hf.get("index_kpool_always_select_tail", True):
            raise WasteError("glm5_next with index_kpool_always_select_tail=false is not supported")
        itypes = _indexer_types(hf, n)
        seen_full = False
        for i, k in enumerate(kinds):
            if k == "mla":
                if itypes[i] == "shared" and not seen_full:
                    raise WasteError(f"glm5_next layer {i} shares the DSA selection of an earlier indexer layer, "
                                     "and there is none")
                seen_full |= itypes[i] != "shared"
        cfg["dsa"] = {"index_topk": topk, "index_kpool": kpool, "index_n_heads": hf.get("index_n_heads", 32),
                      "index_head_dim": hf.get("index_head_dim", 128), "always_select_tail": True,
                      "indexer_types": ["shared" if k == "mla" and t == "shared" else "full" if k == "mla" else None
                                        for k, t in zip(kinds, itypes)]}
        cfg["mhc"] = {"hc_mult": hf.get("hc_mult", 4), "sinkhorn_iters": hf.get("hc_sinkhorn_iters", 20),
                      "eps": hf.get("hc_eps", 1e-6)}
        limit = hf.get("swiglu_limit", 10.0)
        cfg["swiglu_limit"] = None if limit is None else float(limit)
        n_exp = _first(hf, "n_routed_experts", "num_local_experts", default=288)
        n_shared = hf.get("n_shared_experts", 1) or 0
        moe_inter = hf.get("moe_intermediate_size", 2048)
        cfg["moe"] = sigmoid_moe(n_exp, hf.get("num_experts_per_tok", 8), moe_inter, hf.get("norm_topk_prob", True),
                                 hf.get("routed_scaling_factor", 2.5), n_shared, hf.get("n_group"), hf.get("topk_group"))
        return cfg

    def expected_shapes(self) -> dict:
        """Every trunk tensor's canonical name -> its shape from config.json (transformers 5.24's layout; ("numel", n)
        where a release may store another layout of the same values: the conv weights, dt_bias)."""
        c = self.config
        D, V, k, m, dsa, moe = c["hidden_size"], c["vocab_size"], c["kda"], c["mla"], c["dsa"], c["moe"]
        hc = c["mhc"]["hc_mult"]
        H, d = k["num_heads"], k["head_dim"]
        C = H * d
        Hm, nope, vd, qr, kvr = m["num_heads"], m["qk_nope_head_dim"], m["v_head_dim"], m["q_lora_rank"], m["kv_lora_rank"]
        Hi, di = dsa["index_n_heads"], dsa["index_head_dim"]
        out = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D]}
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = [V, D]
        for i, l in enumerate(c["layers"]):
            p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
            out.update({f"{p}.input_layernorm.weight": [D], f"{p}.post_attention_layernorm.weight": [D]})
            for s in ("attn", "ffn"):    # mHC: pre and post weights (hc each) and the hc x hc mixing, from hc streams
                out.update({f"{p}.hc_{s}_fn": [(2 + hc) * hc, hc * D], f"{p}.hc_{s}_base": [(2 + hc) * hc],
                            f"{p}.hc_{s}_scale": [3]})
            if l["attn"] == "kda":
                out.update({f"{a}.{x}_proj.weight": [C, D] for x in "qkv"})
                out.update({f"{a}.{x}_conv1d.weight": ("numel", C * k["conv_kernel"]) for x in "qkv"})
                out.update({f"{a}.f_a_proj.weight": [d, D], f"{a}.f_b_proj.weight": [C, d], f"{a}.b_proj.weight": [H, D],
                            f"{a}.g_a_proj.weight": [d, D], f"{a}.g_b_proj.weight": [C, d], f"{a}.o_norm.weight": [d],
                            f"{a}.o_proj.weight": [D, C], f"{a}.A_log": [H], f"{a}.dt_bias": ("numel", C)})
            else:                         # MLA without rope (NoPE), q through its LoRA
                out.update({f"{a}.q_a_proj.weight": [qr, D], f"{a}.q_a_layernorm.weight": [qr],
                            f"{a}.q_b_proj.weight": [Hm * nope, qr], f"{a}.kv_a_proj_with_mqa.weight": [kvr, D],
                            f"{a}.kv_a_layernorm.weight": [kvr], f"{a}.kv_b_proj.weight": [Hm * (nope + vd), kvr],
                            f"{a}.o_proj.weight": [D, Hm * vd]})
                if dsa["indexer_types"][i] == "full":
                    x = f"{a}.indexer"
                    out.update({f"{x}.wq_b.weight": [Hi * di, qr], f"{x}.wk.weight": [di, D], f"{x}.k_norm.weight": [di],
                                f"{x}.k_norm.bias": [di], f"{x}.weights_proj.weight": [Hi, D],
                                f"{x}.index_kpool_compress_ape": [dsa["index_kpool"], di],
                                f"{x}.index_kpool_compress_gate": [di, D]})
            if l["mlp"] != "moe":
                I = c["intermediate_size"]
                out.update({f"{p}.mlp.gate_proj.weight": [I, D], f"{p}.mlp.up_proj.weight": [I, D],
                            f"{p}.mlp.down_proj.weight": [D, I]})
                continue
            out.update({f"{p}.mlp.gate.weight": [moe["num_experts"], D],
                        f"{p}.mlp.gate.e_score_correction_bias": [moe["num_experts"]]})
            if moe["num_shared_experts"]:
                S = moe["shared_intermediate_size"]
                out.update({f"{p}.mlp.shared_experts.gate_proj.weight": [S, D],
                            f"{p}.mlp.shared_experts.up_proj.weight": [S, D],
                            f"{p}.mlp.shared_experts.down_proj.weight": [D, S]})
        return out

    def layer_names(self, i, layer, p):
        a = f"{p}.self_attn"
        names = [f"{p}.hc_{s}_{x}" for s in ("attn", "ffn") for x in ("fn", "base", "scale")]
        if layer["attn"] == "kda":
            names += self._kda_names(a)
        else:
            names += self._mla_names(a)
            if self.config["dsa"]["indexer_types"][i] == "full":
                names += [f"{a}.indexer.{x}" for x in _INDEXER]
        return names + self._sigmoid_mlp_names(p, layer)
