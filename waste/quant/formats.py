"""The registry of storage formats for weight matrices (base.py is the interface).

A format turns a float matrix into named parts (raw tensors) and back. The container stores parts;
the runtime multiplies through the format's own `linear` (a packed kernel for quantized formats). Quantized
formats (intq.py: q8, q4; lowbit.py: vq3, mxfp4) add parts such as `q` and `scale` beside each other in the
same record; docs/FORMAT.md gives their byte layouts.
"""
from __future__ import annotations

import torch

from ..errors import WasteError
from .base import Format, Plain
from .intq import Q4, Q8
from .lowbit import MXFP4, VQ3

FORMATS: dict[str, Format] = {
    f.name: f for f in (Plain("bf16", torch.bfloat16), Plain("f16", torch.float16), Plain("f32", torch.float32),
                        Q8(), Q4("q4", 64), *(Q4(f"q4g{g}", g) for g in (32, 64, 128, 256)), VQ3(), MXFP4())
}


# What `waste convert` writes when not told otherwise (docs/LEARNED.md, "Quantized formats", says why).
DEFAULT_EXPERTS = "q4"
DEFAULT_TRUNK = "q8"


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise WasteError(f"unknown weight format {name!r}; known formats: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]
