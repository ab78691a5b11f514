"""Fused triton kernels for one decode row on a GPU: fewer launches per layer (a captured decode step is a chain of
small kernels, each costing a few microseconds whatever it reads: docs/LEARNED.md §10b).

- qk_rope_put: GQA's per-head q/k RMS norm, rotary (half-rotation, the position read from a tensor) and the key /
  value row written into the cache buffers at that position: one launch instead of about a dozen.
- attend_row: that row's attention over the cache rows up to the position (the position read from the tensor,
  so a CUDA graph replays it at any length): the mask, the masked SDPA and its copies replaced by two launches,
  each head's rows split in equal shares over programs and the shares' softmax combined (flash-decoding; one
  program a head had left the chip idle: docs/LEARNED.md §10g).
- softmax_topk_tail: a router's softmax over the experts' logits, top-k and the renormalisation: one launch
  instead of four to six. router_row: a decode row's logits and that tail in one launch (the last of its programs
  to finish takes the tail), without the row's cast to float32.
- add_rms: the residual add and the next RMS norm of rows in one launch (the norm's float32 weight read as it is:
  the add, the norm and the weight's cast were three); rms_rows is the same kernel without the add, which every
  CUDA row norm of that shape takes, so a norm's bits do not depend on whether an add came with it.
All compute in float32 and round once on the store; callers use them only where `usable` says (CUDA, triton
imported, shapes they handle) and keep the torch path everywhere else, so the CPU's bits never change.
"""
from __future__ import annotations

import torch

from ..triton_launch import Fast, aligned, pdl, pdl_begin, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:          # no triton: callers keep the torch path
    triton = None

ENABLED = True               # benchmarks turn the fused kernels off to measure the torch path in the same process
ROUTER_ROW = True            # router_row for a decode row's softmax router (benchmarks time cuBLAS's path)
ATTN_SPLIT = True            # attend_row split over the keys (flash-decoding: two launches); False: a program a head


def usable(x: torch.Tensor) -> bool:
    return ENABLED and triton is not None and x.is_cuda


if triton is not None:
    @triton.jit
    def _qk_rope_put(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kb_ptr, vb_ptr, H, KV, eps,
                     D: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        # program h < H: query head h; else key head h - H, and its value head copied beside it
        pdl_begin(PDL)
        pdl_wait(PDL)
        h = tl.program_id(0)
        pos = tl.load(pos_ptr).to(tl.int64)
        i = tl.arange(0, D)
        j = (i + D // 2) % D                          # rotate_half: out[i] = -x[i + D/2] (first half), x[i - D/2]
        sign = tl.where(i < D // 2, -1.0, 1.0)
        src = qkv_ptr + h * D
        x = tl.load(src + i).to(tl.float32)
        xr = tl.load(src + j).to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
            if h < H:
                w, wr = tl.load(qn_ptr + i).to(tl.float32), tl.load(qn_ptr + j).to(tl.float32)
            else:
                w, wr = tl.load(kn_ptr + i).to(tl.float32), tl.load(kn_ptr + j).to(tl.float32)
            x, xr = x * r * w, xr * r * wr
        c = tl.load(cos_ptr + pos * D + i).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + i).to(tl.float32)
        y = x * c + sign * xr * s
        if h < H:
            tl.store(q_ptr + h * D + i, y.to(q_ptr.dtype.element_ty))
        else:
            g = h - H
            row = (pos * KV + g) * D + i
            tl.store(kb_ptr + row, y.to(kb_ptr.dtype.element_ty))
            v = tl.load(qkv_ptr + (H + KV + g) * D + i)
            tl.store(vb_ptr + row, v.to(vb_ptr.dtype.element_ty))

    @triton.jit
    def _attend_row(q_ptr, kb_ptr, vb_ptr, pos_ptr, o_ptr, scale, KV, GRP, D: tl.constexpr, BLK: tl.constexpr,
                    PDL: tl.constexpr):
        # one query head per program over cache rows 0 .. pos (read from the tensor: the loop's length follows the
        # replayed position), online softmax in float32
        pdl_begin(PDL)
        pdl_wait(PDL)
        h = tl.program_id(0)
        g = h // GRP
        pos = tl.load(pos_ptr).to(tl.int64)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + h * D + d).to(tl.float32) * scale
        m = tl.full([], float("-inf"), tl.float32)
        l = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([D], tl.float32)
        for s0 in range(0, pos + 1, BLK):
            r = s0 + tl.arange(0, BLK)
            rm = r <= pos
            at = (r[:, None] * KV + g) * D + d[None, :]
            k = tl.load(kb_ptr + at, mask=rm[:, None], other=0.0).to(tl.float32)
            sc = tl.where(rm, tl.sum(k * q[None, :], 1), float("-inf"))
            m2 = tl.maximum(m, tl.max(sc, 0))
            alpha = tl.exp(m - m2)
            pr = tl.exp(sc - m2)
            v = tl.load(vb_ptr + at, mask=rm[:, None], other=0.0).to(tl.float32)
            l = l * alpha + tl.sum(pr, 0)
            acc = acc * alpha + tl.sum(pr[:, None] * v, 0)
            m = m2
        tl.store(o_ptr + h * D + d, (acc / l).to(o_ptr.dtype.element_ty))

    @triton.jit
    def _attend_part(q_ptr, kb_ptr, vb_ptr, pos_ptr, m_ptr, l_ptr, a_ptr, scale, KV, GRP, S, D: tl.constexpr,
                     BLK: tl.constexpr, PDL: tl.constexpr):
        # flash-decoding's first pass: program (h, j) takes the j-th of S equal shares of the rows 0 .. pos (the
        # share's length follows the replayed position) and leaves its running max, sum and unnormalised output
        pdl_begin(PDL)
        pdl_wait(PDL)
        h = tl.program_id(0)
        j = tl.program_id(1)
        g = h // GRP
        n = tl.load(pos_ptr).to(tl.int64) + 1
        ch = (n + S - 1) // S
        lo = j * ch
        hi = tl.minimum(lo + ch, n)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + h * D + d).to(tl.float32) * scale
        m = tl.full([], float("-inf"), tl.float32)
        l = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([D], tl.float32)
        for s0 in range(lo, hi, BLK):
            r = s0 + tl.arange(0, BLK)
            rm = r < hi
            at = (r[:, None] * KV + g) * D + d[None, :]
            k = tl.load(kb_ptr + at, mask=rm[:, None], other=0.0).to(tl.float32)
            v = tl.load(vb_ptr + at, mask=rm[:, None], other=0.0).to(tl.float32)
            sc = tl.where(rm, tl.sum(k * q[None, :], 1), float("-inf"))
            m2 = tl.maximum(m, tl.max(sc, 0))
            alpha = tl.exp(m - m2)
            pr = tl.exp(sc - m2)
            l = l * alpha + tl.sum(pr, 0)
            acc = acc * alpha + tl.sum(pr[:, None] * v, 0)
            m = m2
        i = h * S + j
        tl.store(m_ptr + i, m)
        tl.store(l_ptr + i, l)
        tl.store(a_ptr + i * D + d, acc)

    @triton.jit
    def _attend_combine(m_ptr, l_ptr, a_ptr, o_ptr, S, D: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
        # the second pass: a head's S shares rescaled to their common max and summed in order (a share with no rows
        # has max -inf and weighs 0; share 0 always has row 0)
        pdl_begin(PDL)
        pdl_wait(PDL)
        h = tl.program_id(0)
        j = tl.arange(0, SP)
        d = tl.arange(0, D)
        jm = j < S
        m = tl.load(m_ptr + h * S + j, mask=jm, other=float("-inf"))
        l = tl.load(l_ptr + h * S + j, mask=jm, other=0.0)
        w = tl.exp(m - tl.max(m, 0))
        a = tl.load(a_ptr + (h * S + j)[:, None] * D + d[None, :], mask=jm[:, None], other=0.0)
        o = tl.sum(w[:, None] * a, 0) / tl.sum(w * l, 0)
        tl.store(o_ptr + h * D + d, o.to(o_ptr.dtype.element_ty))

    _QK_ROPE_PUT, _ATTEND_ROW = Fast(_qk_rope_put), Fast(_attend_row)
    _ATTEND_PART, _ATTEND_COMBINE = Fast(_attend_part), Fast(_attend_combine)

    @triton.jit
    def _topk_of(x, e, E, w_ptr, idx_ptr, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, NORM: tl.constexpr):
        # softmax over the E logits x [BE] (lanes e), the K largest (descending; ties to the lower id), renormalised
        p = tl.exp(x - tl.max(x, 0))
        p = p / tl.sum(p, 0)
        p = tl.where(e < E, p, -1.0)
        kr = tl.arange(0, KP)
        ws = tl.zeros([KP], tl.float32)
        ids = tl.zeros([KP], tl.int64)
        for r in tl.static_range(K):
            m = tl.max(p, 0)
            i = tl.min(tl.where(p == m, e, BE), 0)
            ws = tl.where(kr == r, m, ws)
            ids = tl.where(kr == r, i.to(tl.int64), ids)
            p = tl.where(e == i, -2.0, p)
        if NORM:
            ws = ws / tl.sum(ws, 0)
        tl.store(w_ptr + kr, ws, mask=kr < K)
        tl.store(idx_ptr + kr, ids, mask=kr < K)

    @triton.jit
    def _softmax_topk(logit_ptr, E, w_ptr, idx_ptr, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                      NORM: tl.constexpr):
        # one program per row of logits
        t = tl.program_id(0)
        e = tl.arange(0, BE)
        x = tl.load(logit_ptr + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
        _topk_of(x, e, E, w_ptr + t * K, idx_ptr + t * K, K, KP, BE, NORM)

    @triton.jit
    def _router_row(x_ptr, r_ptr, logit_ptr, count_ptr, E, H, w_ptr, idx_ptr, EP: tl.constexpr, BH: tl.constexpr,
                    K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        # EP experts' float32 logits of one row (x widened as read), then the last program to finish takes the
        # softmax and top-k of all E (the programs count themselves in count_ptr, which that program zeroes again)
        pdl_begin(PDL)
        e = tl.program_id(0) * EP + tl.arange(0, EP)
        em = e < E
        # the first columns of the router read while the kernel before (whose output is x) finishes
        h = tl.arange(0, BH)
        hm = h < H
        w = tl.load(r_ptr + e[:, None].to(tl.int64) * H + h[None, :], mask=em[:, None] & hm[None, :], other=0.0)
        pdl_wait(PDL)
        acc = w.to(tl.float32) * tl.load(x_ptr + h, mask=hm, other=0.0).to(tl.float32)[None, :]
        for h0 in range(BH, H, BH):
            h = h0 + tl.arange(0, BH)
            hm = h < H
            w = tl.load(r_ptr + e[:, None].to(tl.int64) * H + h[None, :], mask=em[:, None] & hm[None, :], other=0.0)
            acc += w.to(tl.float32) * tl.load(x_ptr + h, mask=hm, other=0.0).to(tl.float32)[None, :]
        tl.store(logit_ptr + e, tl.sum(acc, 1), mask=em)
        tl.debug_barrier()                 # every thread's logits stored before the count says so
        if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.store(count_ptr, 0)
            a = tl.arange(0, BE)
            x = tl.load(logit_ptr + a, mask=a < E, other=float("-inf"), cache_modifier=".cg")
            _topk_of(x, a, E, w_ptr, idx_ptr, K, KP, BE, NORM)

    _ROUTER_ROW = Fast(_router_row)


def qk_rope_usable(qkv: torch.Tensor, cos: torch.Tensor, kbuf: torch.Tensor, d: int, rotary_dim) -> bool:
    return (usable(qkv) and qkv.shape[0] == 1 and qkv.is_contiguous() and kbuf.is_contiguous()
            and cos.is_contiguous() and d & (d - 1) == 0 and rotary_dim in (None, d) and cos.shape[-1] == d)


def qk_rope_put(qkv: torch.Tensor, H: int, KV: int, d: int, q_norm, k_norm, eps: float, cos: torch.Tensor,
                sin: torch.Tensor, pos: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor) -> torch.Tensor:
    """One decode row's qkv [1, (H + 2 KV) d] -> q [1, H, d] normed and rotated; the row's key (normed, rotated) and
    value written into kbuf / vbuf [capacity, KV, d] at the position pos [1] (a tensor: a CUDA graph replays it).
    cos / sin: the rope tables [positions, 1, d]; q_norm / k_norm None: no q/k norm."""
    q = torch.empty(1, H, d, dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    qn, kn = (q_norm, k_norm) if norm else (qkv, qkv)
    dep = pdl(qkv)
    _QK_ROPE_PUT((H, KV, d, norm, qkv.dtype, qn.dtype, kn.dtype, cos.dtype, kbuf.dtype,
                  aligned(qkv, qn, kn, cos, sin, pos, kbuf, vbuf), dep), (H + KV,),
                 qkv, qn, kn, cos, sin, pos, q, kbuf, vbuf, H, KV, eps, d, norm, dep, num_warps=1, launch_pdl=dep)
    return q


def attend_row(q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One decode row's attention: q [1, H, d] over the cache rows 0 .. pos of kbuf / vbuf [capacity, KV, d]
    (grouped-query: head h reads KV head h // (H / KV)), scaled by 1/sqrt(d) -> [1, H, d]."""
    _, H, d = q.shape
    KV = kbuf.shape[1]
    o = torch.empty_like(q)
    S = split_of(H) if ATTN_SPLIT else 1
    dep = pdl(q)
    if S == 1:
        _ATTEND_ROW((H, KV, d, q.dtype, kbuf.dtype, aligned(q, kbuf, vbuf, pos), dep), (H,),
                    q, kbuf, vbuf, pos, o, d ** -0.5, KV, H // KV, d, 64, dep, num_warps=4, launch_pdl=dep)
        return o
    m = torch.empty(H, S, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    a = torch.empty(H, S, d, dtype=torch.float32, device=q.device)
    _ATTEND_PART((H, KV, S, d, q.dtype, kbuf.dtype, aligned(q, kbuf, vbuf, pos), dep), (H, S),
                 q, kbuf, vbuf, pos, m, l, a, d ** -0.5, KV, H // KV, S, d, 32, dep, num_warps=4, launch_pdl=dep)
    _ATTEND_COMBINE((S, d, o.dtype, dep), (H,), m, l, a, o, S, d, triton.next_power_of_2(S), dep, num_warps=4,
                    launch_pdl=dep)
    return o


if triton is not None:
    @triton.jit
    def _add_rms(h_ptr, y_ptr, w_ptr, oh_ptr, ox_ptr, N, eps, B: tl.constexpr, ADD: tl.constexpr,
                 PDL: tl.constexpr):
        # row t: h' = h + y (rounded to the rows' dtype, as torch's add), x = h' / rms(h') * w in float32, rounded
        pdl_begin(PDL)
        t = tl.program_id(0).to(tl.int64)
        n = tl.arange(0, B)
        m = n < N
        nw = tl.load(w_ptr + n, mask=m, other=0.0).to(tl.float32)    # the norm's weight, before the wait
        pdl_wait(PDL)
        h = tl.load(h_ptr + t * N + n, mask=m, other=0.0)
        if ADD:
            h = (h.to(tl.float32) + tl.load(y_ptr + t * N + n, mask=m, other=0.0).to(tl.float32)).to(
                oh_ptr.dtype.element_ty)
            tl.store(oh_ptr + t * N + n, h, mask=m)
        hf = h.to(tl.float32)
        # 1 / sqrt correctly rounded (not rsqrt's approximation): float32 rows stay within the CPU's tolerance
        r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(hf * hf, 0), N.to(tl.float32)) + eps))
        x = hf * r * nw
        tl.store(ox_ptr + t * N + n, x.to(ox_ptr.dtype.element_ty), mask=m)

    _ADD_RMS = Fast(_add_rms)


def norm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows [T, N] of a CUDA float row dtype, contiguous, a weight of N: what add_rms / rms_rows take."""
    return usable(x) and x.dim() == 2 and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32) and \
        weight.dim() == 1 and weight.numel() == x.shape[1] and x.shape[1] <= 16384


def add_rms(h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(h + y, rms_norm(h + y) * weight) in h's dtype in one launch; y None: (h, rms_norm(h) * weight)."""
    h = h.contiguous()
    T, N = h.shape
    w = weight.contiguous()
    x = torch.empty_like(h)
    oh = h if y is None else torch.empty_like(h)
    yy = h if y is None else y.contiguous()
    B = triton.next_power_of_2(N)
    # the weight read before the wait: not when contiguous() just copied it
    add, warps, dep = y is not None, 4 if B <= 4096 else 8, pdl(h) and weight.is_contiguous()
    # oh and x: h or fresh from the caching allocator (512-byte aligned)
    _ADD_RMS((N, h.dtype, yy.dtype, w.dtype, aligned(h, yy, w), add, dep), (T,), h, yy, w, oh, x, N, eps, B, add,
             dep, num_warps=warps, launch_pdl=dep)
    return oh, x


def rms_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms(x, None, weight, eps)[1]


def split_of(H: int) -> int:
    """Shares of the rows per head: about 512 programs (one per head alone is 32 on a 132-multiprocessor chip)."""
    return max(1, min(16, 512 // H))


_COUNTS: dict = {}          # (device, stream, use) -> int32 counts of finished programs (their kernels zero them again)
_RETIRED: list = []


def counts(device: torch.device, n: int, use: str) -> torch.Tensor:
    """n int32 counters, zero, for a kernel whose last program to finish (counted by atomics) finishes the launch's
    work and zeroes its counter again: one buffer per device, stream and use, so calls in order share it."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0, use)
    c = _COUNTS.get(key)
    if c is None or c.numel() < n:
        if c is not None:           # a captured CUDA graph may hold the smaller one: kept, never freed
            _RETIRED.append(c)
        c = _COUNTS[key] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return c


def router_row_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One CUDA row [1, H] and a router [E, H] router_row takes (float32 or bf16 weights, up to 4096 experts)."""
    return (ROUTER_ROW and usable(x) and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()
            and weight.is_contiguous()
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.shape[0] <= 4096
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.device == x.device)


def router_row(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm: bool):
    """A decode row's router in one launch: float32 logits x W^T (x widened as read, no cast launch), softmax,
    top-k, renormalised when norm -> (weights [1, k] float32, ids [1, k] int64), as softmax_topk_tail of the
    logits (a program an expert: the gemv's 1 MB over 128 programs, not 32: LEARNED §10j)."""
    E, H = weight.shape
    count = counts(x.device, 1, "router_row")
    logits = torch.empty(E, dtype=torch.float32, device=x.device)
    w = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    idx = torch.empty(1, top_k, dtype=torch.int64, device=x.device)
    BH = min(triton.next_power_of_2(H), 2048)
    dep = pdl(x)
    _ROUTER_ROW((E, H, x.dtype, weight.dtype, aligned(x, weight, count), top_k, norm, dep), (E,), x, weight, logits,
                count, E, H, w, idx, 1, BH, top_k, triton.next_power_of_2(top_k), triton.next_power_of_2(E), norm,
                dep, num_warps=4, launch_pdl=dep)
    return w, idx


def softmax_topk_tail(logits: torch.Tensor, top_k: int, norm: bool):
    """Float32 logits [T, E] -> (weights [T, k] float32, ids [T, k] int64): softmax, top-k descending, renormalised
    when norm (the torch router's order of operations)."""
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    _softmax_topk[(T,)](logits.contiguous(), E, w, idx, K=top_k, KP=triton.next_power_of_2(top_k),
                        BE=triton.next_power_of_2(E), NORM=norm, num_warps=1)
    return w, idx
