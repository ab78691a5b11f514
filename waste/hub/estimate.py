"""A release judged before it is downloaded: config.json and the safetensors headers (range requests) give the
converter's own name and shape checks, the container's size and the memory plan (runtime/plan.py), so that
`waste plan ORG/NAME` and the checks before a fetch use the same numbers the engine will."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..errors import WasteError
from ..runtime.plan import MemoryPlan
from ..vision import RUNS as VISION_RUNS
from .remote import Remote, RemoteFile

_ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8",
       torch.int32: "I32"}


@dataclass
class Estimate:
    family: str
    experts: str                # the container formats this conversion would use
    trunk: str
    release_bytes: int
    container_bytes: int
    trunk_stored: int
    bank_bytes: int
    cfg: dict                   # the normalised config
    record: int
    experts_per_layer: list[int]
    trunk_header: dict
    trunk_entry: dict
    vision_params: int = 0      # a tower that runs (waste.vision.RUNS): reserved in the plan's floor
    vision_config: dict | None = None
    preprocessor: dict | None = None

    def dtype(self, name: str) -> torch.dtype:
        from ..runtime.dtype import pick_dtype

        return pick_dtype(name, self.trunk_stored + self.bank_bytes)

    def plan(self, dtype: str = "auto", context: int = 4096, ram: int | None = None,
             budget: int | None = None, prefill_chunk: int | None = None) -> MemoryPlan:
        from ..runtime.plan import plan_from_sizes, resident_bytes, vision_bytes

        dt = self.dtype(dtype)
        vision = vision_bytes(self.vision_params, self.vision_config, self.preprocessor, dt) if self.vision_params else 0
        return plan_from_sizes(self.cfg, self.record, self.experts_per_layer,
                               resident_bytes(self.trunk_header, self.trunk_entry, dt), dt, context, ram, budget,
                               prefill_chunk=prefill_chunk, vision=vision)


def estimate(remote: Remote, text: list[RemoteFile], weights: list[RemoteFile], experts: str = "auto",
             trunk: str | None = None, progress: bool = True) -> Estimate:
    from ..container.bank import header_bytes_for
    from ..convert.adapters import adapter_for
    from ..convert.convert import check_names, expert_layout, released_expert_format, trunk_specs
    from ..convert.source import Checkpoint, unwrap_config
    from ..quant.formats import DEFAULT_EXPERTS, DEFAULT_TRUNK, get_format

    try:
        hf = unwrap_config(json.loads(remote.read("config.json")))
    except ValueError as e:
        raise WasteError(f"{remote.repo}/config.json is not valid JSON: {e}") from None
    adapter = adapter_for(hf)
    meta, where = {}, {}
    for rf in tqdm(weights, desc="reading safetensors headers", unit="file", disable=not progress or len(weights) < 8,
                   leave=False):
        for k, v in remote.safetensors_header(rf.path).items():
            meta[k], where[k] = v, rf.path
    ckpt = Checkpoint.from_metadata(f"{remote.repo}@{remote.commit[:12]}", hf, meta, where)
    ckpt = adapter.view(ckpt)
    check_names(ckpt, adapter)
    cfg = adapter.config
    moe = adapter.moe_layers()
    if experts == "auto":
        experts = (released_expert_format(ckpt, adapter) if moe else None) or DEFAULT_EXPERTS
    efmt, tfmt = get_format(experts), get_format(trunk or DEFAULT_TRUNK)
    record, bank = 0, 0
    n_exp = cfg["moe"]["num_experts"] if moe else 0
    if moe:
        h, inter = cfg["hidden_size"], cfg["moe"]["intermediate_size"]
        for shape in ((inter, h), (h, inter)):
            if not efmt.supports(shape):
                raise WasteError(f"the {efmt.name} format cannot store this model's experts ({shape[0]} x {shape[1]} "
                                 f"matrices): choose another --experts")
        layout = expert_layout(efmt.name, cfg)
        record = layout.record_bytes
        lj = json.dumps(layout.to_json(), separators=(",", ":")).encode()
        bank = len(moe) * (header_bytes_for(lj, n_exp) + n_exp * record)
    specs, quantized, _ = trunk_specs(ckpt, adapter, tfmt)
    parts = {f"{d}.{x}" if x else d for d, shp in quantized.items() for x in tfmt.part_specs(tuple(shp))}
    header = {n: {"dtype": _ST[dt], "shape": list(s)} for n, (dt, s) in specs.items()}
    entry = {"f32_tensors": sorted(n for n, (dt, _) in specs.items() if dt == torch.float32 and n not in parts),
             "quantized": quantized}
    stored = sum(math.prod(s) * torch.empty(0, dtype=dt).element_size() for dt, s in specs.values())
    tower = [n for n in ckpt.weight_names() if adapter.vision_target(n) is not None]
    vision = sum(ckpt.nbytes(n) for n in tower)
    runs = {}
    if tower and adapter.family in VISION_RUNS:
        pre = next((f for f in text if f.path == "preprocessor_config.json"), None)
        runs = {"vision_params": sum(math.prod(ckpt.shape(n)) for n in tower), "vision_config": hf.get("vision_config"),
                "preprocessor": _json(remote, pre.path) if pre is not None else None}
    return Estimate(**runs,family=adapter.family, experts=efmt.name, trunk=tfmt.name,
                    release_bytes=sum(f.size for f in text + weights),
                    container_bytes=stored + bank + vision + sum(f.size for f in text),
                    trunk_stored=stored, bank_bytes=bank, cfg=cfg, record=record,
                    experts_per_layer=[n_exp] * len(moe), trunk_header=header, trunk_entry=entry)


def _json(remote: Remote, path: str) -> dict:
    try:
        return json.loads(remote.read(path))
    except ValueError as e:
        raise WasteError(f"{remote.repo}/{path} is not valid JSON: {e}") from None
