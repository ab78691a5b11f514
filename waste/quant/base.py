"""A storage format of a weight matrix: the interface every format implements (pack -> parts, unpack, linear),
and the plain float formats. The registry of every format is formats.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Format:
    name: str = ""
    bits: float = 0.0
    kernel_dtype: torch.dtype | None = None   # the activation dtype linear() computes in whatever x's (None: x's)
    kind: str = ""                            # grouped-kernel family (layers/moe.py); "" means the name

    def pack(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def unpack(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def part_specs(self, shape: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """suffix -> (dtype, shape) of the parts pack() makes for a matrix of this shape, without packing one."""
        return {k: (v.dtype, tuple(v.shape)) for k, v in self.pack(torch.zeros(shape)).items()}

    def supports(self, shape: tuple[int, ...]) -> bool:
        """Can pack() take a matrix of this shape? (The trunk keeps the others in bf16.)"""
        return True

    def prepare(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Parts ready for linear(), e.g. repacked for this machine's kernel: a pure function of the stored parts.
        linear() takes parts as this returns them; the trunk prepares at load, the expert cache as a record fills
        its slot (runtime/experts.py prepare_record), never per call."""
        return parts

    def row_kernel(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]):
        """A callable for one float32 row on the CPU (x [1, K] -> [1, N] float32) with the parts bound, or None
        where linear() serves that row as well (linear.py asks once per matrix)."""
        return None

    def needs_prepare(self) -> bool:
        """Does prepare() change anything on this machine?"""
        return False

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """x [T, in] @ W.T for the matrix these parts hold; the result has x's dtype. Formats with a faster
        kernel than unpack-then-F.linear override this."""
        return F.linear(x, self.unpack(parts, shape, x.dtype))


class Plain(Format):
    """One part holding the matrix in a float dtype, row-major."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype
        self.bits = torch.finfo(dtype).bits
        self.kind = "float"

    def pack(self, w):
        return {"": w.to(self.dtype).contiguous()}

    def part_specs(self, shape):
        return {"": (self.dtype, tuple(shape))}

    def unpack(self, parts, shape, dtype):
        return parts[""].view(shape).to(dtype)
