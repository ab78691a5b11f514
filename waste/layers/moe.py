"""The routed experts of a MoE layer as one grouped computation straight from the expert slab; kernels chosen by
(format kind, device).

The slab (runtime/cache.py) holds fixed-size records; each matrix part is one [slots, ...] tensor view over it
(`Bank`). A kernel takes the rows x [T, h], the slot of every (row, choice) pair [T, k] and returns each pair's
expert output [T, k, h] (unweighted): the weighted sum is the caller's (layers/moe.py), so it is taken the same
way whichever kernel ran. Pairs whose slot is -1 are left zero (their expert is computed in another group when the
budget cannot hold all of a layer's experts at once).

Two ways to run the pairs, both exact per pair whatever else is in the call:
- gather: one row per pair (decode): the pairs' matrices are gathered into [P, n, k] and multiplied with one bmm
  per projection; no Python loop, no host sync. Float formats and q8.
- segments: rows grouped by expert (prefill, or formats with a per-matrix kernel such as torch's int4): one matmul
  per distinct expert through the format's own linear, its rows together.
A CUDA backend registers its own kernels under ("q4", "cuda") etc. without touching layers or models.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..quant.linear import ROW_DTYPES
from . import cpu_prefill, moe_cpu
from .mlp import oai_glu_act, situ_act, swiglu_act

MATRICES = ("gate", "up", "down")


@dataclass
class Bank:
    """A layer-independent view of the expert slab: per matrix, its parts as [slots, ...] tensors (suffix "" for a
    float matrix, "q" / "scale" / ... for a quantized one), the matrix shapes, the format, and `gate_up`: gate and
    up as one [slots, 2 * inter, h] view when the record stores them back to back in a float format."""
    parts: dict[str, dict[str, torch.Tensor]]
    shapes: dict[str, tuple[int, int]]
    fmt: object
    limit: float | None = None                     # clamped SwiGLU's limit (GLM-5.3)
    gate_up: torch.Tensor | None = None
    act: tuple | None = None                       # (beta, linear_beta): SiTU-GLU (Kimi K3) instead of SwiGLU;
    #                                                ("oai_glu", alpha, limit): gpt-oss's clamped GLU
    _by_slot: dict = field(default_factory=dict)
    _row_kernel: object = False                    # moe_cpu.NumbaPairs once made; None where it cannot serve
    _rows_kernel: object = False                   # cpu_prefill.GroupedRows once made; None where it cannot serve

    def row_kernel(self):
        """The numba kernel for one decode row on the CPU (layers/moe_cpu.py), or None for records it does not read."""
        if self._row_kernel is False:
            self._row_kernel = moe_cpu.NumbaPairs(self) if moe_cpu.usable(self) else None
        return self._row_kernel

    def rows_kernel(self):
        """The numba kernel for a prefill chunk's pairs on the CPU (layers/cpu_prefill.py: q4 records), or None."""
        if self._rows_kernel is False:
            self._rows_kernel = cpu_prefill.GroupedRows(self) if cpu_prefill.usable(self) else None
        return self._rows_kernel

    def __post_init__(self):
        self.bias = "bias" in self.parts.get("gate", {})    # gpt-oss: records carry gate / up / down biases

    def activate(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The experts' gated activation of gate and up outputs."""
        if self.act is None:
            return swiglu_act(g, u, self.limit)
        if self.act[0] == "oai_glu":
            return oai_glu_act(g, u, *self.act[1:])
        return situ_act(g, u, *self.act)

    def slot_parts(self, slot: int) -> dict[str, dict[str, torch.Tensor]]:
        """One slot's matrices (views; made once per slot, the slab never moves)."""
        p = self._by_slot.get(slot)
        if p is None:
            p = self._by_slot[slot] = {m: {k: v[slot] for k, v in ps.items()} for m, ps in self.parts.items()}
        return p


def _biased(y: torch.Tensor, parts: dict) -> torch.Tensor:
    """y plus the matrix's bias when its record carries one (gpt-oss), in y's dtype."""
    b = parts.get("bias")
    return y if b is None else y + b.to(y.dtype)


Kernel = Callable[[torch.Tensor, torch.Tensor, Bank], torch.Tensor]
_KERNELS: dict[tuple[str, str], Kernel] = {}


def register(kind: str, device: str):
    def deco(fn: Kernel) -> Kernel:
        _KERNELS[(kind, device)] = fn
        return fn
    return deco


_LAYOUTS: dict[tuple[str, str], Callable] = {}


def register_layout(kind: str, device: str):
    """A device's own layout of a format's records: fn(record layout, format) -> rewrite(rows, slots), which the
    expert store calls in place on the device's slab once a record's stored bytes have landed in its slots."""
    def deco(fn: Callable) -> Callable:
        _LAYOUTS[(kind, device)] = fn
        return fn
    return deco


def layout_for(fmt, device: torch.device | str, layout) -> Callable | None:
    """The rewrite of freshly landed records into this device's layout for the format, or None (kept as stored)."""
    make = _LAYOUTS.get((fmt.kind or fmt.name, torch.device(device).type))
    return make(layout, fmt) if make is not None and layout is not None else None


def kernel_for(fmt, device: torch.device | str) -> Kernel:
    """The pairs kernel for this format on this device: its own, else its kind's (float / q8), else segments."""
    dev = torch.device(device).type
    for key in ((fmt.name, dev), (fmt.kind or fmt.name, dev)):
        if key in _KERNELS:
            return _KERNELS[key]
    return segments


def expert_rows(x: torch.Tensor, parts: dict, bank: Bank) -> torch.Tensor:
    """down(act(gate x, up x)) of one expert's rows through the format's own matmul, in x's dtype."""
    fmt, sh, dt = bank.fmt, bank.shapes, x.dtype
    if fmt.kernel_dtype is not None and dt != fmt.kernel_dtype:
        x = x.to(fmt.kernel_dtype)     # once per expert, not once per matrix
    g = _biased(fmt.linear(x, parts["gate"], sh["gate"]), parts["gate"])
    u = _biased(fmt.linear(x, parts["up"], sh["up"]), parts["up"])
    return _biased(fmt.linear(bank.activate(g, u), parts["down"], sh["down"]), parts["down"]).to(dt)


def segments(x: torch.Tensor, slots: torch.Tensor, bank: Bank) -> torch.Tensor:
    """Rows grouped by expert: one call of the format's matmul per distinct slot, over all its rows."""
    T, k = slots.shape
    out = x.new_zeros(T, k, x.shape[-1])
    flat = slots.reshape(-1)
    order = torch.argsort(flat, stable=True)
    uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
    start = 0
    flat_out = out.view(T * k, -1)
    for s, n in zip(uniq.tolist(), counts.tolist()):
        pairs = order[start:start + n]
        start += n
        if s < 0:
            continue
        flat_out[pairs] = expert_rows(x[pairs // k], bank.slot_parts(s), bank)
    return out


def _gather(x: torch.Tensor, slots: torch.Tensor, bank: Bank, mv) -> torch.Tensor:
    """One row (T == 1) against each of its k pairs' experts: mv(matrix, slots, vectors [P, n_in]) -> [P, n_out]
    multiplies each pair's matrix by its vector (a gather and one bmm)."""
    T, k = slots.shape
    if T != 1:
        return segments(x, slots, bank)
    flat = slots.reshape(-1)
    xr = x.expand(k, -1)
    if bank.gate_up is not None:
        w = bank.gate_up[flat]
        gu = torch.bmm(w if w.dtype == x.dtype else w.to(x.dtype), xr.unsqueeze(-1)).squeeze(-1)
        inter = gu.shape[-1] // 2
        g, u = gu[:, :inter], gu[:, inter:]
    else:
        g, u = mv("gate", flat, xr), mv("up", flat, xr)
    if not bank.bias:
        return mv("down", flat, bank.activate(g, u)).view(T, k, -1)
    b = {m: bank.parts[m]["bias"][flat] for m in MATRICES}
    g, u = g + b["gate"].to(g.dtype), u + b["up"].to(u.dtype)
    y = mv("down", flat, bank.activate(g, u))
    return (y + b["down"].to(y.dtype)).view(T, k, -1)


@register("float", "cuda")              # plain torch ops; on the CPU, one decode row goes through numba (cpu_rows)
def gather_float(x: torch.Tensor, slots: torch.Tensor, bank: Bank) -> torch.Tensor:
    def mv(m, flat, v):
        w = bank.parts[m][""][flat]          # stored bf16 and computed in float32: widened after the gather
        return torch.bmm(w if w.dtype == v.dtype else w.to(v.dtype), v.unsqueeze(-1)).squeeze(-1)
    return _gather(x, slots, bank, mv)


@register("q8", "cuda")
def gather_q8(x: torch.Tensor, slots: torch.Tensor, bank: Bank) -> torch.Tensor:
    """The pairs' int8 codes gathered and widened to float32, multiplied, the row scales applied to the output:
    the q8 format's own float32 arithmetic (docs/LEARNED.md §5b), one bmm per projection."""
    if x.dtype != torch.float32:
        return segments(x, slots, bank)

    def mv(m, flat, v):
        p = bank.parts[m]
        return torch.bmm(p["q"][flat].float(), v.unsqueeze(-1)).squeeze(-1) * p["scale"][flat]
    return _gather(x, slots, bank, mv)


@register("mxfp4", "cpu")
@register("vq3", "cpu")
def per_pair(x: torch.Tensor, slots: torch.Tensor, bank: Bank) -> torch.Tensor:
    """Formats whose matmul takes one matrix at a time (torch's int4 kernel, the numba LUT kernels): at one row,
    each pair through it in turn, the row cast to the kernel's dtype once."""
    T, k = slots.shape
    if T != 1:
        return segments(x, slots, bank)
    fmt, sh, dt = bank.fmt, bank.shapes, x.dtype
    xk = x if fmt.kernel_dtype in (None, dt) else x.to(fmt.kernel_dtype)
    ys = []
    for s in slots[0].tolist():
        p = bank.slot_parts(s)
        h = bank.activate(_biased(fmt.linear(xk, p["gate"], sh["gate"]), p["gate"]),
                          _biased(fmt.linear(xk, p["up"], sh["up"]), p["up"]))
        ys.append(_biased(fmt.linear(h, p["down"], sh["down"]), p["down"]))
    return torch.stack(ys, 1).to(dt)


per_pair.per_matrix = True      # each pair through its own matmul: exact in a call of any size


def cpu_rows(torch_kernel: Kernel) -> Kernel:
    """On the CPU, a float32 or bf16 decode row's pairs in one numba call (layers/moe_cpu.py: 2-9x faster than the
    torch kernels at decode sizes, LEARNED §10, §10d), a float32 prefill chunk's q4 pairs in another
    (layers/cpu_prefill.py, §10c); everything else (K3's activation, a bf16 prefill) through torch_kernel. Pairs
    with slot -1 are left zero, as the contract asks."""
    def kernel(x: torch.Tensor, slots: torch.Tensor, bank: Bank) -> torch.Tensor:
        nb = _numba_rows(x, bank)
        return nb(x, slots) if nb is not None else torch_kernel(x, slots, bank)
    kernel.__name__ = f"cpu_rows({torch_kernel.__name__})"
    kernel.per_matrix = getattr(torch_kernel, "per_matrix", False)
    kernel.numba_rows = True
    return kernel


register("float", "cpu")(cpu_rows(gather_float))
register("q8", "cpu")(cpu_rows(gather_q8))
register("q4", "cpu")(cpu_rows(per_pair))


def weighted_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * y[t, k] in float32 (routing weights are float32), in y's dtype."""
    row = moe_cpu.weighted_row(y, weights)      # one float32 row on the CPU: one numba call, not three operators
    if row is not None:
        return row
    out = torch.bmm(weights.unsqueeze(1), y if y.dtype == torch.float32 else y.float()).squeeze(1)
    return out if out.dtype == y.dtype else out.to(y.dtype)


def expert_pairs(x: torch.Tensor, slots: torch.Tensor, bank: Bank, kernel: Kernel,
                 complete: bool = True) -> torch.Tensor:
    """Each pair's expert output [T, k, h] (unweighted). complete=False: some slots are -1 (another group of the
    layer's experts holds them); their pairs are left zero. Every kernel is exact per pair whatever else is in the
    call, so a pair computes to the same bits in whichever group its expert lands."""
    if complete or getattr(kernel, "any_slots", False):     # (moe_triton: exact per pair, -1 pairs left zero)
        return kernel(x, slots, bank)
    if slots.shape[0] != 1:
        return prefill_pairs(x, slots, bank)
    if getattr(kernel, "numba_rows", False) and _numba_row(x, bank):
        return bank.row_kernel()(x, slots)     # numba computes only the pairs it is given, each alone
    valid = slots >= 0
    held = slots[valid]
    if not held.numel():
        return x.new_zeros(1, slots.shape[1], x.shape[-1])
    if getattr(kernel, "per_matrix", False):
        out = x.new_zeros(1, slots.shape[1], x.shape[-1])
        out[valid] = kernel(x, held.view(1, -1), bank)[0]
        return out
    # a batched kernel (bmm) is exact per pair only at one batch size (MKL picks its path by shape, measured on
    # kimi_linear's gate_up): run all k pairs, the missing ones on a slot this group holds; the caller masks them
    return kernel(x, torch.where(valid, slots, held[:1]), bank)


def routed_experts(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, bank: Bank, kernel: Kernel,
                   complete: bool = True) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{slots[t, k]}(x[t]): x [T, h], slots and weights [T, k]. complete=False: some
    slots are -1 (this group of the layer's experts does not hold them); their pairs contribute nothing here."""
    return weighted_sum(expert_pairs(x, slots, bank, kernel, complete), weights)


def routed_groups(xs: list[torch.Tensor], weights: list[torch.Tensor], groups, bank: Bank,
                  kernel: Kernel, pool=None) -> list[torch.Tensor]:
    """routed_experts for several sequences whose experts arrive in groups ((slots per sequence, complete), as the
    expert store yields them while its reads land): each pair's output is computed in exactly one group and kept,
    and the weighted sum is taken once over all of them, so the result is the same bits however the reads landed.
    pool: threads that take every other pair of a single CPU decode row (numba, exact per pair) while this thread
    computes the rest and goes on to the next group (`spread`)."""
    if pool is not None and len(xs) == 1 and xs[0].shape[0] == 1 and (
            getattr(kernel, "per_matrix", False) or _numba_row(xs[0], bank)):
        return [weighted_sum(spread(xs[0], groups, bank, kernel, pool), weights[0])]
    wp = getattr(kernel, "weighted_pairs", None)
    if wp is not None and all(wp.serves(x, bank) for x in xs):
        # a kernel that weighs each pair itself (moe_triton: float32 pairs, no activation or weighting operators):
        # the pairs of every group kept, summed over k once, as below
        acc = None
        total = getattr(wp, "sum_pairs", None)      # the kernel's own sum and cast in one launch, where it has one
        it = iter(groups)
        for slots, complete in it:
            if complete and acc is None and total is not None:
                # every pair in this one group: summed by the kernel itself (q4 decode rows: in the down launch);
                # the store's call is finished (it yields nothing more) before the result is returned
                out = [wp(x, s, w, bank, total=x.dtype) for x, s, w in zip(xs, slots, weights)]
                if next(it, None) is not None:
                    raise RuntimeError("the expert store yielded a group after a complete one")
                return out
            part = [wp(x, s, w, bank) for x, s, w in zip(xs, slots, weights)]
            acc = part if acc is None else [torch.where((s >= 0).unsqueeze(-1), p, a)
                                            for a, s, p in zip(acc, slots, part)]
        return [a.sum(1).to(x.dtype) if total is None else total(a, x.dtype) for a, x in zip(acc, xs)]
    pairs = None
    for slots, complete in groups:
        part = [expert_pairs(x, s, bank, kernel, complete) for x, s in zip(xs, slots)]
        if complete and pairs is None:
            pairs = part
            continue
        if pairs is None:
            pairs = [torch.zeros_like(p) for p in part]
        pairs = [torch.where((s >= 0).unsqueeze(-1), p, a) for a, s, p in zip(pairs, slots, part)]
    return [weighted_sum(p, w) for p, w in zip(pairs, weights)]


def prefill_pairs(x: torch.Tensor, slots: torch.Tensor, bank: Bank) -> torch.Tensor:
    """A prefill chunk's pairs (of any row count: expert parallel hands a rank the rows routed to it, one or more) as
    one process computes them, each pair exact whatever else is in the call: the grouped numba kernel where it
    serves (q4 records on the CPU, float32 or bf16 rows), else one matmul per expert over all its rows (segments)."""
    rk = bank.rows_kernel() if x.dtype in ROW_DTYPES and x.device.type == "cpu" else None
    return rk(x, slots) if rk is not None else segments(x, slots, bank)


def _numba_rows(x: torch.Tensor, bank: Bank):
    """The numba kernel for these CPU rows' pairs (float32 or bf16 rows): the decode row's at one row, the prefill
    chunk's above (q4 records), or None."""
    if x.device.type != "cpu" or x.dtype not in ROW_DTYPES:
        return None
    return bank.row_kernel() if x.shape[0] == 1 else bank.rows_kernel()


def _numba_row(x: torch.Tensor, bank: Bank) -> bool:
    """Whether x is one decode row that numba's row kernel computes."""
    return x.shape[0] == 1 and _numba_rows(x, bank) is not None


def spread(x: torch.Tensor, groups, bank: Bank, kernel: Kernel, pool) -> torch.Tensor:
    """One decode row's pairs [1, k, h] over this thread and a pool's: the pairs are dealt in turn, as their groups
    land, to the pool (which computes them in the background) and to this thread, so the expert compute of a
    streamed layer runs on more than one core while its reads land. Only for kernels that compute just the pairs
    they are given, each alone (numba's row kernel, per-matrix formats; both release the GIL), so the bits are
    those of one call."""
    if _numba_row(x, bank):
        return _spread_numba(x, groups, bank.row_kernel(), pool)
    out, theirs, turn = None, [], 0
    for (slots,), _ in groups:
        if out is None:
            out = x.new_zeros(1, slots.shape[1], x.shape[-1])
        valid = (slots[0] >= 0).nonzero().flatten().tolist()
        give = valid[turn::2]
        keep = sorted(set(valid) - set(give))
        turn = (turn + len(valid)) % 2
        if give:
            theirs.append((give, pool.submit(expert_pairs, x, _only(slots, give), bank, kernel, False)))
        if keep:
            out[0, keep] = expert_pairs(x, _only(slots, keep), bank, kernel, False)[0, keep]
    for give, f in theirs:
        out[0, give] = f.result()[0, give]
    return out


def _spread_numba(x: torch.Tensor, groups, nb, pool) -> torch.Tensor:
    """spread through numba's row kernel without torch operators between the reads (each costs ~5-10 us, and those
    after a layer's last read are on the step's critical path, docs/LEARNED.md §3n): both threads write their pairs
    into one float32 buffer; a group's first pair is this thread's, every other one of the rest the pool's. A lone
    pair (a layer's last, often) is shared block by block where the kernel can (q4: `NumbaPairs.into_shared`), this
    thread computing all of it if the pool's thread is late. The same loops on the same pairs: the bits of spread."""
    x32 = x.float() if x.dtype != torch.float32 else x
    x32 = x32 if x32.is_contiguous() else x32.contiguous()
    out, theirs = None, []
    for (slots,), _ in groups:
        row = slots.tolist()[0]          # no torch operator
        k = len(row)
        if out is None:
            out = np.zeros((k, x.shape[-1]), np.float32)
        valid = [p for p in range(k) if row[p] >= 0]
        mine, give = np.full(k, -1, np.int64), np.full(k, -1, np.int64)
        for j, p in enumerate(valid):
            (give if j % 2 else mine)[p] = row[p]
        if len(valid) > 1:
            theirs.append(pool.submit(nb.into, x32, give, out))
        if len(valid) == 1 and nb.shared is not None:   # a lone pair (often a layer's last): its blocks on both
            nb.into_shared(x32, row[valid[0]], valid[0], out, pool)
        elif valid:
            nb.into(x32, mine, out)
    for f in theirs:
        f.result()
    y = torch.from_numpy(out).unsqueeze(0)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _only(slots: torch.Tensor, pairs: list[int]) -> torch.Tensor:
    """slots [1, k] with every pair but these set to -1 (not computed)."""
    t = torch.full_like(slots, -1)
    t[0, pairs] = slots[0, pairs]
    return t
