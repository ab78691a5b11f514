"""Storage formats for weight matrices.

A format turns a float matrix into named parts (raw tensors) and back. The container stores parts;
the runtime asks the format to rebuild a matrix it can multiply with. Quantized formats (next issues)
add parts such as `q` and `scale` beside each other in the same record.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Format:
    name: str = ""
    bits: float = 0.0

    def pack(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def unpack(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """x [T, in] @ W.T for the matrix these parts hold; the result has x's dtype. Formats with a faster
        kernel than unpack-then-F.linear override this."""
        return F.linear(x, self.unpack(parts, shape, x.dtype))


class Plain(Format):
    """One part holding the matrix in a float dtype, row-major."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype
        self.bits = torch.finfo(dtype).bits

    def pack(self, w):
        return {"": w.to(self.dtype).contiguous()}

    def unpack(self, parts, shape, dtype):
        return parts[""].view(shape).to(dtype)


FORMATS: dict[str, Format] = {
    f.name: f for f in (Plain("bf16", torch.bfloat16), Plain("f16", torch.float16), Plain("f32", torch.float32))
}


def get_format(name: str) -> Format:
    from ..errors import WasteError

    if name not in FORMATS:
        raise WasteError(f"unknown weight format {name!r}; known formats: {', '.join(sorted(FORMATS))}")
    return FORMATS[name]
