"""One decode row times a float trunk matrix on a GPU (linear's [1, K] x W[N, K]^T for bf16 / float32 weights).

cuBLAS's gemv for a row reads the 30B shape's q/k/v (5120 x 2048) and o (2048 x 4096, split over K with a reduce
launch after it) at 2.4-2.7 TB/s of the H200's 4.2 (docs/LEARNED.md §10j). Here each program owns BN rows and walks
K BK columns a step, keeping a [BN, BK] float32 accumulator (one multiply-add an element, no reduction until the
end), and BN is chosen so that there are enough programs to keep every multiprocessor's loads in flight: 68% of
HBM's rate on q/k/v against cuBLAS's 64%, 63% on o against 42%, the head at the copy's rate (LEARNED §10k).
The bits depend only on the tile, which depends only on (N, K): one row computes the same in every call.
"""
from __future__ import annotations

import torch

from ..triton_launch import Fast, aligned, pdl, pdl_begin, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:          # no triton: linear keeps F.linear
    triton = None

ENABLED = True               # benchmarks switch it off to time cuBLAS in the same process
PROGRAMS = 512               # about 4 programs a multiprocessor on a 132-SM chip: enough loads in flight
TILES: dict = {}             # (N, K) -> (BN, BK, warps): a benchmark's override of tile_for


def usable(x: torch.Tensor, w) -> bool:
    """A CUDA decode row [1, K] and a float matrix [N, K] of its dtype (bf16 or float32), both contiguous."""
    return (ENABLED and triton is not None and isinstance(w, torch.Tensor) and x.is_cuda and x.dim() == 2
            and x.shape[0] == 1 and w.dim() == 2 and w.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float32)
            and w.shape[1] == x.shape[1] and w.is_contiguous() and x.is_contiguous() and w.device == x.device)


def tile_for(N: int, K: int, esize: int = 2) -> tuple[int, int, int]:
    """(rows a program, columns a step, warps): 8 rows by 512 columns a step up to K = 2048, 4 by 2048 past it (the
    fastest of benchmarks/gemv_tiles.py's grid on the H200 for the 30B shape's q/k/v, o and head: LEARNED §10k),
    rows halved until there are PROGRAMS programs (or 1 row)."""
    if (N, K) in TILES:
        return TILES[(N, K)]
    bk = min(triton.next_power_of_2(K), 512 if K <= 2048 else 2048)
    bn = (8 if K <= 2048 else 4) * 2 // esize
    while bn > 1 and triton.cdiv(N, bn) < PROGRAMS:
        bn //= 2
    return max(bn, 1), bk, 4


if triton is not None:
    @triton.jit
    def _gemv(x_ptr, w_ptr, b_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr, BIAS: tl.constexpr,
              PDL: tl.constexpr):
        # y[n] = sum_k W[n, k] x[k] (+ b[n]) for rows n of this program, float32, rounded once on the store
        pdl_begin(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nm = n < N
        rows = w_ptr + n[:, None].to(tl.int64) * K
        # the first tile of W read while the kernel before (whose output is x) finishes: weights never change
        k = tl.arange(0, BK)
        km = k < K
        w = tl.load(rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        pdl_wait(PDL)
        acc = w.to(tl.float32) * tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)[None, :]
        for k0 in range(BK, K, BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            w = tl.load(rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            x = tl.load(x_ptr + k, mask=km, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, 1)
        if BIAS:
            y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
        tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=nm)

    _GEMV = Fast(_gemv)


def row(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, still: bool = True) -> torch.Tensor:
    """x [1, K] @ w[N, K].T (+ bias) in x's dtype: what F.linear returns, summed in another order. still: no kernel
    just before wrote w or bias (weights, not a cast made for this call), so the launch may read w's first tile
    while that kernel finishes (triton_launch.pdl)."""
    N, K = w.shape
    bn, bk, warps = tile_for(N, K, w.element_size())
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    b = bias.contiguous() if bias is not None else w
    has, dep = bias is not None, still and pdl(x)
    # y is the caching allocator's: 512-byte aligned
    _GEMV((N, K, x.dtype, b.dtype, aligned(x, w, b), bn, bk, warps, has, dep), (triton.cdiv(N, bn),),
          x, w, b, y, N, K, bn, bk, has, dep, num_warps=warps, launch_pdl=dep)
    return y
