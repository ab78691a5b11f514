"""What every family adapter shares: the Adapter interface (normalised config, expected tensor names, name
mapping) and the config readers the families have in common. adapters.py holds the registry."""
from __future__ import annotations

import re


EXPERT_MATRICES = ("gate", "up", "down")


def _first(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def sigmoid_moe(n_exp: int, top_k: int, inter: int | None, norm_topk_prob, scaling, n_shared: int, n_group,
                topk_group) -> dict:
    """The manifest's `moe` entry for a sigmoid router with a correction bias and grouped top-k (Kimi-Linear,
    DeepSeek-V3, GLM-5.3): each family reads its own config keys and defaults, the entry is the same."""
    return {"num_experts": n_exp, "top_k": top_k, "intermediate_size": inter, "scoring": "sigmoid",
            "norm_topk_prob": bool(norm_topk_prob), "routed_scaling_factor": float(scaling),
            "num_shared_experts": n_shared, "shared_intermediate_size": (inter or 0) * n_shared,
            "n_group": n_group or 1, "topk_group": topk_group or 1, "correction_bias": True}


def _eos_list(cfg: dict) -> list[int]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _rope_theta(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or {}
    return float(_first(cfg, "rope_theta", default=rp.get("rope_theta", 10000.0)))


def shape_ok(got: list[int], want) -> bool:
    """A tensor's shape against expected_shapes' entry (a shape, or ("numel", n) / ("numel>=", n))."""
    if isinstance(want, tuple) and want and want[0] in ("numel", "numel>="):
        n = 1
        for s in got:
            n *= s
        return n == want[1] if want[0] == "numel" else (n >= want[1] and len(got) == 1)
    return list(got) == list(want)


def shape_text(want) -> str:
    if isinstance(want, tuple) and want and want[0] in ("numel", "numel>="):
        return f"{'at least ' if want[0] == 'numel>=' else ''}{want[1]} values"
    return str(list(want))


class Adapter:
    family = ""
    # checkpoint expert tensor name -> (layer, expert, matrix)
    expert_re: re.Pattern
    expert_names: dict[str, str]
    keep_f32: tuple[str, ...] = ()   # trunk names (suffixes) stored in float32 whatever --trunk says
    keep_float: tuple[str, ...] = ()  # trunk matrices (suffixes) kept unquantized whatever --trunk says

    @classmethod
    def claims(cls, hf: dict) -> bool:
        """Is this release ours? Only families that share a `model_type` with another need to say."""
        return True

    def __init__(self, hf: dict):
        self.hf = hf
        self.config = self.normalise(hf)

    def normalise(self, hf: dict) -> dict:
        raise NotImplementedError

    def trunk_names(self) -> list[str]:
        """Checkpoint names of every non-expert tensor the engine needs: the edges, then each layer's."""
        names = self._edges()
        for i, layer in enumerate(self.config["layers"]):
            p = f"model.layers.{i}"
            names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
            names += self.layer_names(i, layer, p)
        return names

    def layer_names(self, i: int, layer: dict, p: str) -> list[str]:
        """Layer i's trunk tensors under the prefix p, besides its two norms."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------
    def _base(self, hf: dict, layers: list[dict]) -> dict:
        return {
            "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6), "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "intermediate_size": hf.get("intermediate_size"), "bos_token_id": hf.get("bos_token_id"),
            "eos_token_ids": _eos_list(hf), "max_position_embeddings": _first(hf, "max_position_embeddings", "model_max_length"),
            "layers": layers,
        }

    def moe_layers(self) -> list[int]:
        return [i for i, l in enumerate(self.config["layers"]) if l["mlp"] == "moe"]

    def expected_expert_names(self) -> list[str]:
        n = self.config["moe"]["num_experts"]
        inv = {v: k for k, v in self.expert_names.items()}
        return [self.expert_fmt.format(layer=i, expert=e, name=inv[m])
                for i in self.moe_layers() for e in range(n) for m in EXPERT_MATRICES]

    def classify_expert(self, name: str):
        m = self.expert_re.fullmatch(name)
        if not m:
            return None
        return int(m["layer"]), int(m["expert"]), self.expert_names[m["name"]]

    def view(self, ckpt):
        """The checkpoint as the converter reads it (gpt-oss: its fused expert tensors split per expert)."""
        return ckpt

    def canonical(self, name: str) -> str:
        """The spelling this adapter expects for a checkpoint name that releases write more than one way."""
        return name

    def dropped(self, name: str) -> str | None:
        """Why a checkpoint tensor is deliberately left out (DeepSeek's MTP layers), or None: it is converted."""
        return None

    def vision_target(self, name: str) -> str | None:
        """The vision file's name for a tensor of the vision tower, or None: not the tower's (docs/FORMAT.md)."""
        return None

    def trunk_target(self, name: str) -> str:
        return name.removeprefix("model.")

    def expected_shapes(self) -> dict:
        """Trunk tensor name -> the shape config.json implies, checked before anything is written (families
        that list them; the others check names, and the experts' shapes)."""
        return {}

    def is_f32(self, trunk_name: str, ndim: int) -> bool:
        return ndim == 1 or trunk_name.endswith(self.keep_f32)

    def _kda_names(self, a: str) -> list[str]:
        """A KDA layer's tensors under the attention prefix `a` (Kimi-Linear, GLM-5.3)."""
        return ([f"{a}.{x}_proj.weight" for x in "qkvo"] + [f"{a}.{x}_conv1d.weight" for x in "qkv"]
                + [f"{a}.{x}.weight" for x in ("f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_norm")]
                + [f"{a}.A_log", f"{a}.dt_bias"])

    def _mla_names(self, a: str) -> list[str]:
        """An MLA layer's tensors under `a`: q-LoRA or a plain q projection, then the latent KV path."""
        q = (["q_a_proj", "q_a_layernorm", "q_b_proj"] if self.config["mla"]["q_lora_rank"] else ["q_proj"])
        return [f"{a}.{x}.weight" for x in q + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]]

    def _dense_mlp(self, p: str) -> list[str]:
        return [f"{p}.mlp.{m}_proj.weight" for m in EXPERT_MATRICES]

    def _sigmoid_mlp_names(self, p: str, layer: dict, block: str = "mlp") -> list[str]:
        """Layer p's MLP trunk tensors under a sigmoid router with a correction bias: the router and the shared
        experts of a MoE layer under `block`, or a dense MLP."""
        if layer["mlp"] != "moe":
            return self._dense_mlp(p)
        m = f"{p}.{block}"
        names = [f"{m}.gate.weight", f"{m}.gate.e_score_correction_bias"]
        if self.config["moe"]["num_shared_experts"]:
            names += [f"{m}.shared_experts.{x}_proj.weight" for x in EXPERT_MATRICES]
        return names

    def _edges(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config["tie_word_embeddings"]:
            names.append("lm_head.weight")
        return names
