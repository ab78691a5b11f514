"""Kimi K3's image processor (the release's navit pipeline, as mlx-vlm 0.7.10's KimiK3ImageProcessor), pixel for
pixel: the image is scaled down (never up) so that its patches stay within `in_patch_limit` and each side within
`patch_limit_on_one_side` patches, resized with Pillow (bicubic), padded with black at the bottom and right to a
multiple of patch x merge, rescaled to [0, 1], normalised with the release's mean and std and cut into patches row
by row. Transparency is filled as `transparent_bg_config` says (none: Pillow's plain RGB conversion). One token per
merge_h x merge_w patches; the prompt names the image's own size (`image WxH`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import WasteError

_PATTERNS = ("white", "black", "gray", "chessboard")


@dataclass(frozen=True)
class KimiK3ImageProcessor:
    patch_size: int = 14
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)
    in_patch_limit: int = 65536
    merge_kernel_size: tuple = (2, 2)
    patch_limit_on_one_side: int = 512
    transparent_bg: tuple | None = None          # sorted (key, value) pairs of transparent_bg_config
    fill_stage: str = "before_resize"

    @classmethod
    def from_config(cls, cfg: dict | None) -> "KimiK3ImageProcessor":
        """From the release's preprocessor_config.json (its `media_proc_cfg`; None: the defaults above)."""
        media = dict((cfg or {}).get("media_proc_cfg") or {})
        kw = {k: media[k] for k in ("patch_size", "in_patch_limit", "patch_limit_on_one_side") if k in media}
        for k in ("image_mean", "image_std"):
            if k in media:
                kw[k] = tuple(float(x) for x in media[k])
        if "merge_kernel_size" in media:
            m = media["merge_kernel_size"]
            kw["merge_kernel_size"] = (m, m) if isinstance(m, int) else tuple(m)
        bg = media.get("transparent_bg_config")
        if bg is not None:
            if not isinstance(bg, dict) or bg.get("pattern", "black") not in _PATTERNS:
                raise WasteError(f"preprocessor_config.json transparent_bg_config {bg!r}: the pattern must be one of "
                                 f"{', '.join(_PATTERNS)}")
            kw["transparent_bg"] = tuple(sorted(bg.items()))
        stage = media.get("transparent_bg_fill_stage", "before_resize")
        if stage not in ("before_resize", "after_resize"):
            raise WasteError(f"preprocessor_config.json transparent_bg_fill_stage {stage!r} is not supported "
                             "(before_resize, after_resize)")
        kw["fill_stage"] = stage
        return cls(**kw)

    # -- sizes -----------------------------------------------------------------------------------------
    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the image is resized to, before padding."""
        p, side = self.patch_size, self.patch_limit_on_one_side
        s1 = math.sqrt(self.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
        scale = min(1.0, s1, side * p / width, side * p / height)
        return (min(max(1, int(width * scale)), side * p), min(max(1, int(height * scale)), side * p))

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Patches down and across for an image of this size (after padding to whole merge blocks)."""
        return self._padded(*self.resized(width, height))

    def _padded(self, width: int, height: int) -> tuple[int, int]:
        mh, mw = self.merge_kernel_size
        return math.ceil(height / (mh * self.patch_size)) * mh, math.ceil(width / (mw * self.patch_size)) * mw

    def tokens(self, grid: tuple[int, int]) -> int:
        return grid[0] * grid[1] // (self.merge_kernel_size[0] * self.merge_kernel_size[1])

    # -- pixels ----------------------------------------------------------------------------------------
    def _fill(self, image):
        """Transparency onto the configured background (the release's rule: alpha-weighted, truncated to 8 bits)."""
        from PIL import Image

        if self.transparent_bg is None:
            return image.convert("RGB")
        if image.mode == "RGB":
            return image
        if "A" not in image.getbands() and "transparency" not in image.info:
            return image.convert("RGB")
        cfg = dict(self.transparent_bg)
        img = np.asarray(image.convert("RGBA"))
        h, w = img.shape[:2]
        pattern = cfg.get("pattern", "black")
        if pattern == "chessboard":
            sq = cfg.get("chessboard_square_size", 16)
            on = 1 if cfg.get("chessboard_square_on_top_left", True) else 0
            yy, xx = np.meshgrid(np.arange(h) // sq, np.arange(w) // sq, indexing="ij")
            bg = np.where(((yy + xx) % 2 == on)[..., None], cfg.get("chessboard_gray_value", 200),
                          cfg.get("chessboard_white_value", 255)).astype(np.uint8)
            bg = np.broadcast_to(bg, (h, w, 3))
        else:
            bg = np.full((h, w, 3), {"white": 255, "black": 0, "gray": 128}[pattern], dtype=np.uint8)
        alpha = img[:, :, 3:4].astype(np.float32) / 255.0
        return Image.fromarray((alpha * img[:, :, :3] + (1 - alpha) * bg).astype(np.uint8))

    def __call__(self, image) -> tuple[torch.Tensor, tuple[int, int]]:
        """A Pillow image (any mode: transparency is this processor's to fill) -> (pixels [patches, 3 * P * P]
        float32, (grid_h, grid_w))."""
        from PIL import Image

        nw, nh = self.resized(*image.size)
        if self.fill_stage == "before_resize":
            image = self._fill(image)
        elif image.mode == "P":
            image = image.convert("RGBA")
        image = self._fill(image.resize((nw, nh), Image.Resampling.BICUBIC))
        gh, gw = self._padded(nw, nh)
        p = self.patch_size
        a = np.zeros((gh * p, gw * p, 3), dtype=np.uint8)
        a[:nh, :nw] = np.asarray(image)
        # float32 / 255, then the float64 mean and std (the release's arithmetic), float32 at the end
        x = (a.astype(np.float32) / np.float32(255.0) - np.array(self.image_mean)) / np.array(self.image_std)
        x = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3 * p * p)
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), (gh, gw)

    def prompt_size(self, image) -> tuple[int, int]:
        """(width, height) the image prompt names: the image as given."""
        return image.size
