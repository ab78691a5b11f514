"""GLM-5.3-Flash's image processor (transformers' Glm5NextImageProcessor, its Pillow backend), pixel for pixel:
the canvas is the largest grid of (patch x merge)-pixel cells within [min_image_tokens, max_image_tokens] tokens
that keeps the aspect ratio; the image is resized into it with Pillow (bicubic, never up unless it is below the
minimum) and padded with black at the bottom and right; then rescaled, normalised with CLIP's mean and std and cut
into patches, each repeated over the temporal patch (an image is one frame twice). One token per merge x merge
patches."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import WasteError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3


@dataclass(frozen=True)
class Glm5ImageProcessor:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    image_mean: tuple = CLIP_MEAN
    image_std: tuple = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = _BICUBIC

    @classmethod
    def from_config(cls, cfg: dict | None) -> "Glm5ImageProcessor":
        """From the release's preprocessor_config.json (None: the processor's defaults). Settings this
        reproduction does not implement are refused by name rather than ignored."""
        cfg = dict(cfg or {})
        kind = cfg.get("image_processor_type")
        if kind and not kind.startswith("Glm5Next"):
            raise WasteError(f"preprocessor_config.json names {kind}; this model's images need Glm5NextImageProcessor")
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if cfg.get(flag) is False:
                raise WasteError(f"preprocessor_config.json sets {flag}: false, which waste does not implement")
        if cfg.get("patch_expand_factor", 1) != 1:
            raise WasteError("preprocessor_config.json sets patch_expand_factor other than 1, which waste does not "
                             "implement")
        kw = {k: cfg[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "min_image_tokens",
                                  "max_image_tokens", "rescale_factor", "resample") if cfg.get(k) is not None}
        for k in ("image_mean", "image_std"):
            if cfg.get(k) is not None:
                kw[k] = tuple(float(x) for x in cfg[k])
        return cls(**kw)

    # -- sizes -----------------------------------------------------------------------------------------
    def canvas(self, height: int, width: int) -> tuple[int, int]:
        """The padded canvas (height, width), multiples of patch x merge (transformers' smart_resize)."""
        t, f = self.temporal_patch_size, self.patch_size * self.merge_size
        per_token = t * f * f
        lo, hi = self.min_image_tokens * per_token, self.max_image_tokens * per_token
        frames = t                 # an image is one frame, aligned to the temporal patch

        def align(v):
            return math.ceil(v / f) * f

        ah, aw = align(height), align(width)
        if frames * ah * aw < lo:
            scale = math.sqrt(lo / (t * height * width))
            ah, aw = align(max(1, math.ceil(height * scale))), align(max(1, math.ceil(width * scale)))
        if frames * ah * aw > hi:
            if hi < frames * f * f:
                raise WasteError(f"max_image_tokens {self.max_image_tokens} is too small for one patch")
            low, high, ah, aw = 1, height, f, f
            while low <= high:       # the tallest content height whose aligned canvas fits the budget
                ch = (low + high) // 2
                cw = max(1, math.floor(width * ch / height))
                if frames * align(ch) * align(cw) <= hi:
                    ah, aw = align(ch), align(cw)
                    low = ch + 1
                else:
                    high = ch - 1
        return ah, aw

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Patches down and across for an image of this size."""
        ch, cw = self.canvas(height, width)
        return ch // self.patch_size, cw // self.patch_size

    def tokens(self, grid: tuple[int, int]) -> int:
        return grid[0] * grid[1] // (self.merge_size ** 2)

    # -- pixels ----------------------------------------------------------------------------------------
    def __call__(self, image) -> tuple[torch.Tensor, tuple[int, int]]:
        """An RGB Pillow image -> (pixels [patches, 3 * T * P * P] float32, (grid_h, grid_w))."""
        width, height = image.size
        ch, cw = self.canvas(height, width)
        t = self.temporal_patch_size
        scale = min(ch / height, cw / width)
        if t * height * width >= t * (self.patch_size * self.merge_size) ** 2 * self.min_image_tokens:
            scale = min(1.0, scale)
        h = max(1, min(ch, math.floor(height * scale)))
        w = max(1, min(cw, math.floor(width * scale)))
        if (h, w) != (height, width):
            image = image.resize((w, h), resample=self.resample)
        a = np.zeros((ch, cw, 3), dtype=np.uint8)
        a[:h, :w] = np.asarray(image)
        x = (a.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = (x - np.array(self.image_mean, dtype=np.float32)) / np.array(self.image_std, dtype=np.float32)
        x = x.transpose(2, 0, 1)                                      # [C, H, W]
        p, m = self.patch_size, self.merge_size
        gh, gw = ch // p, cw // p
        x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)   # blocks, patches, C, p, p
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, 3 * t * p * p)), (gh, gw)
