"""GLM-5.3-Flash's vision tower (transformers' Glm5NextVisionModel, float math of the release):
a patch embedding (a Conv3d whose kernel equals its stride: one matmul per patch), blocks of pre-norm attention
with per-head q/k RMS norms and 2-D axial rotary, clamped SwiGLU MLPs, a final RMS norm, a 2x2 merge (a Conv2d
whose kernel equals its stride) and the projector (linear, LayerNorm, GELU, clamped SwiGLU) into the text width.

Patches arrive in the image processor's order: merge blocks of m x m patches row by row, each block's patches row
by row inside it (preprocessing's `patchify`), so the merge reads m*m consecutive rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..mlp import swiglu_act
from ..norm import rms_norm


@dataclass(frozen=True)
class Glm5VisionConfig:
    hidden: int
    heads: int
    depth: int
    out_hidden: int
    patch_size: int
    temporal_patch_size: int
    merge: int
    in_channels: int
    eps: float
    rope_theta: float
    swiglu_limit: float | None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def positions(grid_h: int, grid_w: int, merge: int) -> torch.Tensor:
    """[h*w, 2] (row, column) of each patch in the processor's block-major order."""
    hh, ww = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    return torch.stack([hh.reshape(shape).transpose(1, 2).flatten(),
                        ww.reshape(shape).transpose(1, 2).flatten()], dim=-1)


def axial_rotary(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] in float32: a quarter of the frequencies per axis (rows then columns), the pair
    repeated so the whole head rotates (rotate-half convention)."""
    spatial = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
    f = pos[..., None].float() * inv                       # [N, 2, head_dim // 4]
    f = torch.cat([f[:, 0], f[:, 1]], dim=-1)
    f = torch.cat([f, f], dim=-1)
    return f.cos(), f.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dt, x = x.dtype, x.float()
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None] + rot * sin[:, None]).to(dt)


def attention(x: torch.Tensor, w: dict, cfg: Glm5VisionConfig, cos, sin, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention within each image (lengths: its patches); x [N, hidden]."""
    n = x.shape[0]
    q, k, v = F.linear(x, w["attn.qkv.weight"], w.get("attn.qkv.bias")).view(n, 3, cfg.heads, -1).unbind(1)
    q = _rotate(rms_norm(q, w["attn.q_norm.weight"], cfg.eps), cos, sin)
    k = _rotate(rms_norm(k, w["attn.k_norm.weight"], cfg.eps), cos, sin)
    outs = []
    for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1),
                                           scale=cfg.head_dim ** -0.5)
        outs.append(o.transpose(0, 1).reshape(qi.shape[0], -1))
    return F.linear(torch.cat(outs), w["attn.proj.weight"], w.get("attn.proj.bias"))


def block(x: torch.Tensor, w: dict, cfg: Glm5VisionConfig, cos, sin, lengths: list[int]) -> torch.Tensor:
    x = x + attention(rms_norm(x, w["norm1.weight"], cfg.eps), w, cfg, cos, sin, lengths)
    h = rms_norm(x, w["norm2.weight"], cfg.eps)
    g = F.linear(h, w["mlp.gate_proj.weight"], w.get("mlp.gate_proj.bias"))
    u = F.linear(h, w["mlp.up_proj.weight"], w.get("mlp.up_proj.bias"))
    return x + F.linear(swiglu_act(g, u, cfg.swiglu_limit), w["mlp.down_proj.weight"], w.get("mlp.down_proj.bias"))


def tower(pixels: torch.Tensor, grids: list[tuple[int, int]], w: dict, cfg: Glm5VisionConfig) -> torch.Tensor:
    """pixels [N, C*T*P*P] of the images whose patch grids are `grids` ([(h, w), ...]); w: the tower's tensors
    without the `visual.` prefix -> [N / merge^2, out_hidden]: one row per image placeholder token."""
    pw = w["patch_embed.proj.weight"]
    x = F.linear(pixels.to(pw.dtype), pw.reshape(pw.shape[0], -1), w.get("patch_embed.proj.bias"))
    pos = torch.cat([positions(h, ww, cfg.merge) for h, ww in grids])
    cos, sin = axial_rotary(pos, cfg.head_dim, cfg.rope_theta)
    lengths = [h * ww for h, ww in grids]
    for i in range(cfg.depth):
        p = f"blocks.{i}."
        x = block(x, {k[len(p):]: v for k, v in w.items() if k.startswith(p)}, cfg, cos, sin, lengths)
    x = rms_norm(x, w["post_layernorm.weight"], cfg.eps)
    # the m x m merge: m*m consecutive rows -> one, through the Conv2d's kernel as a matrix ([out, hidden*m*m])
    m2 = cfg.merge * cfg.merge
    x = x.view(-1, m2, cfg.hidden).transpose(1, 2).reshape(-1, cfg.hidden * m2)
    dw = w["downsample.weight"]
    x = F.linear(x, dw.reshape(dw.shape[0], -1), w.get("downsample.bias"))
    return projector(x, w, cfg)


def projector(x: torch.Tensor, w: dict, cfg: Glm5VisionConfig) -> torch.Tensor:
    """The patch merger into the text model's width: linear, LayerNorm, exact GELU, clamped SwiGLU."""
    x = F.linear(x, w["merger.proj.weight"], w.get("merger.proj.bias"))
    x = F.gelu(F.layer_norm(x, (x.shape[-1],), w["merger.post_projection_norm.weight"].to(x.dtype),
                            w["merger.post_projection_norm.bias"].to(x.dtype), 1e-5))
    g = F.linear(x, w["merger.gate_proj.weight"], w.get("merger.gate_proj.bias"))
    u = F.linear(x, w["merger.up_proj.weight"], w.get("merger.up_proj.bias"))
    return F.linear(swiglu_act(g, u, cfg.swiglu_limit), w["merger.down_proj.weight"], w.get("merger.down_proj.bias"))
