"""Kimi K3's vision tower (MoonViT, `moonvit3d`; mlx-vlm 0.7.10's kimi_k3 is the oracle): a patch embedding (a
Conv2d whose kernel equals its stride: one matmul per patch) plus a learned 2-D position table bilinearly resized to
each image's patch grid, pre-norm blocks (RMS norms with eps 2^-7, fused q/k/v wider than the residual, 2-D rotary
on interleaved pairs, a tanh-GELU MLP), a final RMS norm, then the 2x2 merge (each block's four rows side by side)
and the projector (linear, exact GELU, linear, RMS norm) into the text width.

Patches arrive row by row over the image's grid (preprocessing's order); attention stays inside each image."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..norm import rms_norm


@dataclass(frozen=True)
class MoonVitConfig:
    hidden: int
    qkv_hidden: int
    heads: int
    depth: int
    patch_size: int
    merge: tuple[int, int]
    eps: float                  # the tower's RMS norms (2^-7 in the release's code)
    projector_eps: float        # the projector's closing RMS norm

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden // self.heads


def position_table(table: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """The learned [H, W, hidden] table resized to the grid (bilinear, half-pixel centres, edges clamped) ->
    [grid_h * grid_w, hidden] in float32, row by row."""
    if tuple(table.shape[:2]) == (grid_h, grid_w):
        return table.float().reshape(grid_h * grid_w, -1)
    t = table.float().permute(2, 0, 1)[None]
    out = F.interpolate(t, size=(grid_h, grid_w), mode="bilinear", align_corners=False, antialias=False)
    return out[0].permute(1, 2, 0).reshape(grid_h * grid_w, -1)


def rotary_2d(grid_h: int, grid_w: int, head_dim: int, theta: float = 10000.0):
    """cos, sin [h*w, head_dim / 2]: a quarter of the frequencies, each used for the column then the row, the
    pairs interleaved (column, row, column, row...), so each (even, odd) pair of a head turns by one angle."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32)[: head_dim // 4] / head_dim))
    rows = torch.arange(grid_h, dtype=torch.float32).repeat_interleave(grid_w)
    cols = torch.arange(grid_w, dtype=torch.float32).repeat(grid_h)
    ang = torch.stack([cols[:, None] * inv, rows[:, None] * inv], dim=-1).reshape(grid_h * grid_w, -1)
    return ang.cos(), ang.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]: each (even, odd) pair rotated, in float32."""
    dt, x = x.dtype, x.float()
    e, o = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([e * c - o * s, e * s + o * c], dim=-1).flatten(-2).to(dt)


def block(x: torch.Tensor, w: dict, cfg: MoonVitConfig, cos, sin) -> torch.Tensor:
    """One encoder block over one image's patches x [N, hidden]."""
    n = x.shape[0]
    qkv = F.linear(rms_norm(x, w["norm0.weight"], cfg.eps), w["wqkv.weight"], w.get("wqkv.bias"))
    q, k, v = qkv.view(n, 3, cfg.heads, cfg.head_dim).unbind(1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       scale=cfg.head_dim ** -0.5)
    x = x + F.linear(o.transpose(0, 1).reshape(n, -1), w["wo.weight"], w.get("wo.bias"))
    h = F.gelu(F.linear(rms_norm(x, w["norm1.weight"], cfg.eps), w["mlp.fc0.weight"], w.get("mlp.fc0.bias")),
               approximate="tanh")
    return x + F.linear(h, w["mlp.fc1.weight"], w.get("mlp.fc1.bias"))


def merge(x: torch.Tensor, grid_h: int, grid_w: int, kernel: tuple[int, int]) -> torch.Tensor:
    """[h*w, d] row by row -> [h/kh * w/kw, kh*kw*d]: each kh x kw block's rows (row by row) side by side."""
    kh, kw = kernel
    d = x.shape[-1]
    x = x.view(grid_h // kh, kh, grid_w // kw, kw, d).transpose(1, 2)
    return x.reshape(-1, kh * kw * d)


def tower(pixels: torch.Tensor, grids: list[tuple[int, int]], w: dict, cfg: MoonVitConfig) -> torch.Tensor:
    """pixels [N, 3*P*P] of the images whose patch grids are `grids` ([(h, w), ...]); w: the tower's tensors
    (`vision_tower.` and `mm_projector.` prefixes kept) -> [N / (kh*kw), text hidden]: one row per image pad token."""
    pw = w["vision_tower.patch_embed.proj.weight"]
    x = F.linear(pixels.to(pw.dtype), pw.reshape(pw.shape[0], -1), w.get("vision_tower.patch_embed.proj.bias"))
    blocks = [{k[len(p):]: v for k, v in w.items() if k.startswith(p)}
              for p in (f"vision_tower.encoder.blocks.{i}." for i in range(cfg.depth))]
    outs, start = [], 0
    for gh, gw in grids:
        n = gh * gw
        xi = x[start:start + n] + position_table(w["vision_tower.patch_embed.pos_emb.weight"], gh, gw).to(x.dtype)
        cos, sin = rotary_2d(gh, gw, cfg.head_dim)
        for bw in blocks:
            xi = block(xi, bw, cfg, cos, sin)
        xi = rms_norm(xi, w["vision_tower.encoder.final_layernorm.weight"], cfg.eps)
        outs.append(merge(xi, gh, gw, cfg.merge))
        start += n
    return projector(torch.cat(outs), w, cfg)


def projector(x: torch.Tensor, w: dict, cfg: MoonVitConfig) -> torch.Tensor:
    """patchmergerv2: linear, exact GELU, linear into the text width, RMS norm."""
    x = F.gelu(F.linear(x, w["mm_projector.proj.0.weight"], w.get("mm_projector.proj.0.bias")))
    x = F.linear(x, w["mm_projector.proj.2.weight"], w.get("mm_projector.proj.2.bias"))
    return rms_norm(x, w["mm_projector.post_norm.weight"], cfg.projector_eps)
