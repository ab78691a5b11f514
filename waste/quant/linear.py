"""One matmul for the trunk: `linear(x, w)` takes a float tensor or a quantized matrix (QuantWeight).

The layers call `linear` wherever they multiply by a trunk weight. A quantized trunk (waste convert --trunk q8)
stores each quantizable matrix as parts named `<tensor>.<part>` in trunk.safetensors and lists it in the
manifest's `trunk.quantized`; `assemble_trunk` turns those parts back into one QuantWeight per matrix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gemv_triton
from .formats import get_format

ROW_DTYPES = (torch.float32, torch.bfloat16)      # decode rows that take a format's numba row kernel


def _q8_rows():
    from . import q8_rows       # imports numba: only when a CPU prefill chunk first needs it

    return q8_rows


class QuantWeight:
    """A matrix kept in its stored format; multiplied through the format's own kernel."""

    __slots__ = ("fmt", "parts", "shape", "_row")

    def __init__(self, fmt, parts: dict[str, torch.Tensor], shape):
        self.fmt, self.shape, self._row = fmt, tuple(shape), False
        # safetensors packs tensors back to back, so a part may start at any byte; torch's int8 kernel reads
        # bfloat16 activations against it with aligned vector loads and crashes on an unaligned one
        parts = {k: v if v.data_ptr() % 64 == 0 else v.clone() for k, v in parts.items()}
        self.parts = fmt.prepare(parts, self.shape)

    dtype = None      # never equal to a compute dtype, so callers that cast on mismatch call .to(), a no-op

    def to(self, *args, **kwargs) -> "QuantWeight":
        """Casting to the compute dtype keeps the stored format: the kernel returns x's dtype."""
        return self

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self.fmt.unpack(self.parts, self.shape, dtype)

    def row_kernel(self):
        """The format's kernel for one float32 row on the CPU (a bf16 row widened to it), made once, or None."""
        if self._row is False:
            self._row = self.fmt.row_kernel(self.parts, self.shape)
        return self._row

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    def __repr__(self) -> str:
        return f"QuantWeight({self.fmt.name}, {list(self.shape)})"


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w.T (+ bias), in x's dtype, for a float tensor or a QuantWeight."""
    if isinstance(w, QuantWeight):
        if x.dim() == 2 and x.shape[0] == 1 and x.dtype in ROW_DTYPES and x.device.type == "cpu":
            rk = w.row_kernel()          # a decode row: one numba call, no dispatch through the format
            if rk is not None:
                # the kernels compute in float32: a bf16 row (models above 2 GiB) is widened and the result rounded
                y = rk(x) if x.dtype == torch.float32 else rk(x.float()).to(x.dtype)
                return y if bias is None else y + bias.to(y.dtype)
        if x.dim() == 2 and x.shape[0] > 1 and x.dtype in ROW_DTYPES and x.device.type == "cpu" and (
                w.fmt.kind == "q8" and _q8_rows().serves(*w.shape) and w.parts["q"].is_contiguous()
                and w.parts["scale"].dtype == torch.float32):
            # a prefill chunk through a q8 trunk matrix: int8 rows by VNNI (4x torch's kernel at the 30B shape;
            # the trunk's only: Q8.linear itself stays float32-exact for the experts' pairs)
            y = _q8_rows().linear(x, w.parts, w.shape)
        elif x.dim() == 2:          # rows already: no reshapes (each is an operator a decode step pays for)
            y = w.fmt.linear(x, w.parts, w.shape)
        else:
            lead = x.shape[:-1]
            y = w.fmt.linear(x.reshape(-1, x.shape[-1]), w.parts, w.shape).view(*lead, w.shape[0])
        return y if bias is None else y + bias.to(y.dtype)
    cast = w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype)
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if x.is_cuda and gemv_triton.usable(x, w):     # a GPU decode row: more of HBM's rate than cuBLAS's gemv
        return gemv_triton.row(x, w, bias, still=not cast)
    return F.linear(x, w, bias)


def fuse_rows(ws: list):
    """Matrices with the same input, stacked by output rows into one (one matmul instead of several: the q, k and v
    projections; gate and up), or None when their storage cannot be stacked as it is (mixed formats, q4's 64-row
    blocks cut). Float: cat. q8: codes and row scales cat. Exact: each output row is computed as before."""
    if all(isinstance(w, torch.Tensor) for w in ws):
        return torch.cat(ws) if len({w.dtype for w in ws}) == 1 else None
    if not all(isinstance(w, QuantWeight) for w in ws) or len({w.fmt.name for w in ws}) != 1:
        return None
    fmt = ws[0].fmt
    if fmt.name != "q8" or len({w.shape[1] for w in ws}) != 1:
        return None
    parts = {k: torch.cat([w.parts[k] for w in ws]) for k in ("q", "scale")}
    return QuantWeight(fmt, parts, (sum(w.shape[0] for w in ws), ws[0].shape[1]))


# trunk matrices that stay in float whatever --trunk says: looked up (embeddings); a family adds its own
# (the adapter's keep_float: MLA's kv_b_proj is split per head in the absorbed decode path)
KEEP_FLOAT_SUFFIXES = ("embed_tokens.weight",)


def quantizable(name: str, shape, fmt, keep_float: tuple[str, ...] = ()) -> bool:
    """Does the trunk store this (non-float32) tensor in the quantized format `fmt`? The projections every
    family multiplies through `linear` (`*_proj.weight`, `*_proj_with_mqa.weight`, `lm_head.weight`)."""
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return (len(shape) == 2 and min(shape) >= 16 and name.endswith(".weight")
            and not name.endswith(KEEP_FLOAT_SUFFIXES + tuple(keep_float))
            and (module.endswith(("proj", "proj_with_mqa")) or name == "lm_head.weight") and fmt.supports(tuple(shape)))


def part_name(name: str, suffix: str) -> str:
    return f"{name}.{suffix}" if suffix else name


def assemble_trunk(tensors: dict[str, torch.Tensor], trunk_manifest: dict) -> dict:
    """Replace the parts of each quantized matrix by one QuantWeight under the matrix's own name."""
    quantized = trunk_manifest.get("quantized") or {}
    if not quantized:
        return tensors
    fmt = get_format(trunk_manifest["format"])
    out = dict(tensors)
    for name, shape in quantized.items():
        prefix = name + "."
        parts = {k[len(prefix):]: out.pop(k) for k in [k for k in out if k.startswith(prefix)]}
        out[name] = QuantWeight(fmt, parts, shape)
    return out
