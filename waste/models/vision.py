"""The vision towers a container may carry (manifest `vision`), composed from layers/vision: pixels and patch grids
in, one row of the text model's embedding width per image placeholder token out. Loaded on a model's first image
(Engine.vision); a text-only run never reads the file."""
from __future__ import annotations

import torch

from ..errors import WasteError
from ..layers.vision import moonvit
from ..layers.vision.glm5 import Glm5VisionConfig, tower


class Glm5Vision:
    """GLM-5.3-Flash's tower (transformers' Glm5NextVisionModel, merger included). Missing config keys take
    transformers' defaults."""

    def __init__(self, vision: dict, text_hidden: int, tensors: dict, dtype: torch.dtype):
        c = dict(vision.get("config") or {})
        if c.get("hidden_act", "silu") != "silu":
            raise WasteError(f"vision_config.hidden_act {c['hidden_act']!r} is not supported (silu)")
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise WasteError(f"vision_config rope_type {rope['rope_type']!r} is not supported (axial)")
        limit = c.get("swiglu_limit", 10.0)
        self.cfg = Glm5VisionConfig(
            hidden=c.get("hidden_size", 1024), heads=c.get("num_heads", c.get("num_attention_heads", 16)),
            depth=c.get("depth", c.get("num_hidden_layers", 24)), out_hidden=c.get("out_hidden_size", 1536),
            patch_size=c.get("patch_size", 14), temporal_patch_size=c.get("temporal_patch_size", 2),
            merge=c.get("spatial_merge_size", 2), in_channels=c.get("in_channels", 3),
            eps=c.get("rms_norm_eps", 1e-5), rope_theta=float(rope.get("rope_theta", 10000.0)),
            swiglu_limit=None if limit is None else float(limit))
        if self.cfg.out_hidden != text_hidden:
            raise WasteError(f"the vision tower's out_hidden_size {self.cfg.out_hidden} differs from the text model's "
                             f"hidden_size {text_hidden}")
        self.w = {k.removeprefix("visual."): v.to(dtype) for k, v in tensors.items()}   # norms compute in f32
        self.dtype = dtype

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        return tower(pixels.to(self.dtype), grids, self.w, self.cfg)


# what Kimi K3's vision_config may say, and the only value this tower implements (mlx-vlm's defaults)
_K3_FIXED = {"model_type": "moonvit3d", "activation_func": "gelu_pytorch_tanh", "norm_type": "rmsnorm",
             "mlp_type": "mlp2", "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
             "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu"}


class KimiK3Vision:
    """Kimi K3's MoonViT and its mm_projector (mlx-vlm 0.7.10's kimi_k3); missing config keys take its defaults."""

    def __init__(self, vision: dict, text_hidden: int, tensors: dict, dtype: torch.dtype):
        c = dict(vision.get("config") or {})
        for k, v in _K3_FIXED.items():
            if c.get(k, v) != v:
                raise WasteError(f"vision_config.{k} {c[k]!r} is not supported ({v})")
        hidden = c.get("vt_hidden_size", 1024)
        if c.get("mm_hidden_size", hidden) != hidden:
            raise WasteError(f"vision_config.mm_hidden_size {c['mm_hidden_size']} differs from vt_hidden_size {hidden}")
        m = c.get("merge_kernel_size") or (2, 2)
        self.cfg = moonvit.MoonVitConfig(
            hidden=hidden, qkv_hidden=c.get("qkv_hidden_size") or hidden, heads=c.get("vt_num_attention_heads", 12),
            depth=c.get("vt_num_hidden_layers", 27), patch_size=c.get("patch_size", 14),
            merge=(m, m) if isinstance(m, int) else tuple(m), eps=2.0 ** -7,
            projector_eps=float(c.get("projector_ln_eps", 1e-5)))
        if self.cfg.head_dim % 4:
            raise WasteError(f"vision_config: a head of {self.cfg.head_dim} (qkv_hidden_size / heads) is not a "
                             "multiple of 4, which the 2-D rotary needs")
        out = tensors.get("mm_projector.proj.2.weight")
        if out is not None and out.shape[0] != text_hidden:
            raise WasteError(f"the vision projector writes {out.shape[0]} wide rows; the text model's hidden_size is "
                             f"{text_hidden}")
        self.w = {k: v.to(dtype) for k, v in tensors.items()}   # norms and the position table compute in f32
        self.dtype = dtype

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        return moonvit.tower(pixels.to(self.dtype), grids, self.w, self.cfg)


def build_vision(family: str, vision: dict, text_hidden: int, tensors: dict, dtype: torch.dtype):
    if family == "glm5_next":
        return Glm5Vision(vision, text_hidden, tensors, dtype)
    if family == "kimi_k3":
        return KimiK3Vision(vision, text_hidden, tensors, dtype)
    raise WasteError(f"the {family} vision tower does not run yet: this model takes text only in waste")


class EmbeddedRows:
    """Rows that replace a sequence's embeddings at absolute positions `at` (an image's placeholder tokens); a
    step's `splice` takes the ones that fall in its span, so a prefill split into parts places each row once."""

    def __init__(self, at: torch.Tensor, rows: torch.Tensor):
        self.at, self.rows = at, rows

    def splice(self, x: torch.Tensor, start: int) -> torch.Tensor:
        sel = (self.at >= start) & (self.at < start + x.shape[0])
        if bool(sel.any()):
            x = x.clone()
            x[(self.at[sel] - start).to(x.device)] = self.rows[sel].to(x.device, x.dtype)
        return x
