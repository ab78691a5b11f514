"""The memory plan: how much of the expert bank to keep in memory (seeds 0.6.7 and 0.7.0).

floor        = trunk (in the compute dtype) + KV / recurrent state for the context + scratch + the process's
               own measured baseline (+ the vision tower and its activations for the largest image, when the
               container has one: loaded on the first image, then kept; reserved here so that it always fits)
working set  = one token's expert records: top_k x record bytes x MoE layers
bank         = every record
usable       = the smaller of RAM and the cgroup limit (v1 or v2); ceiling = 3/4 of usable
The prefill chunk (`--prefill-chunk N`; default PREFILL_CHUNK, halved down to MIN_PREFILL_CHUNK only where one working
set does not fit beside it) bounds what a prefill holds at once: scratch counts that chunk's activations.
The automatic budget starts at as many working sets as cover the bank (a cache holding everything cannot
improve by growing) and steps down one working set at a time until floor + budget fits under the ceiling.
Below floor + one working set it refuses, with the numbers. --budget overrides, with a warning above the
ceiling.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..container import Container
from ..errors import WasteError
from ..units import fmt_bytes as fmt_gb

CEILING = 0.75
SCRATCH_FIXED = 24 << 20       # measured: what loading and one generation add beyond trunk, state and slab on the
                               # tiny fixtures (tokenizer, allocator pools, thread stacks): tests/test_plan_rss.py
PREFILL_CHUNK = 512            # a chunk's tokens share one read of each expert they route to: larger amortizes more
MIN_PREFILL_CHUNK = 32


def ram_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise WasteError("cannot read /proc/meminfo: pass --ram SIZE")


def cgroup_limit() -> int | None:
    """The tightest memory limit over this process's cgroup and its ancestors (v2 memory.max, v1 limit_in_bytes)."""
    limits = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):
            base, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        p = base / path.lstrip("/")
        while True:
            try:
                v = (p / name).read_text().strip()
                if v != "max" and int(v) < (1 << 60):
                    limits.append(int(v))
            except (OSError, ValueError):
                pass
            if p == base or p.parent == p:
                break
            p = p.parent
    return min(limits) if limits else None


def process_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def trunk_resident_bytes(container: Container, dtype: torch.dtype) -> int:
    """Bytes the trunk takes once loaded: float32-kept tensors at 4 bytes, the rest in the compute dtype."""
    with open(container.trunk_path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return resident_bytes(header, container.manifest["trunk"], dtype)


def resident_bytes(header: dict, trunk: dict, dtype: torch.dtype) -> int:
    """trunk_resident_bytes from a safetensors-style header and the manifest's `trunk` entry (also what
    waste/hub builds for a release before it is downloaded)."""
    f32 = set(trunk.get("f32_tensors", []))
    size = torch.empty(0, dtype=dtype).element_size()
    total = 0
    quantized = trunk.get("quantized") or {}     # parts of these stay as stored
    stored = {"I8": 1, "U8": 1, "I32": 4, "BF16": 2, "F16": 2, "F32": 4}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        numel = math.prod(info["shape"])
        if quantized and name.rsplit(".", 1)[0] in quantized:
            total += numel * stored[info["dtype"]]
            continue
        total += numel * (4 if name in f32 else size)
    return total


def state_bytes(cfg: dict, context: int, dtype: torch.dtype) -> int:
    """KV caches and recurrent state for one sequence of `context` tokens."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for i, layer in enumerate(cfg["layers"]):
        if layer["attn"] == "gqa":
            g = cfg["gqa"]
            total += 2 * g["num_kv_heads"] * g["head_dim"] * context * size
        elif layer["attn"] == "mla":
            m = cfg["mla"]
            total += (m["kv_lora_rank"] + m["qk_rope_head_dim"]) * context * size
            d = cfg.get("dsa")
            if d and d["indexer_types"][i] == "full":     # DSA's indexer: one compressed key per pool
                total += (context // d["index_kpool"] + 1) * d["index_head_dim"] * size
        elif layer["attn"] == "kda":
            k = cfg["kda"]
            c = k["num_heads"] * k["head_dim"]
            total += k["num_heads"] * k["head_dim"] ** 2 * 4 + 3 * (k["conv_kernel"] - 1) * c * size
        elif layer["attn"] == "gdn":          # Gated DeltaNet: S [Hv, dk, dv] in float32, one conv tail
            n = cfg["gdn"]
            c = 2 * n["num_k_heads"] * n["k_dim"] + n["num_v_heads"] * n["v_dim"]
            total += n["num_v_heads"] * n["k_dim"] * n["v_dim"] * 4 + (n["conv_kernel"] - 1) * c * size
    return total


def scratch_bytes(cfg: dict, context: int, dtype: torch.dtype, record_bytes: int,
                  chunk: int = PREFILL_CHUNK) -> int:
    """What a forward of `chunk` rows holds beyond trunk and state (a prefill runs in chunks of that many rows),
    the logits, and one expert unpacked into the compute dtype."""
    size = torch.empty(0, dtype=dtype).element_size()
    n = min(context, chunk)
    h, moe, g = cfg["hidden_size"], cfg.get("moe") or {}, cfg.get("gqa") or {}
    q = g.get("num_heads", 1) * g.get("head_dim", 2 * h)         # query / attention-output width (else 2 x hidden)
    k, inter = moe.get("top_k") or 0, moe.get("intermediate_size") or 0
    # residual, norms, sublayer outputs: 8 rows of hidden; q, k, v, rotated copies, attention output: 4 of q;
    # each routed pair's output kept until the weighted sum (3 copies while groups land) and its expert's
    # intermediates. Not counted: a later chunk's causal mask over the context (1 byte per row and position:
    # 2 MB at 4k, 153 MB at 300k; tests/test_plan_rss.py holds the plan to a short prompt's peak)
    act = n * size * (8 * h + 4 * q + k * (3 * h + 2 * inter))
    act += n * cfg["vocab_size"] * 4
    unpack = 2 * record_bytes if size == 4 else 0
    return SCRATCH_FIXED + act + unpack


@dataclass
class MemoryPlan:
    usable_bytes: int
    usable_source: str
    ceiling_bytes: int
    trunk_bytes: int
    state_bytes: int
    scratch_bytes: int
    baseline_bytes: int
    floor_bytes: int
    record_bytes: int
    working_set_bytes: int
    bank_bytes: int
    budget_bytes: int
    working_sets: float
    resident: bool
    context: int
    reason: str
    warning: str | None = None
    prefill_chunk: int = PREFILL_CHUNK     # rows per forward of a prefill (scratch counts their activations)
    vision_bytes: int = 0           # the tower + its activations for the largest image (part of the floor)

    def to_json(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        return [
            f"usable memory   {fmt_gb(self.usable_bytes)} ({self.usable_source}); ceiling 3/4 = {fmt_gb(self.ceiling_bytes)}",
            f"floor           {fmt_gb(self.floor_bytes)} = trunk {fmt_gb(self.trunk_bytes)} + state for {self.context} "
            f"tokens {fmt_gb(self.state_bytes)} + scratch {fmt_gb(self.scratch_bytes)} + process baseline "
            f"{fmt_gb(self.baseline_bytes)}" + (f" + vision tower {fmt_gb(self.vision_bytes)} (loaded on the first "
                                                 f"image)" if self.vision_bytes else ""),
            f"working set     {fmt_gb(self.working_set_bytes)} (one token's experts: top_k x {fmt_gb(self.record_bytes)} "
            f"per record x MoE layers)",
            f"bank            {fmt_gb(self.bank_bytes)} (every expert record)",
            f"expert budget   {fmt_gb(self.budget_bytes)} = {self.working_sets:.2f} working sets"
            f"{' (the whole bank: fully resident)' if self.resident else ''}",
            f"prefill chunk   {self.prefill_chunk} tokens per forward (scratch counts their activations)",
            f"reason          {self.reason}",
        ] + ([f"warning         {self.warning}"] if self.warning else [])


def plan_memory(container: Container, dtype: torch.dtype, context: int = 4096, ram: int | None = None,
                budget: int | None = None, experts_per_layer: list[int] | None = None, share: int = 1,
                prefill_chunk: int | None = None, baseline: int | None = None, vision: bool = False,
                trunk: bool = True) -> MemoryPlan:
    """experts_per_layer: the experts this process holds per MoE layer; share: processes sharing this machine's
    memory (expert parallel: its rank's share of the experts and of the host); prefill_chunk, baseline: as
    plan_from_sizes; vision: the container's tower runs (waste.vision.RUNS), so the floor reserves it. trunk False:
    a process that holds experts alone (expert parallel's ranks other than 0)."""
    ex = container.manifest["experts"]
    per_layer = experts_per_layer or [i["num_experts"] for i in ex["layers"].values()]
    trunk = 0 if not trunk else container.trunk_bytes(dtype) if hasattr(container, "trunk_bytes") else \
        trunk_resident_bytes(container, dtype)
    return plan_from_sizes(container.config, ex["record_bytes"], per_layer, trunk, dtype, context, ram, budget, share=share,
                           prefill_chunk=prefill_chunk, baseline=baseline,
                           vision=vision_resident_bytes(container, dtype) if vision else 0)


def vision_resident_bytes(container: Container, dtype: torch.dtype) -> int:
    """The vision tower in the compute dtype plus its activations for the largest image the processor makes
    (patches x (4 x hidden + 3 x intermediate) values: the residual, q/k/v and the MLP's three); 0 without one."""
    v = container.manifest.get("vision")
    return vision_bytes(v["params"], v.get("config"), v.get("preprocessor"), dtype) if v else 0


def vision_bytes(params: int, config: dict | None, preprocessor: dict | None, dtype: torch.dtype) -> int:
    """vision_resident_bytes from the tower's parameter count, vision_config and preprocessor_config.json (also what
    waste/hub reckons for a release before it is downloaded)."""
    c, pre = config or {}, preprocessor or {}
    if "vt_hidden_size" in c or c.get("model_type") == "moonvit3d":
        acts = _moonvit_acts(c, pre.get("media_proc_cfg") or {})
    else:
        patches = pre.get("max_image_tokens", 8000) * c.get("spatial_merge_size", 2) ** 2
        acts = patches * (4 * c.get("hidden_size", 1024) + 3 * c.get("intermediate_size", 4096))
    return (params + acts) * torch.empty(0, dtype=dtype).element_size()


def _moonvit_acts(c: dict, media: dict) -> int:
    """Kimi K3's tower for its largest image: in_patch_limit patches plus a padding row and column of merge blocks
    along the longest side (a sweep of image sizes peaks at 1.02x the limit for the release's settings, this bound
    is 1.03x), each with the residual, its norm and the block's output (3 x hidden), q/k/v, their rotated copies
    and the attention output (6 x qkv_hidden) and the MLP's two (2 x intermediate)."""
    m = media.get("merge_kernel_size") or c.get("merge_kernel_size") or (2, 2)
    mh, mw = (m, m) if isinstance(m, int) else m
    patches = media.get("in_patch_limit", 65536) + (mh + mw) * (media.get("patch_limit_on_one_side", 512) + max(mh, mw))
    d = c.get("vt_hidden_size", 1024)
    return patches * (3 * d + 6 * (c.get("qkv_hidden_size") or d) + 2 * c.get("vt_intermediate_size", 4096))


def plan_from_sizes(cfg: dict, record: int, experts_per_layer: list[int], trunk: int, dtype: torch.dtype,
                    context: int = 4096, ram: int | None = None, budget: int | None = None,
                    share: int = 1, prefill_chunk: int | None = None, baseline: int | None = None,
                    vision: int = 0) -> MemoryPlan:
    """The plan from the normalised config and sizes alone (waste/hub plans a release before downloading it).
    share: processes splitting this machine's memory (expert parallel). prefill_chunk: rows per forward of a
    prefill; None: PREFILL_CHUNK, halved while one working set does not fit. baseline: the process's own memory
    before loading (None: measured now; `waste sweep` re-plans a loaded one). vision: the tower's bytes,
    part of the floor."""
    if prefill_chunk is not None and prefill_chunk < 1:
        raise WasteError(f"--prefill-chunk {prefill_chunk}: give a positive number of tokens (default: the plan's)")
    moe = cfg.get("moe") or {}
    n_moe = len(experts_per_layer)
    ws = (moe.get("top_k") or 0) * record * n_moe
    bank = sum(experts_per_layer) * record
    if ram is not None:
        usable, source = ram, "--ram"
    else:
        total, limit = ram_bytes(), cgroup_limit()
        usable, source = (limit, "cgroup limit") if limit and limit < total else (total, "RAM")
    if share > 1:     # expert parallel: the processes on one host split its memory
        usable, source = usable // share, f"{source} / {share} processes"
    ceiling = int(usable * CEILING)
    st = state_bytes(cfg, context, dtype)
    base = process_rss() if baseline is None else baseline
    chunk = min(prefill_chunk or PREFILL_CHUNK, context)
    if prefill_chunk is None and ws:
        # halved only where one working set would not fit beside it: a streamed prefill reads about a layer's
        # whole bank per chunk (128 experts, top-8: a 64-token chunk touches 98% of them), so a chunk of 512 reads
        # 8x fewer bytes per prompt token than one of 64, for one or two working sets less of decode cache
        low = min(MIN_PREFILL_CHUNK, chunk)
        while chunk > low and trunk + st + base + vision + scratch_bytes(cfg, context, dtype, record, chunk) + ws > ceiling:
            chunk //= 2
        chunk = max(chunk, low)
    scratch = scratch_bytes(cfg, context, dtype, record, chunk)
    floor = trunk + st + scratch + base + vision
    common = dict(usable_bytes=usable, usable_source=source, ceiling_bytes=ceiling, trunk_bytes=trunk, state_bytes=st,
                  vision_bytes=vision,
                  scratch_bytes=scratch, baseline_bytes=base, floor_bytes=floor, record_bytes=record,
                  working_set_bytes=ws, bank_bytes=bank, context=context, prefill_chunk=chunk)
    if budget is not None:
        if record and budget < record:
            raise WasteError(f"--budget {budget} bytes is smaller than one expert record ({record} bytes)")
        budget = min(budget, bank)
        warning = None
        if floor + budget > ceiling:
            warning = (f"floor {fmt_gb(floor)} + budget {fmt_gb(budget)} is above 3/4 of usable memory "
                       f"({fmt_gb(ceiling)}): the machine may page and run far slower than a smaller budget")
        return MemoryPlan(**common, budget_bytes=budget, working_sets=budget / ws if ws else 0.0,
                          resident=budget >= bank, reason="--budget", warning=warning)
    if not ws:
        return MemoryPlan(**common, budget_bytes=0, working_sets=0.0, resident=True, reason="no routed experts")
    m, b = _fit(floor, ws, bank, ceiling)
    if m:
        why = ("the whole bank fits under 3/4 of usable memory" if b == bank else
               f"{m} working set(s) is the most that fits under 3/4 of usable memory")
        return MemoryPlan(**common, budget_bytes=b, working_sets=b / ws, resident=b >= bank, reason=why)
    raise WasteError(
        f"not enough memory: this model needs at least {fmt_gb(floor + ws)} (floor {fmt_gb(floor)} + one working "
        f"set {fmt_gb(ws)}), but 3/4 of usable memory is {fmt_gb(ceiling)} ({source} {fmt_gb(usable)}). "
        f"Lower --context (now {context}), close other programs, use a machine with more memory, "
        f"or force a smaller cache with --budget SIZE (slower)")


def expert_room(container: Container, dtype: torch.dtype, context: int, ram: int | None, share: int,
                prefill_chunk: int | None, trunk: bool, vision: bool = False) -> int:
    """Bytes of expert records a process can hold beside its floor under the ceiling, whatever the bank (expert
    parallel's placement weighs the ranks by it): the plan of the whole bank with a one-record budget, which is
    never refused."""
    p = plan_memory(container, dtype, context, ram, container.manifest["experts"]["record_bytes"] or 1, None, share,
                    prefill_chunk, vision=vision, trunk=trunk)
    return p.ceiling_bytes - p.floor_bytes


def _fit(floor: int, ws: int, bank: int, ceiling: int) -> tuple[int, int]:
    """(working sets, budget bytes) of the largest budget, in whole working sets up to the bank, that fits beside
    `floor` under the ceiling; (0, 0) where not even one does."""
    for m in range(math.ceil(bank / ws), 0, -1):
        b = min(m * ws, bank)
        if floor + b <= ceiling:
            return m, b
    return 0, 0
