"""Integer formats with torch's packed CPU matmuls: q8 (int8, one scale per row) and q4 (4-bit groups).

q8:  parts `q` int8 [N, K], `scale` float32 [N];  W[n, k] = q[n, k] * scale[n].
     Matmul: torch._weight_int8pack_mm for bfloat16/float16 x; a float32 x meets the codes as float32 in F.linear,
     the scales applied to its output.
q4:  parts `q` uint8 [N, K/2] (nibbles in int4pack.py's layout), `sz` bfloat16 [K/g, N, 2] (scale, zero);
     W[n, k] = (q[n, k] - 8) * sz[k // g, n, 0] + sz[k // g, n, 1]. The group g is the part shapes' K / (K/g),
     so one reader serves every group size. Matmul: torch._weight_int4pack_mm_for_cpu when the shape suits
     it (N % 16 == 0, g in 32..256), else unpack and F.linear (tiny test shapes only).
Both quantizers choose, per row (q8) or per group (q4), the clipping range with the least squared error
among a few shrink factors of the min/max range, rounding against the stored (bf16) scale and zero.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import int4pack
from .base import Format
from .q4fit import fit_groups

Q4_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
Q8_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8)
Q4_REFITS = 3


@functools.lru_cache(maxsize=1)
def _q8_numba():
    from . import q8_numba      # imports numba: only when a CPU decode row first needs it

    return q8_numba


class Q8(Format):
    name, bits, kind = "q8", 8.0, "q8"

    def supports(self, shape) -> bool:
        return len(shape) == 2

    def part_specs(self, shape):
        return {"q": (torch.int8, tuple(shape)), "scale": (torch.float32, (shape[0],))}

    def pack(self, w):
        w = w.float()
        amax = w.abs().amax(1).clamp_min(1e-30)
        best_q, best_s, best_e = None, None, None
        for shrink in Q8_SHRINK:
            s = amax * shrink / 127.0
            q = (w / s[:, None]).round().clamp(-127, 127)
            e = ((q * s[:, None] - w) ** 2).sum(1)
            if best_q is None:
                best_q, best_s, best_e = q, s, e
            else:
                better = e < best_e
                best_q = torch.where(better[:, None], q, best_q)
                best_s, best_e = torch.where(better, s, best_s), torch.minimum(e, best_e)
        return {"q": best_q.to(torch.int8).contiguous(), "scale": best_s.float().contiguous()}

    def unpack(self, parts, shape, dtype):
        return (parts["q"].view(shape).float() * parts["scale"].float()[:, None]).to(dtype)

    def row_kernel(self, parts, shape):
        """numba's q8 decode row (quant/q8_numba.py: x rounded to int8 in blocks of 32, integer dots), for the
        trunk's rows (quant/linear.py); linear() below stays float32-exact (the expert kernels call it per pair)."""
        q, s = parts["q"], parts["scale"]
        if q.device.type != "cpu" or s.dtype != torch.float32 or not (q.is_contiguous() and s.is_contiguous()):
            return None
        return _q8_numba().RowKernel(parts, shape)

    def linear(self, x, parts, shape):
        if x.dtype == torch.float32:
            # torch's float32 int8 path is 14-700x slower than its bf16 one, and rounding x to bf16 would add as much
            # error as the 8 bits do (LEARNED §5b): the codes as float32 through F.linear, the row scales applied to
            # the output (3.7x faster than that kernel at one row, 20x at 32)
            return F.linear(x, parts["q"].view(shape).float()) * parts["scale"]
        s = parts["scale"]
        return torch._weight_int8pack_mm(x.contiguous(), parts["q"].view(shape), s if s.dtype == x.dtype else s.to(x.dtype))


def group_for(K: int, group: int) -> int:
    """The group size a matrix with K columns gets: `group` when it divides K, else the largest power of two
    below it that does (tiny test shapes)."""
    g = group
    while g > 1 and K % g:
        g //= 2
    return g


@functools.lru_cache(maxsize=1)
def _q4_numba():
    from . import q4_numba      # imports numba: only when a CPU decode row first needs it

    return q4_numba


@functools.lru_cache(maxsize=1)
def _q4_rows():
    from . import q4_rows       # imports numba: only when a CPU prefill chunk first needs it

    return q4_rows


def _q4_vnni():
    from . import q4_vnni       # imports numba, as above

    return q4_vnni


class Q4(Format):
    bits, kind = 4.0, "q4"
    kernel_dtype = torch.bfloat16      # int4pack.int4_mm runs a float32 x as bf16
    # above this many rows of x, unpacking once and multiplying in float beats the int4 kernel (docs/LEARNED.md)
    dequant_rows = 1 << 30

    def __init__(self, name: str, group: int):
        self.name, self.group = name, group
        self.bits = 4.0 + 32.0 / group

    def supports(self, shape) -> bool:
        return len(shape) == 2 and shape[0] % 2 == 0 and shape[1] % 2 == 0

    def part_specs(self, shape):
        N, K = shape
        return {"q": (torch.uint8, (N, K // 2)), "sz": (torch.bfloat16, (K // group_for(K, self.group), N, 2))}

    def pack(self, w):
        N, K = w.shape
        if N % 2 or K % 2:
            raise ValueError(f"q4 needs an even number of rows and columns, got {N} x {K}")
        g = group_for(K, self.group)
        q, s, z = fit_groups(w.float().view(N, K // g, g), Q4_SHRINK, Q4_REFITS)
        sz = torch.stack([s, z], -1).transpose(0, 1).to(torch.bfloat16).contiguous()      # [K/g, N, 2]
        return {"q": int4pack.pack_nibbles(q.view(N, K).to(torch.uint8)), "sz": sz}

    @staticmethod
    def _group(parts, shape) -> int:
        return shape[1] // parts["sz"].shape[0]

    def unpack(self, parts, shape, dtype):
        N, K = shape
        g = self._group(parts, shape)
        q = int4pack.unpack_nibbles(parts["q"], N, K).float().view(N, K // g, g)
        sz = parts["sz"].float().transpose(0, 1)                                            # [N, K/g, 2]
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(N, K).to(dtype)

    def needs_prepare(self) -> bool:
        return not int4pack.native()

    def row_kernel(self, parts, shape):
        """numba's q4 decode row (quant/q4_numba.py), float32 throughout, where the parts keep the stored layout."""
        N, K = shape
        stored = int4pack.native() or not int4pack.kernel_ok(N, K, self._group(parts, shape))
        if not stored or parts["q"].device.type != "cpu" or not (parts["q"].is_contiguous()
                                                                and parts["sz"].is_contiguous()):
            return None
        return _q4_numba().RowKernel(parts, shape)

    def prepare(self, parts, shape):
        """Parts in the form linear() multiplies: the nibbles in this torch build's own layout."""
        N, K = shape
        if int4pack.native() or not int4pack.kernel_ok(N, K, self._group(parts, shape)):
            return parts
        return {**parts, "q": int4pack.to_native(parts["q"], N, K)}

    def linear(self, x, parts, shape):
        N, K = shape
        g = self._group(parts, shape)
        if x.shape[0] == 1 and x.dtype == torch.float32 and x.device.type == "cpu":
            rk = self.row_kernel(parts, shape)
            if rk is not None:
                return rk(x)
        if (x.shape[0] > 1 and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"
                and (int4pack.native() or not int4pack.kernel_ok(N, K, g))
                and parts["q"].is_contiguous() and parts["sz"].is_contiguous()):
            if _q4_vnni().serves(N, K):      # a prefill chunk: int8 rows by VNNI, each the decode row's bits
                y = _q4_vnni().linear(x.float(), parts, shape)          # (bf16 widened and rounded back, as a row)
                return y if x.dtype == torch.float32 else y.to(x.dtype)
            if x.dtype == torch.float32:
                return _q4_rows().linear_rows(x, parts, shape)  # else unpacked once, one sgemm
        if not int4pack.kernel_ok(N, K, g) or x.shape[0] > self.dequant_rows:
            return F.linear(x, self.unpack(parts, shape, x.dtype))      # (prepare() leaves these parts as stored)
        q = parts["q"]
        return int4pack.int4_mm(x, q if q.shape == (N, K // 2) else q.view(N, K // 2), g, parts["sz"])
