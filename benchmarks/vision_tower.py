"""GLM-5.3-Flash's vision tower at the release's size (24 blocks of 1024, merger to 1536; random bf16 weights), or
Kimi K3's MoonViT (--family kimi_k3: 27 blocks of 1024 with q/k/v of 1536, projector to 7168): what loading it
costs (read + CRC-32 check + cast, as Container.load_vision and models/vision.py do) and what one image costs
through the processor and the tower, by image size (docs/LEARNED.md §13: loaded on the first image).

    python benchmarks/vision_tower.py [--family glm5_next|kimi_k3] [--threads 2] [--tokens 64 256 1024]

The file is written to a temporary directory and read back twice: the first read is as cold as the page cache
allows after writing (posix_fadvise DONTNEED), the second warm.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from waste.images.glm5 import Glm5ImageProcessor  # noqa: E402
from waste.images.kimi_k3 import KimiK3ImageProcessor  # noqa: E402
from waste.models.vision import Glm5Vision, KimiK3Vision  # noqa: E402

CFG = {"depth": 24, "hidden_size": 1024, "num_heads": 16, "intermediate_size": 4096, "out_hidden_size": 1536,
       "projection_intermediate_size": 10240, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
       "in_channels": 3, "rms_norm_eps": 1e-5, "swiglu_limit": 10.0, "hidden_act": "silu"}


def shapes(c):
    D, I, O, P = c["hidden_size"], c["intermediate_size"], c["out_hidden_size"], c["projection_intermediate_size"]
    hd, m = D // c["num_heads"], c["spatial_merge_size"]
    yield "visual.patch_embed.proj.weight", (D, 3, c["temporal_patch_size"], c["patch_size"], c["patch_size"])
    yield "visual.patch_embed.proj.bias", (D,)
    for i in range(c["depth"]):
        p = f"visual.blocks.{i}."
        yield from [(p + "norm1.weight", (D,)), (p + "norm2.weight", (D,)), (p + "attn.qkv.weight", (3 * D, D)),
                    (p + "attn.qkv.bias", (3 * D,)), (p + "attn.proj.weight", (D, D)), (p + "attn.proj.bias", (D,)),
                    (p + "attn.q_norm.weight", (hd,)), (p + "attn.k_norm.weight", (hd,))]
        for n, s in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            yield p + f"mlp.{n}.weight", s
            yield p + f"mlp.{n}.bias", (s[0],)
    yield from [("visual.post_layernorm.weight", (D,)), ("visual.downsample.weight", (O, D, m, m)),
                ("visual.downsample.bias", (O,)), ("visual.merger.proj.weight", (O, O)),
                ("visual.merger.post_projection_norm.weight", (O,)), ("visual.merger.post_projection_norm.bias", (O,)),
                ("visual.merger.gate_proj.weight", (P, O)), ("visual.merger.up_proj.weight", (P, O)),
                ("visual.merger.down_proj.weight", (O, P))]


K3 = {"vt_hidden_size": 1024, "qkv_hidden_size": 1536, "vt_num_attention_heads": 12, "vt_num_hidden_layers": 27,
      "vt_intermediate_size": 4096, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "patch_size": 14,
      "merge_kernel_size": [2, 2], "mm_hidden_size": 1024, "text_hidden_size": 7168}


def k3_shapes(c):
    D, Q, I, T = c["vt_hidden_size"], c["qkv_hidden_size"], c["vt_intermediate_size"], c["text_hidden_size"]
    M = 4 * D
    yield "vision_tower.patch_embed.proj.weight", (D, 3, c["patch_size"], c["patch_size"])
    yield "vision_tower.patch_embed.pos_emb.weight", (c["init_pos_emb_height"], c["init_pos_emb_width"], D)
    for i in range(c["vt_num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{i}."
        yield from [(p + "norm0.weight", (D,)), (p + "norm1.weight", (D,)), (p + "wqkv.weight", (3 * Q, D)),
                    (p + "wo.weight", (D, Q)), (p + "mlp.fc0.weight", (I, D)), (p + "mlp.fc1.weight", (D, I))]
    yield from [("vision_tower.encoder.final_layernorm.weight", (D,)), ("mm_projector.proj.0.weight", (M, M)),
                ("mm_projector.proj.2.weight", (T, M)), ("mm_projector.post_norm.weight", (T,))]


# per family: (weights' shapes, the tower from its tensors, the processor at the release's defaults, channels x
# frames of a patch)
FAMILIES = {"glm5_next": (lambda: shapes(CFG), lambda t, dt: Glm5Vision({"config": CFG}, CFG["out_hidden_size"], t, dt),
                          Glm5ImageProcessor, 3 * 2),
            "kimi_k3": (lambda: k3_shapes(K3), lambda t, dt: KimiK3Vision({"config": K3}, K3["text_hidden_size"], t, dt),
                        KimiK3ImageProcessor, 3)}


def load(path, dtype, build):
    t0 = time.perf_counter()
    t = load_file(str(path))
    for v in t.values():
        zlib.crc32(v.contiguous().view(-1).view(torch.uint8).numpy())
    tower = build(t, dtype)
    return tower, time.perf_counter() - t0


def gemm_bound(threads: int) -> str:
    """The bound beside the tower's figures: this machine's bf16 GEMM at the tower's shapes, now (five timed calls
    after a warm-up; median and range)."""
    out = []
    for n in (256, 1024, 4096):
        x, w = torch.randn(n, 1024, dtype=torch.bfloat16), torch.randn(4096, 1024, dtype=torch.bfloat16)
        torch.nn.functional.linear(x, w)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        f = 2 * n * 1024 * 4096 / 1e12
        out.append(f"[{n},1024]x[1024,4096] {f / ts[2]:.2f} ({f / ts[-1]:.2f}-{f / ts[0]:.2f})")
    return f"bf16 GEMM, TFLOP/s at {threads} threads: " + ", ".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=sorted(FAMILIES), default="glm5_next")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    weights, build, processor, planes = FAMILIES[a.family]
    w = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in weights()}
    params = sum(v.numel() for v in w.values())
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "vision.safetensors"
        save_file(w, str(path))
        del w
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        _, cold = load(path, torch.bfloat16, build)
        tower, warm = load(path, torch.bfloat16, build)
    print(f"tower: {params / 1e6:.0f} M parameters, {size / 1e9:.2f} GB bf16; load + CRC + cast: "
          f"{cold:.2f} s after DONTNEED, {warm:.2f} s warm ({a.threads} threads)")
    print(gemm_bound(a.threads))
    proc = processor()
    rng = np.random.RandomState(0)
    for n in a.tokens:
        side = int(round((n ** 0.5) * 28))           # a square image of about n tokens
        t0 = time.perf_counter()
        try:
            from PIL import Image
            pix, grid = proc(Image.fromarray(rng.randint(0, 256, (side, side, 3), dtype=np.uint8)))
        except ImportError:                          # a machine without Pillow: the tower alone, on random pixels
            grid = proc.grid(side, side)
            pix = torch.randn(grid[0] * grid[1], planes * 14 * 14)
        t1 = time.perf_counter()
        rows = tower(pix, [grid])
        t2 = time.perf_counter()
        print(f"{side}x{side} image: {proc.tokens(grid)} tokens ({grid[0]}x{grid[1]} patches): processor "
              f"{1e3 * (t1 - t0):.0f} ms, tower {t2 - t1:.2f} s ({rows.shape[0] / (t2 - t1):.0f} tokens/s)")


if __name__ == "__main__":
    main()
