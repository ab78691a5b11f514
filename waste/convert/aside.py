"""What the converter sets aside from the trunk: a vision tower (written to its own file, loaded only by a request
with an image) and tensors an adapter deliberately drops (DeepSeek's MTP layers), recorded as notes."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from ..container.trunk import TrunkWriter
from ..errors import WasteError

VISION_FILE = "vision.safetensors"
IMAGE_TOKEN_KEYS = ("image_token_id", "image_start_token_id", "image_end_token_id", "media_placeholder_token_id")


class VisionWriter:
    """Writes the tower's tensors under the adapter's vision names, 1-D ones in float32, the rest in `fmt`."""

    def __init__(self, ckpt, adapter, fmt, root: Path, metadata: dict):
        self.src = {}
        for n in ckpt.weight_names():
            v = adapter.vision_target(n)
            if v is not None:
                self.src[n] = v
        self.fmt = fmt
        self.vision_config = ckpt.config.get("vision_config")
        # what runs the tower needs besides its weights: the placeholder token ids and the image processor's config
        self.tokens = {k: ckpt.config[k] for k in IMAGE_TOKEN_KEYS if ckpt.config.get(k) is not None}
        pre = Path(ckpt.src) / "preprocessor_config.json"
        try:
            self.preprocessor = json.loads(pre.read_text()) if pre.is_file() else None
        except ValueError as e:
            raise WasteError(f"{pre} is not valid JSON: {e}") from None
        self.writer = None
        if self.src:
            specs = {}
            for n, v in self.src.items():
                shape = ckpt.shape(n)
                specs[v] = (torch.float32 if len(shape) <= 1 else fmt.dtype, shape)
            self.specs = specs
            self.writer = TrunkWriter(str(root / VISION_FILE), specs, metadata)

    def take(self, name: str, get) -> bool:
        """Write `name` if it is the tower's (get() reads it); False if it is not."""
        v = self.src.get(name)
        if v is None:
            return False
        self.writer.write(v, get())
        return True

    def close(self) -> dict | None:
        """The manifest's `vision` entry, or None without a tower."""
        if self.writer is None:
            return None
        self.writer.close()
        return {"file": VISION_FILE, "format": self.fmt.name, "bytes": self.writer.bytes, "crc32": self.writer.crc32,
                "tensors": len(self.specs), "params": sum(torch.Size(s).numel() for _, s in self.specs.values()),
                "config": self.vision_config, "tokens": self.tokens, "preprocessor": self.preprocessor}


def drop_notes(names, adapter) -> list[str]:
    """One note per reason an adapter gave for leaving tensors out."""
    why = Counter(r for r in (adapter.dropped(n) for n in names) if r)
    return [f"left out {k} tensor{'s' if k > 1 else ''}: {r}" for r, k in sorted(why.items())]
