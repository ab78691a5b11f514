"""The expert cache: a budgeted slab of record-sized slots in front of the bank files.

- One preallocated, page-aligned slab; (layer, expert) -> slot. A record is read once, straight into its
  slot (bankio), and unpacked from there each time it is used.
- Eviction is LFRU (policy.py): frequency with aging plus recency; docs/LEARNED.md compares it with LRU.
- A MoE layer asks once for all the experts it needs (`resident`): the misses are read by a pool of threads
  (pread releases the GIL), and the layer gets back the slot of every (row, choice) pair. The store does not
  compute: layers/moe.py runs the experts straight from the slab's [slots, ...] views (`make_bank`).
- When the whole bank fits in the budget, a background fill walks the banks in file order and fills empty
  slots. It never evicts and never counts a hit or a miss; its bytes are counted apart.
- Which slot an expert sits in never changes what is computed for it, so outputs are bit-identical whatever the
  budget, the fill, or the order in which reads complete.
"""
from __future__ import annotations

import threading
import time
from functools import partial
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from ..container import Container
from ..errors import WasteError
from ..quant.formats import get_format
from .affinity import unpinned, usable_cpus
from .bankio import BankReader, DirectAio, aligned_buffer
from ..container.bank import _DTYPES
from ..layers.gpu import cuda_kernels
from ..layers.moe import MATRICES, Bank, layout_for
from .experts import ExpertStats, expert_act, matrix_parts, prepare_record
from .policy import LFRU, LFRU_HALF_LIFE
from .vram import Tier

PREFETCH_MIN_PRECISION = 0.5   # of the predicted experts, the share the layer then needs (recent average)
PRECISION_DECAY = 0.05         # weight of the newest prediction in that average (about the last 20 layer calls)
AIO_DEPTH = 2                  # Linux AIO demand reads in flight at once; the rest queued (bankio.DirectAio)


class ExpertCache:
    def __init__(self, container: Container, budget_bytes: int | None, dtype: torch.dtype, threads: int = 4,
                 preload: bool = True, verify: bool = True, direct: bool = True,
                 half_life: float | None = None, device: str = "cpu",
                 prefetch: bool = True, vram: int | None = None, owned: dict[int, list[int]] | None = None,
                 aio: bool = True):
        ex, cfg = container.manifest["experts"], container.config
        self.device = torch.device(device)
        self.banks = container.banks
        self.record_bytes = ex["record_bytes"]
        self.format = ex["format"]
        self.fmt = get_format(self.format)
        moe = cfg.get("moe") or {}
        # records are in the width experts read and write: a latent MoE's (K3), else hidden_size
        h, inter = moe.get("expert_hidden", cfg["hidden_size"]), moe.get("intermediate_size", 0)
        self.shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
        self.repack = self.fmt.needs_prepare()
        self.swiglu_limit = cfg.get("swiglu_limit")    # clamped SwiGLU (GLM-5.3): the experts' activation
        self.act = expert_act(moe)                     # SiTU-GLU (K3), else None: SwiGLU
        self.dtype, self.verify = dtype, verify
        # owned: layer -> the experts this store holds (expert parallel: this rank's share), else all of them
        self.owned = owned or {l: range(b.num_experts) for l, b in self.banks.items()}
        self.n_records = sum(len(self.owned.get(l, ())) for l in self.banks)
        bank_bytes = self.n_records * self.record_bytes
        budget = bank_bytes if budget_bytes is None else min(budget_bytes, bank_bytes)
        self.n_slots = budget // self.record_bytes if self.record_bytes else 0
        if self.banks and self.n_slots < 1:
            raise WasteError(f"expert budget {budget_bytes} bytes is smaller than one expert record "
                             f"({self.record_bytes} bytes): raise --budget")
        self.budget_bytes = self.n_slots * self.record_bytes
        self._mm, self.slab = aligned_buffer(self.n_slots * self.record_bytes)
        # the compute tier (`vram`: its bytes): on a GPU a slab in its memory that the kernels read. As large as the
        # host slab, it mirrors it slot for slot (a slot read from disk is copied up before a layer uses it);
        # smaller, it holds the most recently used of the host slab's records in slots of its own (`_tier`), the
        # host slab (pinned) the tier below it. A smaller tier on the CPU exercises the same logic (tests).
        self.n_dev = self.n_slots
        if vram is not None:
            self.n_dev = min(self.n_slots, vram // self.record_bytes if self.record_bytes else 0)
            if self.banks and self.n_dev < 1:
                raise WasteError(f"--vram {vram} bytes is smaller than one expert record ({self.record_bytes} bytes): "
                                 f"raise --vram")
        self.tiered = self.n_dev < self.n_slots
        self.vram_bytes = self.n_dev * self.record_bytes
        self.dev_slab = (torch.empty(self.vram_bytes, dtype=torch.uint8, device=self.device)
                         if self.device.type != "cpu" or self.tiered else None)
        # the host slab pinned (page-locked) for the GPU: its copies up run at the link's rate (55 GB/s on the H200
        # against 9.2 pageable, shared/reference/machine.md §E); False where the driver refused (speed only)
        self.pinned = self._pin() if self.device.type != "cpu" and self.n_slots else False
        # the tier's maps and copies (runtime/vram.py): its own copy stream, events, next-layer prefetch
        self.tier = Tier(self.slab, self.n_slots, self.dev_slab, self.n_dev, self.record_bytes) if self.tiered \
            else None
        self._dirty: set[int] = set()
        self._dev_map: torch.Tensor | None = None      # device_map()
        self._up_event = None      # the last mirror copies' event (_flush, _wait_up)
        self.slot_of: dict[tuple[int, int], int] = {}
        self.key_of: list[tuple[int, int] | None] = [None] * self.n_slots
        self._held = np.zeros(self.n_slots, dtype=bool)     # key_of[s] is not None, as a mask (_take_slots)
        self.free = list(range(self.n_slots - 1, -1, -1))
        if half_life is None:   # measured (docs/LEARNED.md §3): LFRU wins from 1.5 working sets up, LRU below
            ws_records = ((cfg.get("moe") or {}).get("top_k") or 1) * max(len(self.banks), 1)
            half_life = LFRU_HALF_LIFE if self.n_slots >= 1.5 * ws_records else 0.0
        self.half_life = half_life
        self.policy = LFRU(self.n_slots, half_life)
        self.step = 1.0 / max(len(self.banks), 1)     # one token = one call per MoE layer
        self.layout = next(iter(self.banks.values())).layout if self.banks else None
        # a GPU's own layout of the records (q4: rows, layers/q4_rows.py), rewritten in its slab as they land there
        self.dev_layout = layout_for(self.fmt, self.device, self.layout) \
            if self.device.type != "cpu" and cuda_kernels() else None
        if self.tier is not None:
            self.tier.rewrite = self.dev_layout
        self._parts_of_slot: dict[int, dict] = {}
        # expert -> slot (-1: not resident) per layer, as a tensor: a layer's slots are one index op
        # written through its numpy view (_slots): a torch element write dispatches an operator (~5 us), and a layer's
        # misses each take two before its reads start (docs/LEARNED.md §3l)
        self._slots = np.full((max(self.banks, default=-1) + 1, max((b.num_experts for b in self.banks.values()),
                                                                    default=0)), -1, dtype=np.int64)
        self.slot_map = torch.from_numpy(self._slots)
        self.layer_slots = list(self.slot_map)        # one view per layer: a layer's lookup is one index op
        self.readers = {l: BankReader(b, direct) for l, b in self.banks.items()}
        self.direct = all(r.direct for r in self.readers.values()) if self.readers else False
        # the process's CPUs: a reader started inside a decode step would inherit its pinned one (affinity.py)
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="waste-read",
                                       initializer=unpinned(usable_cpus()))
        # a layer call's demand reads queued through Linux AIO from the decoding thread (O_DIRECT banks only);
        # None: on the pool above, as before (no AIO here, or aio=False). The same bytes land either way.
        self.aio = DirectAio.open(AIO_DEPTH) if aio and self.direct and self.n_slots else None
        self.lock = threading.Lock()
        self.loading: dict[tuple[int, int], Future] = {}
        self.stats = ExpertStats()
        self._flight_lock, self._in_flight, self._busy_since = threading.Lock(), 0, 0.0
        self.fill_bytes = 0
        self.damage: BaseException | None = None
        self.prefetch = prefetch             # the model predicts the next MoE layer's experts and calls ahead()
        self._predicted: dict[int, set] = {}  # layer -> experts predicted for its next call (precision / recall)
        # the prediction's recent precision: below PREFETCH_MIN_PRECISION prefetch only predicts (to keep
        # measuring) and reads nothing, since most of what it read would be bandwidth taken from demand reads
        self.precision = 1.0
        self._stop = threading.Event()
        self.fill_thread = None
        self.fits = self.n_slots >= self.n_records
        # the whole bank fits: the fill reads it all anyway. tier_prefetch: also copy the predicted records up to a
        # VRAM tier (off: on the H200 it cost more than it saved at the 48% precision of a random model, LEARNED §10)
        self.tier_prefetch = False
        self.wants_prefetch = prefetch and not self.fits
        self._tier_next: list[int] | None = None     # host slots of the next layer's predicted experts (tier)
        if preload and self.fits and self.n_records:
            self.fill_thread = threading.Thread(target=self._fill, name="waste-fill", daemon=True)
            self.fill_thread.start()

    def _pin(self) -> bool:
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.slab.data_ptr(), self.slab.numel(), 0))
        except (RuntimeError, AttributeError):
            return False
        return True

    # -- slots -------------------------------------------------------------------------------------
    def slot_tensor(self, slot: int) -> torch.Tensor:
        return self.slab[slot * self.record_bytes:(slot + 1) * self.record_bytes]

    def _slot_parts(self, slot: int) -> dict:
        """The record's matrices as views over its slot: built once per slot (the slab never moves), not per call."""
        p = self._parts_of_slot.get(slot)
        if p is None:
            p = self._parts_of_slot[slot] = matrix_parts(self.layout.views(self.slot_tensor(slot)))
        return p

    def _take_slots(self, n: int, pinned: set[int], prefetch: bool = False) -> list[int]:
        """n slots for new records: free ones first, then the lowest-scoring unpinned residents."""
        out = [self.free.pop() for _ in range(min(n, len(self.free)))]
        if len(out) < n:
            held = self._held.copy()        # a mask, not a loop over every slot: this runs before a layer's reads start
            keep = list(pinned) + [self.slot_of[k] for k in self.loading if k in self.slot_of]   # and reading
            if keep:
                held[keep] = False
            cand = np.flatnonzero(held)
            need = n - len(out)
            if len(cand) < need:
                raise WasteError("the expert budget is too small for one layer's experts at once: raise --budget")
            for s in self.policy.victims(cand, need).tolist():
                self._unassign(self.key_of[s])
                if prefetch:
                    self.stats.prefetch_evictions += 1
                else:
                    self.stats.evictions += 1
                out.append(s)
        return out

    @property
    def tier_copies(self) -> int:
        """Records copied up to the VRAM tier on demand (prefetched ones apart: tier.prefetches)."""
        return self.tier.copies if self.tier is not None else 0

    def _read(self, key, slot) -> float:
        self._wait_up()
        self._busy(1)
        try:
            dt = self.readers[key[0]].read(key[1], self.slot_tensor(slot), self.verify)
        finally:
            self._busy(-1)
        self._prepared(slot)
        return dt

    def _busy(self, n: int) -> None:
        """n reads more (or fewer) in flight: the disk's busy time runs from the first in flight to the last landing
        (its checksum included)."""
        with self._flight_lock:
            if not self._in_flight:
                self._busy_since = time.perf_counter()
            self._in_flight += n
            if not self._in_flight:
                self.stats.disk_busy_seconds += time.perf_counter() - self._busy_since

    def _prepared(self, slot: int) -> None:
        """A checked record into the form its kernels read. After the checksum: this rewrites the slot's bytes."""
        if self.repack and self.device.type == "cpu":   # this torch's CPU kernel wants another layout (q4 off AVX-512)
            prepare_record(self._slot_parts(slot), self.fmt, self.shapes)
        if self.dev_slab is not None:
            with self.lock:
                self._dirty.add(slot)

    def _queue_direct(self, layer: int, misses: list[int], slots: list[int]) -> dict[int, Future]:
        """Queue a layer call's reads through Linux AIO from this thread; returns those the kernel took (the
        pool reads the rest). Each lands on the reaper thread (_landed_direct)."""
        if self.aio is None or not misses:      # (a store with nothing to read has no readers: GeneratedExperts)
            return {}
        reader = self.readers[layer]
        if not reader.direct:
            return {}
        self._wait_up()
        futs, reads, t0 = {}, [], time.perf_counter()
        for e, s in zip(misses, slots):
            futs[e] = Future()
            reads.append((*reader.request(e, self.slot_tensor(s)), partial(self._landed_direct, (layer, e), s,
                                                                            futs[e], t0)))
        self._busy(len(reads))
        n = self.aio.submit(reads)
        if n < len(reads):
            self._busy(n - len(reads))
        return dict(list(futs.items())[:n])

    def _landed_direct(self, key, slot: int, fut: Future, t0: float, res: int) -> None:
        """On the reaper: check the record (length, CRC-32) before anything rewrites it, repack it, then land it."""
        try:
            try:
                if res >= 0:
                    dt = time.perf_counter() - t0
                    self.readers[key[0]].landed(key[1], memoryview(self.slot_tensor(slot).numpy()), res, self.verify)
                else:     # refused at read time or an I/O error: the reader's own pread (its fallback and its error)
                    dt = self.readers[key[0]].read(key[1], self.slot_tensor(slot), self.verify)
            finally:
                self._busy(-1)
            self._prepared(slot)
        except BaseException as exc:
            fut.set_exception(exc)
            return
        fut.set_result((dt, True))

    def _flush(self) -> None:
        """Copy the slots read since the last layer up to the device's mirror."""
        with self.lock:
            dirty, self._dirty = self._dirty, set()
        if dirty and self.tiered:        # a host slot read anew: its tier copy (if any) is stale
            self.tier.stale(dirty)
        elif dirty:
            # from the pinned slab the copies are queued without a host wait (the kernels after them on the same
            # stream read them in order); a slot read anew first waits for its last copy (_wait_up)
            rows, dev = self.slab.view(self.n_slots, self.record_bytes), self.dev_slab.view(self.n_slots, -1)
            for s in sorted(dirty):
                dev[s].copy_(rows[s], non_blocking=self.pinned)
            if self.dev_layout is not None:
                self.dev_layout(dev, sorted(dirty))
            if self.pinned:
                ev = torch.cuda.Event()
                ev.record()
                self._up_event = ev

    def _wait_up(self) -> None:
        """Before a host slot is overwritten (a disk read): the copies up reading it have finished."""
        if self.tier is not None:      # the slot's old record may still be on its way up
            self.tier.sync()
        ev = self._up_event
        if ev is not None:
            ev.synchronize()

    # -- background fill ---------------------------------------------------------------------------
    def _fill(self) -> None:
        for layer in sorted(self.banks):
            for e in self.owned.get(layer, ()):
                if self._stop.is_set():
                    return
                key = (layer, e)
                with self.lock:
                    if key in self.slot_of or key in self.loading or not self.free:
                        continue
                    slot = self.free.pop()
                    self._assign(key, slot)
                    fut = Future()
                    self.loading[key] = fut
                try:
                    self._read(key, slot)
                    fut.set_result(0.0)
                except BaseException as exc:   # a damaged record stops the model at its next layer call
                    fut.set_exception(exc)
                    with self.lock:
                        self.damage = exc
                        self._forget(key)
                    return
                with self.lock:
                    self.loading.pop(key, None)
                    self.fill_bytes += self.record_bytes

    # -- the store interface -----------------------------------------------------------------------
    def make_bank(self, device: torch.device | str = "cpu") -> Bank:
        """The slab as [slots, ...] views per matrix part (layers/moe.py's Bank): what the grouped kernels read;
        on a GPU, views of its mirror."""
        if torch.device(device).type != self.device.type:
            raise ValueError(f"the expert store holds its slab for {self.device}, not {device}")
        kind = self.fmt.kind or self.fmt.name
        if self.device.type != "cpu" and not (kind in ("float", "q8") or (kind in ("q4", "mxfp4") and cuda_kernels())):
            raise WasteError(f"--device {self.device.type}: experts stored as {self.format} have no GPU kernel "
                             f"(bf16, f16, f32 and q8 do; q4 and mxfp4 with triton installed): convert with "
                             f"--experts bf16 or q8, install triton, or use --device cpu")
        slab, n = (self.slab, self.n_slots) if self.dev_slab is None else (self.dev_slab, self.n_dev)
        rows = slab.view(max(n, 1), self.record_bytes) if n else None
        parts: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MATRICES}
        offsets = {}
        if rows is not None and self.layout is not None:
            for p in self.layout.parts:
                m, _, suffix = p.name.partition(".")
                t = rows[:, p.offset:p.offset + p.nbytes].view(_DTYPES[p.dtype]).view(n, *p.shape)
                parts[m][suffix] = t
                offsets[p.name] = (p.offset, p.nbytes, p.dtype)
        gate_up = None
        g, u = offsets.get("gate"), offsets.get("up")
        if g and u and g[2] == u[2] and u[0] == g[0] + g[1] and self.fmt.kind == "float":
            inter, h = self.shapes["gate"]
            gate_up = rows[:, g[0]:g[0] + 2 * g[1]].view(_DTYPES[g[2]]).view(n, 2 * inter, h)
        return Bank(parts, self.shapes, self.fmt, self.swiglu_limit, gate_up, self.act)

    def resident(self, layer: int, idxs: list[torch.Tensor], ahead: tuple[int, list[int]] | None = None):
        """Make the experts that idxs (one [T, k] tensor of expert ids per sequence) route to resident, and yield
        (slots per sequence, complete) groups as they land: the slot of every pair, -1 where this group does not
        hold it. The experts already resident come first, then each batch of reads as it completes, so the caller
        computes while the rest are read; every pair is in exactly one group. complete: this one group holds
        every pair. ahead: (next layer, its predicted experts) to prefetch once this layer's reads are queued. A layer that needs more experts than the budget has slots (a long prefill on a tiny budget)
        is made resident in rounds of at most n_slots experts, each streamed the same way."""
        if self.damage is not None:
            raise self.damage
        dev_map = self.device_map()
        if dev_map is not None and len(idxs) == 1 and idxs[0].shape[0] == 1 and idxs[0].device.type != "cpu":
            # every record is in the GPU's slab and none is ever evicted: the slots are looked up on the GPU, no
            # host sync (one row's top-k ids are distinct: k hits)
            self.count_hits(layer, idxs[0].numel())
            yield [dev_map[layer][idxs[0]]], True
            self.policy.advance(self.step)
            return
        # the union on the host, through numpy: the ids are needed there anyway (which records to read)
        on_host = [i if i.device.type == "cpu" else i.cpu() for i in idxs]
        if sum(i.numel() for i in on_host) <= 256:      # decode: tolist dispatches no torch operator (numpy(): 3)
            union = sorted({e for i in on_host for e in (i.tolist() if i.dim() == 1 else sum(i.tolist(), []))})
        else:
            union = np.unique(np.concatenate([i.numpy().ravel() for i in on_host])).tolist()
        if self.fits and not self.loading and not self.tiered and self.dev_slab is None and \
                len(self.slot_of) == self.n_records and self.n_records and ahead is None:
            # the whole bank is in the slab and nothing is ever evicted: no slots to take, no reads, no policy
            # to feed (a CPU decode row's residency call was ~10% of the bundled model's step)
            st = self.stats
            st.hits += len(union)
            st.per_layer.setdefault(layer, [0, 0])[0] += len(union)
            m = self.layer_slots[layer]
            yield [m[i] for i in on_host], True
            self.policy.advance(self.step)
            return
        pred = self._predicted.pop(layer, None)
        if pred is not None:
            st = self.stats
            st.predicted += len(pred)
            st.predicted_right += len(pred.intersection(union))
            st.predicted_needed += len(union)
            if pred:
                self.precision += PRECISION_DECAY * (len(pred.intersection(union)) / len(pred) - self.precision)
        per = max(min(self.n_slots, self.n_dev), 1)
        if self.tier is not None:
            self.tier.begin()
        row, ids = self._slots[layer], None
        for g in range(0, len(union), per):
            group = union[g:g + per]
            waits = self._make_resident(layer, group)
            if ahead is not None:   # after this layer's reads are queued: the pool reads in submission order
                self._ahead(*ahead, {(layer, e) for e in group})
                ahead = None
            # the slots looked up through numpy, after the reads are queued: torch's indexing dispatches operators
            # (~5-10 us each), and a decode layer's last group is on the step's critical path (docs/LEARNED.md §3n)
            ids = ids or [i.numpy() for i in on_host]
            if not waits and len(group) == len(union):
                if self.dev_slab is not None:
                    self._flush()
                yield self._up([torch.from_numpy(row[a]) for a in ids]), True
                continue
            for landed in self._landing(layer, group, waits):
                if self.dev_slab is not None:
                    self._flush()
                lut = np.full(row.shape, -1, np.int64)
                lut[landed] = row[landed]
                yield self._up([torch.from_numpy(lut[a]) for a in ids]), False
        if self._tier_next is not None:   # the layer's kernels are queued: the next layer's guesses go up beside them
            self.tier.prefetch(self._tier_next)
            self._tier_next = None
        self.policy.advance(self.step)

    def device_map(self) -> torch.Tensor | None:
        """On a GPU, once the whole bank sits in the slab (the background fill done): the expert -> slot table in
        GPU memory (fixed from then on: nothing is evicted when the bank fits), else None."""
        if self._dev_map is None and self.dev_slab is not None and self.fits and not self.tiered and \
                self.n_records and len(self.slot_of) == self.n_records and not self.loading:
            self._flush()
            self._dev_map = self.slot_map.to(self.device)
        return self._dev_map

    def count_hits(self, layer: int, n: int) -> None:
        """n experts of this layer used from the slab (the GPU paths that never look at the ids on the host)."""
        self.stats.hits += n
        pl = self.stats.per_layer.setdefault(layer, [0, 0])
        pl[0] += n

    def _up(self, slots: list[torch.Tensor]) -> list[torch.Tensor]:
        """The slots the kernels read: the compute tier's (copied up where missing), on the model's device."""
        if self.tier is None:
            return self._to_device(slots)
        out = self._to_device(self.tier.up(slots))
        self.tier.join()
        return out

    def _to_device(self, slots: list[torch.Tensor]) -> list[torch.Tensor]:
        # without a host wait: a blocking copy waits for every launch queued before it (~a sync a group); from
        # pageable memory the driver stages the few bytes before returning, so the arrays may go at once
        return slots if self.device.type == "cpu" else [s.to(self.device, non_blocking=True) for s in slots]

    def _make_resident(self, layer: int, experts: list[int]) -> dict[int, Future]:
        """Assign slots to the misses and start their reads; returns the reads (and fill reads) still to land."""
        waits: dict[int, Future] = {}
        with self.lock:
            pinned = {self.slot_of[(layer, e)] for e in experts if (layer, e) in self.slot_of}
            misses = [e for e in experts if (layer, e) not in self.slot_of]
            slots = self._take_slots(len(misses), pinned)
            for e, s in zip(misses, slots):
                self._assign((layer, e), s)
                self.policy.reset(s)
            waits.update(self._queue_direct(layer, misses, slots))
            for e, s in zip(misses, slots):
                key = (layer, e)
                if e not in waits:
                    waits[e] = self.pool.submit(self._timed_read, key, s)
                self.loading[key] = waits[e]
            for e in experts:
                key = (layer, e)
                if e not in waits and key in self.loading:     # the background fill is reading it right now
                    waits[e] = self.loading[key]
                self.policy.touch(self.slot_of[key])
            n_hit, n_miss = len(experts) - len(misses), len(misses)
            self.stats.hits += n_hit
            self.stats.misses += n_miss
            pl = self.stats.per_layer.setdefault(layer, [0, 0])
            pl[0] += n_hit
            pl[1] += n_miss
        return waits

    def _ahead(self, layer: int, experts: list[int], in_use: set) -> None:
        """Prefetch: start reading a later layer's predicted experts into free slots or the lowest-scoring
        residents, never one the current call holds or is reading, and only while enough evictable slots stay
        for that layer to fetch all of its experts itself if the prediction is wrong."""
        self._predicted[layer] = set(experts)
        if layer not in self.banks or self.precision < PREFETCH_MIN_PRECISION:
            return
        if self.tier is not None and self.tier_prefetch:   # the host-resident ones go up the link after this layer's kernels are queued
            with self.lock:
                self._tier_next = [self.slot_of[(layer, e)] for e in experts
                                   if (layer, e) in self.slot_of and (layer, e) not in self.loading]
        with self.lock:
            todo = [e for e in experts if (layer, e) not in self.slot_of]
            if not todo:
                return
            pinned = {self.slot_of[k] for k in in_use if k in self.slot_of}
            pinned |= {self.slot_of[k] for k in self.loading if k in self.slot_of}
            todo = todo[:max(0, self.n_slots - len(pinned) - len(experts))]   # every unpinned slot is evictable
            if not todo:
                return
            for e, s in zip(todo, self._take_slots(len(todo), pinned, prefetch=True)):
                key = (layer, e)
                self._assign(key, s)
                self.policy.reset(s)
                self.loading[key] = self.pool.submit(self._prefetch_read, key, s)

    def _prefetch_read(self, key, slot) -> tuple[float, bool]:
        try:
            dt = self._read(key, slot)
        except BaseException:
            with self.lock:      # a damaged record: forgotten here, so the layer that needs it reads it again
                if self.slot_of.get(key) == slot:
                    self._forget(key)
            raise
        with self.lock:
            self.loading.pop(key, None)
            self.stats.prefetch_reads += 1
            self.stats.prefetch_bytes += self.record_bytes
        return dt, False

    def _timed_read(self, key, slot) -> tuple[float, bool]:
        return self._read(key, slot), True     # (seconds, a read of ours: counted when it lands)

    def _landing(self, layer: int, experts: list[int], waits: dict[int, Future]):
        """Yield the experts of `experts` in groups as they become resident: those already resident at once,
        then every batch of reads that has completed at each wait. Ascending ids within a group."""
        now = [e for e in experts if e not in waits]
        if now:
            yield now
        pending = dict(waits)
        while pending:
            t0 = time.perf_counter()
            done, _ = wait(list(pending.values()), return_when=FIRST_COMPLETED)
            self.stats.wait_seconds += time.perf_counter() - t0
            landed = sorted(e for e, f in pending.items() if f in done)
            for e in landed:
                f = pending.pop(e)
                try:
                    r = f.result()
                except BaseException:
                    with self.lock:
                        self._forget((layer, e))
                    raise
                if isinstance(r, tuple) and r[1]:   # our read (fill and prefetch reads are counted apart)
                    with self.lock:
                        self.loading.pop((layer, e), None)
                        self.stats.bytes_read += self.record_bytes
                        self.stats.read_seconds += r[0]
            yield landed

    def _forget(self, key) -> None:
        self.loading.pop(key, None)
        s = self.slot_of.get(key)
        if s is not None:
            self._unassign(key)
            self.free.append(s)

    def _assign(self, key, slot: int) -> None:
        self.slot_of[key], self.key_of[slot] = slot, key
        self._held[slot] = True
        self._slots[key[0], key[1]] = slot

    def _unassign(self, key) -> None:
        slot = self.slot_of.pop(key)
        self.key_of[slot] = None
        self._held[slot] = False
        self._slots[key[0], key[1]] = -1

    # -- lifecycle ---------------------------------------------------------------------------------
    def resident_count(self) -> int:
        return len(self.slot_of) - len(self.loading)

    def wait_fill(self) -> None:
        if self.fill_thread:
            self.fill_thread.join()

    def close(self) -> None:
        self._stop.set()
        if self.fill_thread:
            self.fill_thread.join()
        self.pool.shutdown(wait=True)
        if self.aio is not None:
            self.aio.close()
        for r in self.readers.values():
            r.close()
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.slab.data_ptr())
            self.pinned = False
