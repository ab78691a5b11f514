"""The stored 4-bit nibble layout and torch's packed int4 matmul on CPU.

The layout (docs/FORMAT.md, "q4"): rows are taken in blocks of 64. A full block is K x 32 bytes, byte j of
column k holding row j in its low nibble and row j + 32 in its high nibble. The last block, when N is not a
multiple of 64, has nb rows (nb even) and is K x nb/2 bytes, byte j of column k holding rows 2j (low) and
2j + 1 (high). Blocks follow each other; the whole is N x K / 2 bytes, read as a uint8 [N, K/2] tensor.

This is exactly the operand of torch's `_weight_int4pack_mm_for_cpu` on an AVX-512 build (the one this
project runs on), so a record is multiplied straight from its cache slot with no repacking. On any other
build (AVX2, ARM, a future torch) `native()` says so, and `to_native` repacks once: the trunk at load, an
expert record in place each time it fills a cache slot (runtime/experts.py prepare_record), never per matmul —
a pure function of the stored bytes, so outputs stay the same whatever the cache does.
"""
from __future__ import annotations

import functools

import torch

BLOCK = 64            # rows per block in the stored layout (torch's AVX-512 operand); torch's AVX2 operand uses 32
KERNEL_GROUPS = (32, 64, 128, 256)


def pack_nibbles(q: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """q uint8 [N, K] with values 0..15 (N even) -> uint8 [N, K/2] in the layout with `block`-row blocks: byte j of
    column k holds row j (low nibble) and row j + block/2 (high) of a full block, rows 2j and 2j + 1 of the tail."""
    N, K = q.shape
    if N % 2:
        raise ValueError(f"4-bit packing needs an even number of rows, got {N}")
    q = q.to(torch.uint8)
    nb_full = N // block
    out = []
    if nb_full:
        b = q[:nb_full * block].view(nb_full, 2, block // 2, K)
        out.append((b[:, 0] | (b[:, 1] << 4)).transpose(1, 2).reshape(-1))      # [nb, K, block/2]
    tail = N - nb_full * block
    if tail:
        t = q[nb_full * block:].view(tail // 2, 2, K)
        out.append((t[:, 0] | (t[:, 1] << 4)).t().reshape(-1))                   # [K, tail/2]
    return torch.cat(out).view(N, K // 2) if K % 2 == 0 else torch.cat(out).view(N * K // 2)


def unpack_nibbles(p: torch.Tensor, N: int, K: int, block: int = BLOCK) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 [N, K] values 0..15."""
    flat = p.reshape(-1)
    q = torch.empty(N, K, dtype=torch.uint8)
    nb_full = N // block
    n0 = nb_full * block * K // 2
    if nb_full:
        b = flat[:n0].view(nb_full, K, block // 2).transpose(1, 2)                   # [nb, block/2, K]
        qv = q[:nb_full * block].view(nb_full, 2, block // 2, K)
        qv[:, 0] = b & 15
        qv[:, 1] = b >> 4
    tail = N - nb_full * block
    if tail:
        t = flat[n0:].view(K, tail // 2).t()                                          # [tail/2, K]
        qv = q[nb_full * block:].view(tail // 2, 2, K)
        qv[:, 0] = t & 15
        qv[:, 1] = t >> 4
    return q


def kernel_ok(N: int, K: int, group: int) -> bool:
    """Shapes torch's CPU int4 kernel takes: N a multiple of 16, K of a group size in 32..256."""
    return N % 16 == 0 and group in KERNEL_GROUPS and K % group == 0 and hasattr(torch, "_weight_int4pack_mm_for_cpu")


@functools.lru_cache(maxsize=1)
def kernel_block() -> int | None:
    """The block size of this torch build's int4 operand layout: 64 on AVX-512 builds (the stored layout), 32 on
    AVX2 ones; None when it is neither (ARM, a future torch): then its own packer is used."""
    if not hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        return None
    g = torch.Generator().manual_seed(0)
    for block in (BLOCK, 32):
        ok = True
        for n in (64, 80, 128 + 48):
            w = torch.randint(0, 16, (n, 64), generator=g, dtype=torch.int32)
            try:
                theirs = torch._convert_weight_to_int4pack_for_cpu(w, 2)
            except RuntimeError:
                return None
            ok = ok and torch.equal(theirs.reshape(-1), pack_nibbles(w.to(torch.uint8), block).reshape(-1))
        if ok:
            return block
    return None


def native() -> bool:
    """Does this torch build's own int4 packer produce the stored layout? (AVX-512 builds: yes.)"""
    return kernel_block() == BLOCK


def to_native(p: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The kernel's operand for stored nibbles p: p itself on AVX-512 builds, a reshuffle into 32-row blocks on
    AVX2 ones (0.6 ms per 768 x 2048 matrix), else a copy through torch's own packer (2.5 ms)."""
    if native():
        return p
    block = kernel_block()
    if block is not None:
        return pack_nibbles(unpack_nibbles(p, N, K), block)
    return torch._convert_weight_to_int4pack_for_cpu(unpack_nibbles(p, N, K).to(torch.int32).contiguous(), 2)


def int4_mm(x: torch.Tensor, p: torch.Tensor, group: int, scale_zero: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ W.T where W[n, k] = (q[n, k] - 8) * s[k // group, n] + z[k // group, n]; result in x's dtype.

    x may be float32, bfloat16 or float16; the kernel accumulates in float32 and wants the scales in x's dtype.
    A float32 x goes through as bfloat16 (its input and output rounded to bf16): torch's float32 path is 29x
    slower at one row and 74x at 64 (docs/LEARNED.md §5b), and the 4-bit weights' own error is 40x the rounding's."""
    if x.dtype == torch.float32:
        return int4_mm(x.to(torch.bfloat16), p, group, scale_zero).float()
    sz = scale_zero if scale_zero.dtype == x.dtype else scale_zero.to(x.dtype)
    return torch._weight_int4pack_mm_for_cpu(x.contiguous(), p, group, sz)


def _unpack_batched(p: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """unpack_nibbles over a batch [n, N, K/2] (any device) -> uint8 [n, N, K]."""
    n = p.shape[0]
    flat = p.reshape(n, -1)
    nb_full, tail = N // BLOCK, N % BLOCK
    parts = []
    if nb_full:
        b = flat[:, :nb_full * BLOCK * K // 2].view(n, nb_full, K, BLOCK // 2).transpose(2, 3)   # [n, nb, 32, K]
        parts.append(torch.cat([b & 15, b >> 4], 2).reshape(n, nb_full * BLOCK, K))
    if tail:
        t = flat[:, nb_full * BLOCK * K // 2:].view(n, K, tail // 2).transpose(1, 2)             # [n, tail/2, K]
        parts.append(torch.stack([t & 15, t >> 4], 2).reshape(n, tail, K))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def to_rows(p: torch.Tensor, N: int, K: int, group: int) -> torch.Tensor:
    """Stored nibbles [n, N, K/2] -> the GPU's row layout (docs/FORMAT.md, "q4 in GPU memory"): row n's bytes in
    order, each scale group's g/2 bytes holding its first g/2 columns in the low nibbles and its last g/2 in the
    high ones, so a thread's 16 contiguous bytes are 32 columns of one row under one (scale, zero) pair."""
    q = _unpack_batched(p, N, K).view(p.shape[0], N, K // group, 2, group // 2)
    return (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(p.shape[0], N, K // 2)

