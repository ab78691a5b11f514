"""The routed experts of one decode row on the CPU, every pair in one numba call straight from the slab.

At one row a pair is three matrix-vector products and an activation: through torch that is 6-12 operators per
pair (casts, gathers, bmm or int4 matmuls, the activation), each costing more in dispatch than in arithmetic at
the sizes of a decode step (docs/LEARNED.md §10). Here all k pairs of the row are one call that reads each
record's bytes where they sit in the slab (bf16 / float32 / q8 codes / q4 nibbles in the stored layout), so
nothing is gathered or widened first.

Exact per pair: each pair is computed by the same loops whatever else is in the call and on one thread (the pairs
of a row are spread over torch's thread count, one pair per thread at a time), so a pair gives the same bits in any
group, at any budget, at any thread count. The kernels compute in float32; a bf16 row (the compute dtype of
models above 2 GiB) is widened on the way in and its pairs rounded back to bf16 on the way out. Another activation
(K3's SiTU-GLU) or more than one row take layers/moe.py's torch kernels.
"""
from __future__ import annotations

import functools

import numpy as np
import torch



@functools.lru_cache(maxsize=1)
def _kernels():
    from . import cpu_kernels as k

    return {"weighted_row": k.weighted_row, "weighted_row_bf16": k.weighted_row_bf16, "bf16": k.pairs_bf16, "f32": k.pairs_f32, "q8": k.pairs_q8, "q4": k.pairs_q4,
            "q4_shared": k.pair_q4_shared}


def _flat(t: torch.Tensor) -> tuple[np.ndarray, int, int]:
    """A [slots, ...] view of the slab as (the whole slab as one flat numpy array of the part's dtype, bf16 as its
    uint16 bits; the part's offset in elements; the record stride in elements). The kernels slice a row out of it
    before looping: an index computed as offset + k may be negative for all numba knows, and the check it then adds
    per element stopped the loops from vectorising (8x slower, measured: LEARNED §10)."""
    dt = torch.int16 if t.dtype == torch.bfloat16 else t.dtype
    st = t.untyped_storage()
    flat = torch.empty(0, dtype=dt).set_(st, 0, (st.nbytes() // t.element_size(),)).numpy()
    return (flat.view(np.uint16) if t.dtype == torch.bfloat16 else flat), t.storage_offset(), t.stride(0)


class NumbaPairs:
    """The decode-row kernel for one bank: flat numpy views of its parts made once (the slab never moves)."""

    PARTS = {"float": ("",), "q8": ("q", "scale"), "q4": ("q", "sz")}

    def __init__(self, bank):
        from ..numba_ptr import follow_torch_threads

        self.follow = follow_torch_threads
        parts, kind = bank.parts, bank.fmt.kind
        flats = [_flat(parts[m][k]) for m in ("gate", "up", "down") for k in self.PARTS[kind]]
        os = np.array([(o, stride) for _, o, stride in flats], np.int64)
        arrays = tuple(a for a, _, _ in flats)
        inter = bank.shapes["gate"][0]
        limit = np.float32(bank.limit if bank.limit is not None else -1.0)
        if kind == "float":
            key = "bf16" if parts["gate"][""].dtype == torch.bfloat16 else "f32"
            self.fn, self.args = _kernels()[key], (*arrays, os, inter, limit)
        elif kind == "q8":
            self.fn, self.args = _kernels()["q8"], (*arrays, os, inter, limit)
        else:
            groups = np.array([parts[m]["sz"].shape[1] for m in ("gate", "up", "down")], np.int64)
            self.fn, self.args = _kernels()["q4"], (*arrays, os, groups, inter, limit)
            self.shared = _kernels()["q4_shared"]
            self._gu = np.empty((2, inter), np.float32)    # a shared pair's gate and up rows (one pair at a time)

    shared = None         # q4: pair_q4_shared (a pair's blocks over threads), else None

    def into_shared(self, x: torch.Tensor, slot: int, p: int, out: np.ndarray, pool) -> None:
        """One pair (slot) into row p of out, its blocks shared with one thread of pool through a queue (pair_q4_shared:
        the bits of `into`); this thread returns once every block is done. One shared pair at a time per bank."""
        q = np.zeros(2, np.int64)       # a fresh queue a call: a helper that wakes after it finds it spent
        gu = self._gu
        args = (x.data_ptr(), x.shape[-1], slot, *self.args, out[p].ctypes.data, gu[0].ctypes.data,
                gu[1].ctypes.data, q.ctypes.data)
        pool.submit(self.shared, *args, True)._keep = (x, out, q)
        self.shared(*args, False)

    def into(self, x: torch.Tensor, slots: np.ndarray, out: np.ndarray) -> None:
        """The pairs of slots (int64 [k], -1: not computed) of x (float32 [1, h], contiguous) into their rows of out
        (float32 [k, h]); the others left as they are, so threads may fill one out with disjoint pairs (moe.spread)."""
        self.follow()
        self.fn(x.data_ptr(), x.shape[-1], slots.ctypes.data, slots.shape[0], *self.args, out)

    def __call__(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """x [1, h] float32 or bf16, slots [1, k] int64 (-1: left zero) -> [1, k, h] in x's dtype."""
        k, h = slots.shape[1], x.shape[-1]
        out = np.zeros((1, k, h), np.float32)
        if x.dtype != torch.float32:
            return self(x.float(), slots).to(x.dtype)
        x = x if x.is_contiguous() else x.contiguous()
        slots = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
        self.follow()
        self.fn(x.data_ptr(), h, slots.data_ptr(), k, *self.args, out[0])
        return torch.from_numpy(out)


def weighted_row(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """layers/moe.py weighted_sum of one float32 or bf16 row on the CPU in one call ([1, k, h], [1, k] -> [1, h]; a
    bf16 row's sum in float32, rounded once, as torch's bmm of the widened pairs then the cast: 5 operators, ~45 us
    on a streamed decode step's critical path, LEARNED §3l), or None where it does not apply."""
    if y.shape[0] != 1 or y.dtype not in (torch.float32, torch.bfloat16) or weights.dtype != torch.float32 \
            or y.device.type != "cpu":
        return None
    y = y if y.is_contiguous() else y.contiguous()
    weights = weights if weights.is_contiguous() else weights.contiguous()
    if y.dtype == torch.bfloat16:
        out = torch.empty((1, y.shape[2]), dtype=torch.bfloat16)
        _kernels()["weighted_row_bf16"](y.data_ptr(), weights.data_ptr(), y.shape[1], y.shape[2], out.data_ptr())
        return out
    out = np.empty((1, y.shape[2]), np.float32)
    _kernels()["weighted_row"](y.data_ptr(), weights.data_ptr(), y.shape[1], y.shape[2], out)
    return torch.from_numpy(out)


def usable(bank) -> bool:
    """Whether this bank's records can go through the numba pairs: q4 / q8 / bf16 / float32 records with SwiGLU and
    no biases (gpt-oss's biased, clamped-GLU records take the torch kernels)."""
    if bank.act is not None or getattr(bank, "bias", False) or bank.fmt.kind not in ("float", "q8", "q4"):
        return False
    if bank.fmt.kind == "float":
        dts = {bank.parts[m][""].dtype for m in ("gate", "up", "down")}
        return dts in ({torch.bfloat16}, {torch.float32})
    if bank.fmt.kind == "q4":
        # the kernels read the stored nibble layout; a torch build that repacks records in their slots (no AVX-512:
        # int4pack.native() false) leaves another layout there
        return not bank.fmt.needs_prepare() and all(set(bank.parts[m]) == {"q", "sz"} for m in ("gate", "up", "down"))
    return True


def warm() -> None:
    """Load (or compile, the first time on a machine) every numba kernel a CPU decode row uses, on tiny inputs of the
    real calls' types: numba and its LLVM runtime take about 150 MB once a kernel runs, and the memory plan measures
    the process's own memory as its baseline, so this runs before the plan does (Engine.load)."""
    from ..numba_ptr import follow_torch_threads
    from ..quant import q4_numba
    from . import attention_cpu, norm_cpu, router_cpu

    # numba's OpenMP layer shares torch's OpenMP runtime: a parallel kernel launched at another thread count would
    # change torch's too (and with it the bits of torch's reductions), so every launch first takes torch's count
    follow_torch_threads()
    f32, i64 = np.float32, np.int64
    h, k, inter = 64, 2, 32
    x, slots = torch.zeros(1, h), torch.zeros(1, k, dtype=torch.int64)
    out = np.zeros((1, k, h), f32)[0]
    os = np.zeros((6, 2), i64)
    ks = _kernels()
    words = np.zeros(h * inter, np.uint16)
    ks["bf16"](x.data_ptr(), h, slots.data_ptr(), k, words, words, words, os[:3].copy(), inter, f32(-1), out)
    floats = np.zeros(h * inter, f32)
    ks["f32"](x.data_ptr(), h, slots.data_ptr(), k, floats, floats, floats, os[:3].copy(), inter, f32(-1), out)
    codes, scales = np.zeros(h * inter, np.int8), np.ones(h * inter, f32)
    ks["q8"](x.data_ptr(), h, slots.data_ptr(), k, codes, scales, codes, scales, codes, scales, os, inter, f32(-1), out)
    nib, sz = np.zeros(h * inter // 2, np.uint8), np.zeros(h * inter, np.uint16)
    ks["q4"](x.data_ptr(), h, slots.data_ptr(), k, nib, sz, nib, sz, nib, sz, os, np.ones(3, i64), inter, f32(-1), out)
    weighted_row(torch.zeros(1, k, h), torch.zeros(1, k))
    weighted_row(torch.zeros(1, k, h, dtype=torch.bfloat16), torch.zeros(1, k))
    router_cpu.softmax_topk_row(x, torch.zeros(4, h), 2, True)
    H, G, d = 2, 1, 8
    buf = torch.zeros(4, G, d)
    attention_cpu.gqa_row(torch.zeros(1, (H + 2 * G) * d), H, G, torch.ones(d), torch.ones(d), 1e-6, torch.ones(d),
                          torch.zeros(d), buf, buf.clone(), 0)
    norm_cpu.rms_rows(x, torch.ones(h), 1e-6)
    for w in (torch.ones(h), torch.ones(h, dtype=torch.bfloat16)):
        norm_cpu.rms_rows(x.bfloat16(), w, 1e-6)
    q4 = {"q": torch.zeros(h, h // 2, dtype=torch.uint8), "sz": torch.zeros(1, h, 2, dtype=torch.bfloat16)}
    q4_numba.row(x, q4, (h, h))
