"""Expert parallelism over torch.distributed: N processes (ranks), launched by torchrun, each holding the whole trunk
and a share of every MoE layer's routed experts in its own budgeted ExpertCache. Gloo between CPU processes, NCCL
between GPUs.

Rank 0 drives (the CLI verb, the server); the other ranks answer its MoE layers (`follow`). Per MoE layer the
ranks make one small exchange of sizes, one all-to-all of the routed rows (each row goes to every rank that owns
one of its experts, with its expert ids) and one all-to-all back of each (row, expert) pair's output. The caller
takes the weighted sum over its k pairs itself, as one process does, and each owner computes a pair with the very
kernel call one process makes for it (a sequence's rows apart from other sequences', a prefill row through the
per-expert matmul even where it arrives alone), so the logits are bit-identical to one process's.

Every collective inside a round runs under a watch (`Watch`): one that has not returned after `timeout` seconds (a rank
stuck or far too slow) ends the process with one line naming the rank, the MoE layer and the step; torchrun then
ends the others. A follower's wait for the driver's next round is not watched (a server idles there between
requests), which is why the process group's own timeout is long.

Placement: experts in contiguous blocks of ids (`id`), or from a routing trace (`trace:FILE`, runtime/trace.py):
per MoE layer the experts by measured frequency, hottest first, each to the least-loaded rank that still has room,
so every rank holds the same number of experts and about the same share of the routed pairs.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

import torch

from ..errors import WasteError
from ..layers.moe import expert_pairs, kernel_for, prefill_pairs, weighted_sum
from . import trace as traces

IDLE, STOP, STATS = -1, -2, -3      # header tags besides a layer index
TIMEOUT = 300.0                     # seconds a watched collective may take (WASTE_EP_TIMEOUT overrides)
GROUP_TIMEOUT = timedelta(days=365)  # the process group's own: a follower idles in a collective between requests
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


# -- placement ---------------------------------------------------------------------------------------------------
def check_placement(spec: str) -> None:
    if spec != "id" and not spec.startswith("trace:"):
        raise WasteError(f"--placement {spec!r}: use id (experts in blocks of ids) or trace:FILE (a routing trace "
                         "recorded by `waste bench --record-trace FILE`)")
    if spec.startswith("trace:"):
        traces.load(spec[len("trace:"):])


def place(layers: dict[int, int], world: int, spec: str = "id", top_k: int | None = None,
          weights: list[float] | None = None) -> dict[int, list[int]]:
    """layer -> the rank of each of its experts. layers: MoE layer -> number of experts, in layer order. weights:
    each rank's share of every layer's experts (None: even; `weights_for` makes them from what each rank holds)."""
    if world < 1:
        raise WasteError(f"--expert-parallel {world}: give 1 or more processes")
    small = min(layers.values(), default=world)
    if small < world:
        raise WasteError(f"--expert-parallel {world}: the model has only {small} experts per layer; use at most "
                         f"{small} processes")
    if spec == "id" and weights is None:
        return {l: [e * world // n for e in range(n)] for l, n in layers.items()}
    if spec == "id":
        return {l: [r for r, c in enumerate(counts(n, world, weights)) for _ in range(c)] for l, n in layers.items()}
    count, total = frequencies(layers, traces.load(spec[len("trace:"):]), top_k), [0] * world
    return {l: balance(count[l], world, total, counts(len(count[l]), world, weights)) for l in layers}


def counts(n: int, world: int, weights: list[float] | None = None) -> list[int]:
    """How many of a layer's n experts each rank holds: n // world or one more (the first ranks), or in proportion
    to weights (largest remainders first, ties to the lower rank)."""
    if weights is None:
        return [n // world + (r < n % world) for r in range(world)]
    total = sum(weights)
    exact = [n * w / total for w in weights]
    out = [int(x) for x in exact]
    for r in sorted(range(world), key=lambda r: (out[r] - exact[r], r))[:n - sum(out)]:
        out[r] += 1
    return out


def weights_for(capacity: list[int], bank: int, margin: int = 0) -> list[float] | None:
    """Each rank's share of the experts from the bytes of expert records it can hold (its memory plan's room beside
    its floor: rank 0 holds the trunk, the others do not): None (even shares, by id or trace) where every rank holds
    an even share, else in proportion to what each holds less `margin` (a record per MoE layer: what rounding a
    layer's share up can add)."""
    world = len(capacity)
    room = [max(c - margin, 0) for c in capacity]
    if min(capacity) * world >= bank + world * margin or sum(room) <= 0:
        return None
    return [c / sum(room) for c in room]


def frequencies(layers: dict[int, int], trace: dict, top_k: int | None) -> dict[int, list[int]]:
    """Per MoE layer, how many routed pairs of the trace each expert took: MoE layer m reads the trace's column
    m mod its columns, ids scaled to the layer's expert count (as `waste bench --routing trace:` replays it)."""
    cols = len(trace["tokens"][0])
    out = {}
    for m, (l, n) in enumerate(layers.items()):
        count = [0] * n
        k = top_k or trace["top_k"]
        for tok in trace["tokens"]:
            for e in traces.scale_ids(tok[m % cols], trace["num_experts"], n, min(k, n)):
                count[e] += 1
        out[l] = count
    return out


def balance(count: list[int], world: int, total: list[int], room: list[int] | None = None) -> list[int]:
    """One layer's experts' ranks: hottest first (ties by id) to the least-loaded rank with room, ties to the rank
    with the least load over the layers placed so far (`total`, updated), then the lowest; every rank gets
    n // world experts or one more (or room[r] of them)."""
    n = len(count)
    room = list(room) if room is not None else counts(n, world)
    load, owner = [0] * world, [0] * n
    for e in sorted(range(n), key=lambda e: (-count[e], e)):
        r = min((r for r in range(world) if room[r]), key=lambda r: (load[r], total[r], r))
        owner[e], room[r], load[r] = r, room[r] - 1, load[r] + count[e]
    for r in range(world):
        total[r] += load[r]
    return owner


def shares(owner: dict[int, list[int]], count: dict[int, list[int]], world: int) -> tuple[list[float], float]:
    """Each rank's share of the routed pairs over all layers, and the busiest rank's share per layer (the one a
    layer's exchange waits for), averaged over layers, times world: 1.0 is an even split."""
    load, peak = [0] * world, 0.0
    for l, o in owner.items():
        here = [0] * world
        for e, r in enumerate(o):
            here[r] += count[l][e]
        load = [a + b for a, b in zip(load, here)]
        peak += max(here) / (sum(here) or 1) * world / len(owner)
    total = sum(load) or 1
    return [x / total for x in load], peak


def moe_layers(container) -> dict[int, int]:
    return {int(l): v["num_experts"] for l, v in sorted(container.manifest["experts"]["layers"].items(),
                                                        key=lambda kv: int(kv[0]))}


# -- the process group -------------------------------------------------------------------------------------------
class ExpertParallel:
    """This process's place in an expert-parallel group: `start` joins it (under torchrun)."""

    def __init__(self, world: int, rank: int, local_world: int, placement: str, device: str,
                 timeout: float = TIMEOUT, report=None):
        self.world, self.rank, self.local_world, self.placement = world, rank, local_world, placement
        self.device = device
        self.owner: dict[int, list[int]] | None = None
        self.experts: ParallelExperts | None = None     # once loaded
        self.agreed = False                              # the ranks have agreed that every one loaded
        self.weights: list[float] | None = None          # each rank's share of the experts, fixed (else from rooms)
        self.watch = Watch(rank, timeout, report)

    @classmethod
    def start(cls, env, n: int, placement: str = "id", device: str = "cpu", report=None) -> "ExpertParallel":
        """env: the environment torchrun set (WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT);
        WASTE_EP_TIMEOUT there: the seconds a collective may take before the process stops (default 300). report:
        called with the one line that says why, just before a stuck process stops (default: logged)."""
        import torch.distributed as dist

        world = int(env.get("WORLD_SIZE", "0") or 0)
        if world != n or "RANK" not in env:
            raise WasteError(f"--expert-parallel {n} runs as {n} processes started by torchrun: "
                             f"torchrun --nproc-per-node {n} -m waste VERB ... --expert-parallel {n}"
                             + (f" (this is {world} process(es))" if world else ""))
        check_placement(placement)
        timeout = env.get("WASTE_EP_TIMEOUT", str(TIMEOUT))
        try:
            timeout = float(timeout)
            assert timeout > 0
        except (ValueError, AssertionError):
            raise WasteError(f"WASTE_EP_TIMEOUT={timeout!r}: give the seconds a collective may take (more than 0)") \
                from None
        rank, local = int(env["RANK"]), int(env.get("LOCAL_WORLD_SIZE", n))
        cuda = device.startswith("cuda") or device == "auto" and torch.cuda.is_available()
        kw = {}
        if cuda:
            # a GPU each, chosen before NCCL or any CUDA tensor sees the process: two ranks on one GPU hang NCCL
            lr, gpus = int(env.get("LOCAL_RANK", 0)), torch.cuda.device_count()
            if lr >= gpus:
                raise WasteError(f"--expert-parallel on GPUs takes one GPU a process: local rank {lr} of "
                                 f"{local} but this machine shows {gpus} GPU(s); " +
                                 (f"use --nproc-per-node {gpus} or fewer" if gpus else "use --device cpu"))
            device = f"cuda:{lr}"
            torch.cuda.set_device(device)
            kw["device_id"] = torch.device(device)     # NCCL's communicator made here, not on the first exchange
        ep = cls(n, rank, local, placement, device, timeout, report)
        if not dist.is_initialized():
            with ep.watch("joining the process group (the other processes did not arrive)"):
                dist.init_process_group("nccl" if cuda else "gloo", timeout=GROUP_TIMEOUT, **kw)
        return ep

    @property
    def experts_only(self) -> bool:
        """This rank holds experts and no trunk: it only ever answers rank 0's MoE layers."""
        return self.rank != 0

    def owned(self, container, capacity: int | None = None) -> dict[int, list[int]]:
        """layer -> this rank's experts (ascending); fixes the placement for the container. capacity: the bytes of
        expert records this rank can hold; given, the ranks exchange theirs and a rank that cannot hold an even
        share (rank 0, beside the trunk) gets fewer experts (`weights_for`)."""
        moe = container.config.get("moe") or {}
        layers, weights = moe_layers(container), self.weights
        if weights is None and capacity is not None and self.world > 1:
            import torch.distributed as dist

            caps = [None] * self.world
            with self.watch("the exchange of each process's room for experts"):
                dist.all_gather_object(caps, int(capacity))
            rec = container.manifest["experts"]["record_bytes"]
            weights = weights_for(caps, sum(layers.values()) * rec, len(layers) * rec)
        self.owner = place(layers, self.world, self.placement, moe.get("top_k"), weights)
        return {l: [e for e, r in enumerate(o) if r == self.rank] for l, o in self.owner.items()}

    def store(self, local) -> "ParallelExperts":
        self.experts = ParallelExperts(local, self)
        return self.experts

    def load(self, load):
        """load() (Engine.load with this group) on every rank, then agree: a rank that failed must not leave the others
        waiting in their first exchange."""
        self.agreed = True
        try:
            eng = load()
        except BaseException:
            self.agree(False)
            raise
        if not self.agree(True):
            eng.close()
            self.experts = None
            raise WasteError("another process of --expert-parallel failed to load the model (its error is above)")
        return eng

    def agree(self, ok: bool) -> bool:
        """Every rank's ok, and-ed (after loading: a rank that failed must not leave the others waiting)."""
        import torch.distributed as dist

        # not watched: the other ranks wait here while rank 0 loads the trunk (minutes for a large one), and a rank
        # that fails to load still comes here with its False
        t = torch.tensor([1 if ok else 0], device=self._comm())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _comm(self) -> torch.device:
        return torch.device(self.device if str(self.device).startswith("cuda") else "cpu")

    def close(self) -> None:
        """Rank 0: release the other ranks (from their wait for the load's verdict, or from `follow`); then leave."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        try:
            if self.rank == 0 and not self.agreed:
                self.agreed = True
                self.agree(False)
            elif self.rank == 0 and self.experts is not None:
                self.experts.stop()
        finally:
            dist.destroy_process_group()


class Watch:
    """`with watch("what"):` a step that must not take more than `seconds`; past that, this process reports one line
    naming its rank and the step (`report`, default logged) and exits (a thread checks: a blocked collective cannot
    be interrupted)."""

    def __init__(self, rank: int, seconds: float, report=None):
        self.rank, self.seconds = rank, seconds
        self.report = report or logging.getLogger("waste").critical
        self.step: tuple[float, str] | None = None          # (deadline, what) while a step is watched
        self.thread = None

    def __call__(self, what: str) -> "Watch":
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True, name="waste-ep-watch")
            self.thread.start()
        self.step = (time.monotonic() + self.seconds, what)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.step = None

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            step = self.step
            if step is not None and time.monotonic() > step[0]:
                self.report(f"expert parallel: rank {self.rank} waited {self.seconds:.0f} s in {step[1]}: another "
                            "process is stuck or slower than that (WASTE_EP_TIMEOUT=SECONDS raises the limit); "
                            "stopping")
                logging.shutdown()
                os._exit(1)


class ParallelExperts:
    """The model's expert store under expert parallelism: this rank's ExpertCache (its experts, its budget) plus
    the exchange that has every routed pair computed by its expert's owner. Everything else (stats, close, ...)
    is the local cache's."""
    wants_prefetch = False          # next-layer prefetch predicts for one store; not across ranks (yet)
    device_map = None               # no CUDA graphs: every MoE layer is an exchange with the other ranks

    def __init__(self, local, group: ExpertParallel):
        self.local, self.group = local, group
        self.owner = {l: torch.tensor(o) for l, o in group.owner.items()}
        self.bank = self.kernel = None
        # rounds, their time, the part spent in the collectives (waiting for the slowest rank included), bytes sent
        self.calls, self.exchange_seconds, self.comm_seconds, self.bytes_sent = 0, 0.0, 0.0, 0
        self.stopped = False

    def __getattr__(self, name):
        return getattr(self.local, name)

    def make_bank(self, device):
        self.bank = self.local.make_bank(device)
        self.kernel = kernel_for(self.bank.fmt, device)
        return self.bank

    # -- the driver's side: DecoderModel.mlp_many calls this for a MoE layer --------------------------------
    def exchange(self, layer: int, xs: list[torch.Tensor], routed: list) -> list[torch.Tensor]:
        """The routed experts' weighted sum for each sequence's rows xs (routed: its (weights, ids))."""
        ids = [i if i.device.type == "cpu" else i.cpu() for _, i in routed]
        pairs = self._round(layer, xs, ids)
        return [weighted_sum(p, w) for p, (w, _) in zip(pairs, routed)]

    # -- the other ranks' side ---------------------------------------------------------------------------
    def follow(self) -> None:
        """Answer the driver's MoE layers until it stops."""
        while self._round(None, [], []) is not None:
            pass

    def rank_stats(self) -> list[dict]:
        """Every rank's cache counters and exchange figures (rank 0 asks; the others answer from `follow`)."""
        self._sizes(torch.tensor([[STATS, 0]] * self.group.world, dtype=torch.long), "the counters' exchange")
        return self._gather()

    def _gather(self) -> list[dict]:
        import dataclasses

        import torch.distributed as dist

        mine = {"rank": self.group.rank, **dataclasses.asdict(self.local.stats.snapshot()), **self.report()}
        mine.pop("per_layer", None)
        out = [None] * self.group.world
        with self.group.watch("the counters' exchange"):
            dist.all_gather_object(out, mine)
        return out

    def stop(self) -> None:
        """The driver is done: the other ranks leave `follow`."""
        if not self.stopped and self.group.world > 1:
            self.stopped = True
            self._sizes(torch.tensor([[STOP, 0]] * self.group.world, dtype=torch.long), "the stop message")

    # -- one round ---------------------------------------------------------------------------------------
    def _sizes(self, header: torch.Tensor, what: str | None) -> torch.Tensor:
        """Every rank's [tag, bytes] for each rank; as CUDA tensors under NCCL (its collectives take no host
        tensors), so the .cpu() that follows is the wait for the other ranks."""
        import torch.distributed as dist

        dev = self.group._comm()
        out = torch.empty_like(header, device=dev)
        return self._collective(what, dist.all_to_all_single, out, header.to(dev))

    def _bytes(self, chunks: list[torch.Tensor], sizes_in: list[int], what: str) -> torch.Tensor:
        """One chunk to each rank, sizes_in bytes from each (zero-size ones included: every rank joins every
        exchange)."""
        import torch.distributed as dist

        dev = self.group._comm()
        send = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(sizes_in), dtype=torch.uint8, device=dev)
        got = self._collective(what, dist.all_to_all_single, out, send.to(dev), sizes_in, [c.numel() for c in chunks])
        self.bytes_sent += send.numel()
        return got

    def _collective(self, what: str | None, fn, out: torch.Tensor, *args) -> torch.Tensor:
        """fn(out, *args), then out on the host; watched unless what is None (a follower waiting for a round)."""
        t0 = time.perf_counter()
        watch = self.group.watch
        try:
            if what is not None:
                watch(what)
            fn(out, *args)
            out = out.cpu()
        except RuntimeError as exc:      # a rank that stopped (its own error is above) closes its connections
            raise WasteError(f"expert parallel: rank {self.group.rank}, {what or 'waiting for a round'}: another "
                             f"process stopped ({str(exc).splitlines()[0]})") from None
        finally:
            watch.step = None
        self.comm_seconds += time.perf_counter() - t0
        return out

    def _round(self, layer, xs, ids):
        """One MoE layer across the ranks: send each rank the rows routed to its experts, compute the pairs this
        rank owns of what it received, send them back, and assemble each sequence's [T, k, h] pairs. layer None:
        this rank has no rows of its own (a follower); returns None when the driver stopped."""
        world, t0 = self.group.world, time.perf_counter()
        owner = None if layer is None else self.owner[layer]
        out_chunks, masks = [], []
        host = [x if x.device.type == "cpu" else x.cpu() for x in xs]      # one copy down per sequence
        for d in range(world):
            meta = [len(xs), _DTYPES.index(xs[0].dtype) if xs else 0, xs[0].shape[-1] if xs else 0]
            idp, rows, m = [], [], []
            for x, i in zip(host, ids):
                mine = owner[i] == d                      # [T, k]: the pairs rank d owns
                sel = mine.any(1)
                meta += [i.shape[0], int(sel.sum()), i.shape[1]]
                idp.append(i[sel].reshape(-1))
                rows.append(x[sel])
                m.append(mine)
            masks.append(m)
            out_chunks.append(_pack(meta, idp, rows))
        tag = IDLE if layer is None else layer
        header = torch.tensor([[tag, c.numel()] for c in out_chunks], dtype=torch.long)
        got = self._sizes(header, None if layer is None else f"the sizes before MoE layer {layer}")
        tags = got[:, 0].tolist()
        if STOP in tags:
            return None
        if STATS in tags:
            self._gather()
            return []
        layer_here = max(tags)
        if layer_here < 0:
            raise RuntimeError("expert parallel: a round with no layer (no rank has rows)")
        buf = self._bytes(out_chunks, got[:, 1].tolist(), f"MoE layer {layer_here}'s rows out")
        # compute what the others sent, every source's sequences apart
        received, off = [], 0
        for s in range(world):
            n = int(got[s, 1])
            received.append(_unpack(buf[off:off + n]))
            off += n
        back = self._compute(layer_here, received)
        back_sizes = [sum(int(mm.sum()) for mm in masks[d]) for d in range(world)]
        h = self.bank.shapes["down"][0] if self.bank is not None else 0
        dtype = xs[0].dtype if xs else torch.float32
        esz = torch.empty(0, dtype=dtype).element_size()
        ret = self._bytes([b.reshape(-1).view(torch.uint8) for b in back], [n * h * esz for n in back_sizes],
                          f"MoE layer {layer_here}'s pairs back")
        self.calls += 1
        self.exchange_seconds += time.perf_counter() - t0
        if layer is None:
            return []
        pairs = [x.new_zeros(i.shape[0], i.shape[1], h) for x, i in zip(host, ids)]     # on the host, then one copy up
        off = 0
        for d in range(world):
            n = back_sizes[d] * h * esz
            y = ret[off:off + n].view(dtype).view(-1, h)
            off += n
            at = 0
            for j, mine in enumerate(masks[d]):
                c = int(mine.sum())
                if c:
                    pairs[j][mine] = y[at:at + c]
                at += c
        return [p.to(x.device) for p, x in zip(pairs, xs)]

    def _compute(self, layer: int, received: list) -> list[torch.Tensor]:
        """received: per source rank, [(T, rows [n, h], ids [n, k])] -> per source rank, the outputs of the pairs
        this rank owns [m, h], in (sequence, row, choice) order."""
        owner, rank = self.owner[layer], self.group.rank
        work = [(s, T, x, i, owner[i] == rank) for s, seqs in enumerate(received) for T, x, i in seqs]
        out = [[] for _ in received]
        union = [i[m] for _, _, _, i, m in work if m.any()]
        if not union:
            return [torch.empty(0) for _ in received]
        union = torch.unique(torch.cat(union))
        dev = self.local.device
        pairs = [None] * len(work)
        for slots, _ in self.local.resident(layer, [union]):
            lut = torch.full((len(owner),), -1, dtype=torch.long, device=slots[0].device)
            lut[union.to(lut.device)] = slots[0]
            for w, (_, T, x, i, m) in enumerate(work):
                if not m.any():
                    continue
                x = x.to(dev)
                s = torch.where(m.to(lut.device), lut[i.to(lut.device)], -1).to(dev)
                # a prefill row goes through the per-expert matmul even when it arrives alone (as in one process)
                p = prefill_pairs(x, s, self.bank) if T > 1 else expert_pairs(x, s, self.bank, self.kernel, False)
                pairs[w] = p if pairs[w] is None else torch.where((s >= 0).unsqueeze(-1), p, pairs[w])
        for w, (src, _, _, _, m) in enumerate(work):
            if pairs[w] is not None:
                out[src].append(pairs[w][m.to(pairs[w].device)].cpu())
        return [torch.cat(o) if o else torch.empty(0) for o in out]

    def report(self) -> dict:
        """This rank's exchange counters (waste bench --expert-parallel)."""
        return {"processes": self.group.world, "placement": self.group.placement, "rounds": self.calls,
                "exchange_seconds": self.exchange_seconds, "comm_seconds": self.comm_seconds,
                "bytes_sent": self.bytes_sent}


def _pack(meta: list[int], ids: list[torch.Tensor], rows: list[torch.Tensor]) -> torch.Tensor:
    """One rank's message: int64 [len(meta), meta..., ids...] then the rows' bytes, padded to 8 bytes."""
    head = torch.cat([torch.tensor([len(meta)] + meta, dtype=torch.long)] + [i.long() for i in ids])
    parts = [head.view(torch.uint8)] + [r.contiguous().view(-1).view(torch.uint8) for r in rows if r.numel()]
    out = torch.cat(parts)
    pad = -out.numel() % 8
    return torch.cat([out, out.new_zeros(pad)]) if pad else out


def _unpack(buf: torch.Tensor) -> list:
    """A message from _pack -> [(T, rows [n, h], ids [n, k])] per sequence (no sequences: an idle rank)."""
    if not buf.numel():
        return []
    buf = buf.clone()                              # aligned for the int64 / float views
    n_meta = int(buf[:8].view(torch.long)[0])
    meta = buf[8:8 * (1 + n_meta)].view(torch.long).tolist()
    n_seq, dtype, h = meta[0], _DTYPES[meta[1]], meta[2]
    seqs = [meta[3 + 3 * j:6 + 3 * j] for j in range(n_seq)]
    off = 8 * (1 + n_meta)
    ids = []
    for T, n, k in seqs:
        ids.append(buf[off:off + 8 * n * k].view(torch.long).view(n, k))
        off += 8 * n * k
    esz = torch.empty(0, dtype=dtype).element_size()
    rest = buf[off:]
    out, at = [], 0
    for (T, n, k), i in zip(seqs, ids):
        rows = rest[at:at + n * h * esz].view(dtype).view(n, h)
        at += n * h * esz
        out.append((T, rows, i))
    return out
