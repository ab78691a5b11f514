"""Formats whose matmul needs a lookup kernel (numba): vq3 (residual vector quantization, 3 bits per weight of
codes) and mxfp4 (the OCP microscaling 4-bit float groups Kimi K3 ships, kept as released).

vq3:   each row is divided by its RMS; the row's weights, 8 at a time, are the sum of three codewords, one
       from each of three 256-entry codebooks fitted to that matrix (residual k-means). Parts:
         codes  uint8   [N, K/8, 3]    code of stage s for columns 8j..8j+7 of row n
         books  float16 [3, 256, 8]    the three codebooks
         scale  float16 [N]            the row RMS
       W[n, 8j + i] = scale[n] * sum_s books[s, codes[n, j, s], i]
       Matmul, few rows of x: a table L[t, j, s, c] = books[s, c] . x[t, 8j:8j+8] (torch), then
       y[t, n] = scale[n] * sum_{j,s} L[t, j, s, codes[n, j, s]] (numba, rows in parallel, each row's sum
       in a fixed order so the result does not depend on the thread count). Many rows: unpack, F.linear.
mxfp4: parts (names as compressed-tensors' mxfp4-pack-quantized release spells them, bytes as released):
         blocks uint8 [N, K/2]    E2M1 codes, element 2j in the low nibble, 2j+1 in the high one
         scales uint8 [N, K/32]   E8M0 exponents: the group's factor is 2^(e - 127)
       W[n, k] = E2M1[nibble] * 2^(scales[n, k // 32] - 127), E2M1 = 0, .5, 1, 1.5, 2, 3, 4, 6 and negatives.
numba is imported on first use only. numpy's spinning BLAS threads starve numba's unless OPENBLAS_NUM_THREADS=1
(shared/reference/machine.md §C): the CLI sets it for its process before numpy loads (cli.main).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .base import Format


VQ_DIM, VQ_CODES, VQ_STAGES = 8, 256, 3
VQ_TRAIN_VECTORS = 1 << 15
VQ_ITERS = 10
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _launch():
    """The kernels, with numba's thread count set to torch's first: numba's OpenMP layer shares torch's runtime, and a
    parallel launch at another count would change torch's count too."""
    from ..numba_ptr import follow_torch_threads

    follow_torch_threads()
    return _kernels()


@functools.lru_cache(maxsize=1)
def _kernels():
    try:
        from . import lowbit_numba as k
    except ImportError:
        from ..errors import WasteError

        raise WasteError("the vq3 and mxfp4 formats need numba: pip install numba") from None
    return k.vq_rows, k.vq_unpack, k.mx_rows, k.mx_unpack


# -- vq3 --------------------------------------------------------------------------------------------------
def _nearest(v: torch.Tensor, c: torch.Tensor, chunk: int = 1 << 15) -> torch.Tensor:
    cc = (c * c).sum(1)
    out = torch.empty(v.shape[0], dtype=torch.long)
    for i in range(0, v.shape[0], chunk):
        out[i:i + chunk] = (cc[None, :] - 2 * v[i:i + chunk] @ c.T).argmin(1)
    return out


def _kmeans(v: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    if v.shape[0] <= k:                       # fewer vectors than codes: every vector is a codeword
        c = torch.zeros(k, v.shape[1])
        c[:v.shape[0]] = v
        return c
    train = v[torch.randperm(v.shape[0], generator=gen)[:VQ_TRAIN_VECTORS]] if v.shape[0] > VQ_TRAIN_VECTORS else v
    c = train[torch.randperm(train.shape[0], generator=gen)[:k]].clone()
    for _ in range(VQ_ITERS):
        a = _nearest(train, c)
        s = torch.zeros_like(c).index_add_(0, a, train)
        n = torch.bincount(a, minlength=k).float()
        empty = n == 0
        c[~empty] = s[~empty] / n[~empty, None]
        if empty.any():                       # re-seed dead codewords on the worst-served vectors
            d = ((train - c[a]) ** 2).sum(1)
            c[empty] = train[d.topk(int(empty.sum())).indices]
    return c


class VQ3(Format):
    name, bits = "vq3", 3.0
    lut_rows = 1          # up to this many rows of x take the lookup kernel; more unpack once: at 2048x768 T=2 the
                          # kernel took 4.2 ms per expert, unpack + F.linear 2.3 ms (each row gathers its own table)

    def supports(self, shape) -> bool:
        return len(shape) == 2 and shape[1] % VQ_DIM == 0

    def part_specs(self, shape):
        N, K = shape
        return {"codes": (torch.uint8, (N, K // VQ_DIM, VQ_STAGES)), "books": (torch.float16, (VQ_STAGES, VQ_CODES, VQ_DIM)),
                "scale": (torch.float16, (N,))}

    def pack(self, w):
        N, K = w.shape
        if K % VQ_DIM:
            raise ValueError(f"vq3 needs a column count divisible by {VQ_DIM}, got {K}")
        w = w.float()
        scale = w.pow(2).mean(1).sqrt().clamp_min(1e-12).to(torch.float16)
        v = (w / scale.float()[:, None]).reshape(-1, VQ_DIM)
        gen = torch.Generator().manual_seed(0)
        books, codes, resid = [], [], v
        for _ in range(VQ_STAGES):
            c = _kmeans(resid, VQ_CODES, gen).to(torch.float16)
            a = _nearest(resid, c.float())
            resid = resid - c.float()[a]
            books.append(c)
            codes.append(a.to(torch.uint8))
        return {"codes": torch.stack(codes, -1).view(N, K // VQ_DIM, VQ_STAGES).contiguous(),
                "books": torch.stack(books).contiguous(), "scale": scale.contiguous()}

    def unpack(self, parts, shape, dtype):
        N, K = shape
        out = torch.empty(N, K, dtype=torch.float32)
        _launch()[1](parts["codes"].view(N, K // VQ_DIM, -1).numpy(), parts["books"].float().numpy(),
                      parts["scale"].float().numpy(), out.numpy())
        return out.to(dtype)

    def linear(self, x, parts, shape):
        N, K = shape
        T = x.shape[0]
        if T > self.lut_rows:
            return F.linear(x, self.unpack(parts, shape, x.dtype))
        vq_rows = _launch()[0]
        books = parts["books"].float()                                                     # [S, 256, 8]
        lut = torch.einsum("tjd,scd->tjsc", x.float().view(T, K // VQ_DIM, VQ_DIM), books).contiguous()
        out = torch.empty(T, N, dtype=torch.float32)
        vq_rows(lut.numpy(), parts["codes"].view(N, K // VQ_DIM, -1).numpy(), parts["scale"].float().numpy(),
                out.numpy())
        return out.to(x.dtype)


# -- mxfp4 ------------------------------------------------------------------------------------------------
MX_GROUP = 32
_POW2 = torch.tensor([2.0 ** (e - 127) for e in range(256)], dtype=torch.float32)


def mx_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float [N, K] -> mxfp4 parts (OCP MX: shared exponent floor(log2(amax)) - 2, nearest E2M1 value)."""
    N, K = w.shape
    x = w.float().view(N, K // MX_GROUP, MX_GROUP)
    amax = x.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2, torch.full_like(amax, -127.0))
    e = e.clamp(-127, 127)
    y = (x / torch.pow(2.0, e)[..., None]).clamp(-6, 6)
    mags = E2M1[:8]
    idx = (y.abs()[..., None] - mags).abs().argmin(-1)            # nearest magnitude (ties: the smaller one)
    nib = (idx + 8 * (y < 0).long()).to(torch.uint8).view(N, K)
    return {"blocks": (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous(),
            "scales": (e + 127).to(torch.uint8).contiguous()}


def mx_dequantize(blocks: torch.Tensor, scales: torch.Tensor, N: int, K: int) -> torch.Tensor:
    b = blocks.view(N, K // 2)
    nib = torch.stack([b & 15, b >> 4], -1).view(N, K).long()
    return (E2M1[nib].view(N, K // MX_GROUP, MX_GROUP) * _POW2[scales.view(N, -1).long()][..., None]).view(N, K)


class MXFP4(Format):
    name, bits = "mxfp4", 4.25
    lut_rows = 8          # 2048x768 per expert, kernel vs unpack + F.linear: T=8 1.24 vs 1.31 ms, T=12 1.87 vs 1.40 ms

    def supports(self, shape) -> bool:
        return len(shape) == 2 and shape[1] % MX_GROUP == 0

    def part_specs(self, shape):
        N, K = shape
        return {"blocks": (torch.uint8, (N, K // 2)), "scales": (torch.uint8, (N, K // MX_GROUP))}

    def pack(self, w):
        if w.shape[1] % MX_GROUP:
            raise ValueError(f"mxfp4 needs a column count divisible by {MX_GROUP}, got {w.shape[1]}")
        return mx_quantize(w)

    def unpack(self, parts, shape, dtype):
        N, K = shape
        out = torch.empty(N, K, dtype=torch.float32)
        _launch()[3](parts["blocks"].view(N, K // 2).numpy(), parts["scales"].view(N, K // MX_GROUP).numpy(),
                      _POW2.numpy(), out.numpy())
        return out.to(dtype)

    def linear(self, x, parts, shape):
        N, K = shape
        if x.shape[0] > self.lut_rows:
            return F.linear(x, self.unpack(parts, shape, x.dtype))
        T = x.shape[0]
        out = torch.empty(T, N, dtype=torch.float32)
        # mx_rows decodes each group's low nibbles (even columns), then its high ones: x in that order
        xp = x.float().view(T, K // MX_GROUP, MX_GROUP // 2, 2).transpose(2, 3).contiguous().view(T, K)
        _launch()[2](xp.numpy(), parts["blocks"].view(N, K // 2).numpy(), parts["scales"].view(N, K // MX_GROUP).numpy(),
                      _POW2.numpy(), out.numpy())
        return out.to(x.dtype)
