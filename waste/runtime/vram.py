"""The GPU tier of the expert store (`--device cuda [--vram SIZE]`): how much of the host's expert budget also sits in
GPU memory, where the kernels read it.

host budget  = the memory plan's expert budget (runtime/plan.py; `--budget`, `--ram`): the pinned host slab
VRAM budget  = `--vram`, at most the host budget; by default as much of the host budget as the GPU's free memory
               holds beside the trunk and the state (and GPU_RESERVE for the allocator, graphs and scratch)
Equal, the GPU slab mirrors the host slab slot for slot; smaller, it holds the host slab's most recently used
records (runtime/cache.py `_tier`), and the host slab is the tier below it, the bank files the one below that.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import WasteError
from ..units import fmt_bytes

GPU_RESERVE = 2 << 30


def vram_budget(plan, device: str, vram: int | None) -> int | None:
    """Bytes of expert records in the GPU tier, whole records; None on the CPU (no GPU tier)."""
    if torch.device(device).type == "cpu":
        if vram is not None:
            raise WasteError("--vram sizes the GPU's expert tier: it needs --device cuda (or auto with a GPU)")
        return None
    rec = plan.record_bytes or 1
    if vram is None:
        if not torch.cuda.is_available():
            raise WasteError("no CUDA GPU here to size the VRAM tier from: give --vram SIZE")
        free = torch.cuda.mem_get_info(torch.device(device))[0]
        vram = free - plan.trunk_bytes - plan.state_bytes - GPU_RESERVE
        if vram < plan.working_set_bytes:
            raise WasteError(f"the GPU has {fmt_bytes(free)} free: not enough for the trunk "
                             f"({fmt_bytes(plan.trunk_bytes)}), the state and one working set of experts "
                             f"({fmt_bytes(plan.working_set_bytes)}); use --device cpu, or a smaller --context")
    if vram < rec:
        raise WasteError(f"--vram {vram} bytes is smaller than one expert record ({rec} bytes): raise --vram")
    return min(vram, plan.budget_bytes) // rec * rec


def vram_plan(plan, device: str, vram: int | None) -> dict:
    """The two-tier plan `waste plan --device cuda --json` adds to the memory plan."""
    v = vram_budget(plan, device, vram)
    if v is None:
        return {"device": "cpu"}
    return {"device": torch.device(device).type, "vram_budget_bytes": v, "host_budget_bytes": plan.budget_bytes,
            "bank_bytes": plan.bank_bytes, "vram_working_sets": v / plan.working_set_bytes if plan.working_set_bytes
            else 0.0, "tiers": "mirror" if v >= plan.budget_bytes else "vram over pinned host"}


def vram_lines(vp: dict) -> list[str]:
    if vp["device"] == "cpu":
        return []
    return [f"{'VRAM budget':<16}{fmt_bytes(vp['vram_budget_bytes'])} = {vp['vram_working_sets']:.2f} working sets "
            f"({vp['tiers']}; the host budget above is the pinned tier below it)"]


class Tier:
    """The compute tier below the host slab (`--vram` under the host budget): tier slot <-> host slot maps, least
    recently used eviction, and the copies up.

    On a GPU the copies run on a stream of their own from the pinned host slab: a layer's missed records go up in
    as few cudaMemcpyAsync as their slots allow (runs of consecutive host slots into consecutive tier slots), and
    the compute stream waits on the copies' event, not the host. `prefetch` copies the next MoE layer's predicted
    records while this layer's experts compute (never into a slot this layer's kernels read). Which tier slot holds a
    record never changes what is computed for it, so outputs are the same bits whatever the tier's size."""

    def __init__(self, host: torch.Tensor, n_host: int, dev: torch.Tensor, n_dev: int, record_bytes: int):
        self.rows, self.dev = host.view(n_host, record_bytes), dev.view(n_dev, record_bytes)
        self.n_dev, self.record_bytes = n_dev, record_bytes
        self.dev_of = np.full(n_host, -1, dtype=np.int64)     # host slot -> tier slot, -1: not up
        self.host_of = np.full(n_dev, -1, dtype=np.int64)     # tier slot -> host slot
        self.used = np.zeros(n_dev, dtype=np.int64)           # the call that last used it (LRU)
        self.calls = 0
        self.busy: set[int] = set()       # tier slots the current group's kernels read
        self.layer_busy: set[int] = set()  # ... and the whole layer call's (earlier groups' too)
        self.copies = self.prefetches = self.prefetch_used = self.copy_calls = 0
        self._fresh: set[int] = set()     # tier slots prefetched and not used yet
        cuda = dev.device.type == "cuda"
        self.stream = torch.cuda.Stream(dev.device) if cuda else None
        self.event = None                 # the last copies' event (compute waits on it; host slot reuse syncs it)
        self.spans: list | None = None    # (start, end, bytes) of each batch of copies, when timing()
        self.rewrite = None               # the GPU's own layout of records, applied to the tier slots copied up

    def timing(self, on: bool = True) -> None:
        self.spans = [] if on else None

    def link(self) -> tuple[int, float]:
        """(bytes, seconds) the copies of the timed batches took on the copy stream (CUDA events)."""
        if not self.spans:
            return 0, 0.0
        torch.cuda.synchronize()
        return sum(b for _, _, b in self.spans), sum(s.elapsed_time(e) for s, e, _ in self.spans) / 1e3

    def begin(self) -> None:
        """A layer call starts: the kernels of earlier calls are done (the host has read this layer's ids)."""
        self.calls += 1
        self.layer_busy = set()

    def stale(self, host_slots) -> None:
        """Host slots read anew from disk: their tier copies are stale."""
        for s in host_slots:
            d = self.dev_of[s]
            if d >= 0:
                self.host_of[d], self.dev_of[s] = -1, -1

    def sync(self) -> None:
        """Before a host slot is overwritten (a disk read): the copies reading it have finished."""
        ev = self.event
        if ev is not None:
            ev.synchronize()

    def _choose(self, n: int, held: set[int]) -> np.ndarray:
        """n tier slots, none in held: free or stale first, then the least recently used."""
        busy = np.zeros(self.n_dev, dtype=bool)
        busy[list(held)] = True
        cand = np.flatnonzero(~busy)
        key = np.where(self.host_of[cand] < 0, -1, self.used[cand])
        return np.sort(cand[np.argsort(key, kind="stable")[:n]])

    def _copy(self, host: np.ndarray, tier: np.ndarray, after_compute: bool) -> None:
        for s, d in zip(host.tolist(), tier.tolist()):
            old = self.host_of[d]
            if old >= 0:
                self.dev_of[old] = -1
            self.host_of[d], self.dev_of[s] = s, d
        # runs: consecutive host slots into consecutive tier slots are one copy
        cut = np.flatnonzero((np.diff(host) != 1) | (np.diff(tier) != 1)) + 1
        runs = [(int(h[0]), int(t[0]), len(h)) for h, t in zip(np.split(host, cut), np.split(tier, cut))]
        self.copy_calls += len(runs)
        if self.stream is None:
            for s, d, n in runs:
                self.dev[d:d + n].copy_(self.rows[s:s + n])
            if self.rewrite is not None:
                self.rewrite(self.dev, tier)
            return
        if after_compute:       # demand copies may refill a slot an earlier group of this call still reads
            self.stream.wait_stream(torch.cuda.current_stream(self.dev.device))
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True) if self.spans is not None else None
            if start is not None:
                start.record()
            for s, d, n in runs:
                self.dev[d:d + n].copy_(self.rows[s:s + n], non_blocking=True)
            if self.rewrite is not None:      # on the copy stream, after the copies: the event covers both
                self.rewrite(self.dev, tier)
            ev = torch.cuda.Event(enable_timing=start is not None)
            ev.record()
        self.event = ev
        if start is not None:
            self.spans.append((start, ev, len(host) * self.record_bytes))

    def up(self, slots: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host slots -> tier slots, copying up the records not there (-1 stays -1). The caller moves the result
        to the GPU, then calls join() before the kernels read the tier."""
        need = np.unique(np.concatenate([s.numpy().ravel() for s in slots]))
        need = need[need >= 0]
        have = self.dev_of[need]
        hit = have[have >= 0]
        self.used[hit] = self.calls
        self.busy = set(hit.tolist())
        used = self._fresh.intersection(hit.tolist())
        self.prefetch_used += len(used)
        self._fresh -= used
        miss = need[have < 0]
        if len(miss):
            if len(miss) > self.n_dev - len(self.busy):    # (the store makes groups of at most n_dev experts)
                raise RuntimeError(f"a group of {len(need)} experts for a tier of {self.n_dev} slots")
            chosen = self._choose(len(miss), self.busy)
            self._fresh -= set(chosen.tolist())
            self._copy(miss, chosen, after_compute=True)
            self.used[chosen] = self.calls
            self.busy.update(chosen.tolist())
            self.copies += len(miss)
        self.layer_busy |= self.busy
        lut = torch.from_numpy(self.dev_of)
        return [torch.where(s >= 0, lut[s.clamp_min(0)], s) for s in slots]

    def join(self) -> None:
        """The compute stream waits (on the GPU) for the copies issued so far."""
        if self.event is not None:
            torch.cuda.current_stream(self.dev.device).wait_event(self.event)

    def prefetch(self, host_slots: list[int]) -> None:
        """Copy these host slots' records up ahead of the layer that will likely need them, into slots this call's
        kernels do not read, overlapped with them. At most half the tier, so a wrong guess cannot flush it."""
        want = np.unique(np.asarray(host_slots, dtype=np.int64))
        want = want[self.dev_of[want] < 0][:max(0, min(self.n_dev // 2, self.n_dev - len(self.layer_busy)))]
        if not len(want):
            return
        chosen = self._choose(len(want), self.layer_busy)
        self._copy(want, chosen, after_compute=False)
        self.used[chosen] = self.calls
        self._fresh.update(chosen.tolist())
        self.prefetches += len(want)
