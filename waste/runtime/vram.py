"""The GPU tier of the expert store (`--device cuda [--vram SIZE]`): how much of the host's expert budget also sits in
GPU memory, where the kernels read it.

host budget  = the memory plan's expert budget (runtime/plan.py; `--budget`, `--ram`): the pinned host slab
VRAM budget  = `--vram`, at most the host budget; by default as much of the host budget as the GPU's free memory
               holds beside the trunk and the state (and GPU_RESERVE for the allocator, graphs and scratch)
Equal, the GPU slab mirrors the host slab slot for slot; smaller, it holds the host slab's most recently used
records (runtime/cache.py `_tier`), and the host slab is the tier below it, the bank files the one below that.
"""
from __future__ import annotations

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
