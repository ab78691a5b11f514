"""The compute dtype: `--dtype auto` picks float32 for small models (exact against the oracle) and bfloat16 above."""
from __future__ import annotations

import torch

from ..errors import WasteError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
AUTO_F32_BYTES = 2 << 30   # a model smaller than this computes in float32: exact, and cheap enough


def pick_dtype(name: str, stored_bytes: int) -> torch.dtype:
    """name: auto or a DTYPES key; stored_bytes: trunk + banks on disk. Above AUTO_F32_BYTES the stored bf16
    experts are used as they are instead of being widened for every use."""
    if name == "auto":
        return torch.float32 if stored_bytes < AUTO_F32_BYTES else torch.bfloat16
    if name not in DTYPES:
        raise WasteError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_dtype(name: str, container) -> torch.dtype:
    m = container.manifest
    return pick_dtype(name, m["trunk"]["bytes"] + m["experts"]["bytes"])
