"""One decode row's routed experts, group by group, replayed as CUDA graphs (`--device cuda`, experts streaming).

Where experts stream (the disk tier, a `--vram` tier), a MoE layer's experts arrive in groups as their reads land
(ExpertCache.resident), and each group's pairs go through a kernel that weighs them itself
(moe_triton.weighted_pairs; q4: quantize, gate_up, down). Eagerly a group costs ~0.24 ms of host time on the H200's
host (operands, spec keys, three launches: docs/LEARNED.md §10o), on the step's critical path after each landing.
Here each kind of group call is captured once per MoE layer and replayed, after the row, its routing weights and
the group's slots are copied into the graph's inputs. The calls are moe.routed_groups' own, in its order, so a
row's output has the same bits either way:
  whole  the first group holds every pair: the kernel sums them itself (its `sum_pairs` where it has one)
  first  the first of several groups: its pairs kept
  more   a later group: its pairs put where its slots are held
  total  after the last group: the kept pairs summed over k
"""
from __future__ import annotations

import torch

from .capture import capture_on_side


class RowGroups:
    """The graphs of one model's MoE layers (capture: fn -> (replayable, fn's output); tests give an eager one)."""

    def __init__(self, capture=None):
        self.capture = capture or self._capture
        self.on = True
        self._layers: dict = {}
        self._pool = None

    def _capture(self, fn):
        # one pool for every layer's graphs (a private pool each held a 2 MB block: ~0.4 GB over 48 layers x 4
        # kinds). Sharing is safe here although they replay in no fixed order: a graph's inputs and kept pairs
        # live outside the pool, and its output is read by the work queued right after its replay (the layer's
        # return), before any other of these graphs replays over the memory it may share with them
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_on_side(fn, self._pool)

    def serves(self, x: torch.Tensor, bank, kernel) -> bool:
        wp = getattr(kernel, "weighted_pairs", None)
        return self.on and wp is not None and x.shape[0] == 1 and wp.serves(x, bank)

    def run(self, i: int, x: torch.Tensor, weights: torch.Tensor, groups, bank, kernel) -> torch.Tensor:
        """Layer i's routed experts of one row x [1, h] with weights [1, k], over the store's groups ((slots per
        sequence, complete), one sequence): [1, h] in x's dtype, a buffer of the graph's (valid until layer i's
        next call)."""
        b = self._layers.get(i)
        if b is None or b.bank is not bank or b.x.dtype != x.dtype or b.w.shape != weights.shape:
            b = self._layers[i] = _Layer(x, weights, bank, kernel, self.capture)
        b.x.copy_(x)
        b.w.copy_(weights)
        it, first = iter(groups), True
        for slots, complete in it:
            b.s.copy_(slots[0])
            if complete and first and b.total is not None:
                out = b.replay("whole")
                if next(it, None) is not None:
                    raise RuntimeError("the expert store yielded a group after a complete one")
                return out
            b.replay("first" if first else "more")
            first = False
        return b.replay("total")


class _Layer:
    """One MoE layer's graph inputs (row, weights, slots), kept pairs, and its graphs by kind."""

    def __init__(self, x, weights, bank, kernel, capture):
        self.bank, self.wp, self.capture = bank, kernel.weighted_pairs, capture
        self.total = getattr(self.wp, "sum_pairs", None)
        k = weights.shape[1]
        with torch.inference_mode(False):      # written in and out of inference mode (a step runs in it)
            self.x, self.w = x.clone(), weights.clone()
            self.s = torch.zeros(1, k, dtype=torch.long, device=x.device)
            self.acc = torch.zeros(1, k, bank.shapes["down"][0], dtype=torch.float32, device=x.device)
        self.graphs: dict[str, tuple] = {}

    def _fn(self, kind: str):
        wp, x, s, w, bank, acc = self.wp, self.x, self.s, self.w, self.bank, self.acc
        if kind == "whole":
            return lambda: wp(x, s, w, bank, total=x.dtype)
        if kind == "first":
            return lambda: acc.copy_(wp(x, s, w, bank))
        if kind == "more":
            return lambda: acc.copy_(torch.where((s >= 0).unsqueeze(-1), wp(x, s, w, bank), acc))
        total = self.total
        return (lambda: total(acc, x.dtype)) if total is not None else (lambda: acc.sum(1).to(x.dtype))

    def replay(self, kind: str):
        g = self.graphs.get(kind)
        if g is None:
            g = self.graphs[kind] = self.capture(self._fn(kind))
        graph, out = g
        graph.replay()
        return out

