"""DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3's adapter plus each layer's lightning indexer
(`self_attn.indexer.wq_b / wk / k_norm (weight, bias) / weights_proj`), released in fp8 blocks like the rest;
`weights_proj` stays float32 as transformers keeps it. The manifest's `dsa` entry is GLM-5.3's at index_kpool 1 with
`index_rope_dim` (the indexer's rotary channels) added."""
from __future__ import annotations

from ..errors import WasteError
from .adapter_deepseek import DeepseekV3Adapter

_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


class DeepseekV32Adapter(DeepseekV3Adapter):
    family = "deepseek_v32"
    keep_f32 = DeepseekV3Adapter.keep_f32 + ("indexer.weights_proj.weight",)

    def normalise(self, hf):
        if not hf.get("q_lora_rank"):
            raise WasteError("deepseek_v32 needs q_lora_rank (the indexer reads the q latent)")
        cfg = super().normalise(hf)
        # V3.2 always interleaves MLA's rotary (transformers has no rope_interleave switch for it)
        cfg["mla"]["rope"]["interleave"] = True
        mlp_types = hf.get("mlp_layer_types")     # transformers writes it beside first_k_dense_replace
        if mlp_types is not None and [l["mlp"] for l in cfg["layers"]] != \
                ["moe" if t == "sparse" else "dense" if t == "dense" else t for t in mlp_types]:
            raise WasteError(f"deepseek_v32 mlp_layer_types {mlp_types} disagrees with first_k_dense_replace "
                             f"({hf.get('first_k_dense_replace')}): waste supports dense first layers, then MoE")
        types = hf.get("layer_types")
        if types is not None and set(types) != {"indexed_attention"}:
            raise WasteError(f"deepseek_v32 layer types {sorted(set(types))} are not supported (indexed_attention)")
        head_dim, rope_dim = hf.get("index_head_dim", 128), hf["qk_rope_head_dim"]
        if rope_dim > head_dim:
            raise WasteError(f"deepseek_v32 index_head_dim ({head_dim}) is below qk_rope_head_dim ({rope_dim})")
        cfg["dsa"] = {"index_topk": hf.get("index_topk", 2048), "index_kpool": 1,
                      "index_n_heads": hf.get("index_n_heads", 64), "index_head_dim": head_dim,
                      "index_rope_dim": rope_dim, "indexer_types": ["full"] * len(cfg["layers"])}
        return cfg

    def layer_names(self, i, layer, p):
        return super().layer_names(i, layer, p) + [f"{p}.self_attn.indexer.{x}" for x in _INDEXER]
