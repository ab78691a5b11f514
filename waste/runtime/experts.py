"""What every expert store shares: counters, and rebuilding matrices from a record's parts.

The one store is runtime/cache.py's ExpertCache: it makes a layer's experts resident and says in which slab slots
they sit; layers/moe.py computes them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..errors import WasteError


@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    evictions: int = 0
    per_layer: dict = field(default_factory=dict)
    wait_seconds: float = 0.0       # compute waiting for reads (the profile's "expert wait")
    disk_busy_seconds: float = 0.0  # wall time with at least one record read in flight (any kind, its check included)
    # next-layer prefetch: reads and evictions it made (apart from the demand misses above), and its prediction
    # against what the layer then needed: precision = right / predicted, recall = right / needed
    prefetch_reads: int = 0
    prefetch_bytes: int = 0
    prefetch_evictions: int = 0
    predicted: int = 0
    predicted_right: int = 0
    predicted_needed: int = 0

    def snapshot(self) -> "ExpertStats":
        return dataclasses.replace(self, per_layer={k: list(v) for k, v in self.per_layer.items()})


def parts_of(views: dict[str, torch.Tensor], matrix: str) -> dict[str, torch.Tensor]:
    """A record's parts for one matrix, keyed by part suffix ("" for a plain matrix)."""
    return {k[len(matrix) + 1:] if k != matrix else "": v for k, v in views.items()
            if k == matrix or k.startswith(matrix + ".")}


def matrix_parts(views: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A record's parts grouped per matrix: {"gate": {...}, "up": {...}, "down": {...}}."""
    return {m: parts_of(views, m) for m in ("gate", "up", "down")}


def prepare_record(parts: dict[str, dict[str, torch.Tensor]], fmt, shapes: dict) -> None:
    """Repack a record's matrices (matrix_parts) in place into the form the format's kernel takes on this machine
    (fmt.prepare), when that differs from the stored bytes (q4 on a torch build whose int4 layout is not the
    stored one): once per fill of a cache slot instead of once per matmul. Sizes must not change."""
    for m, p in parts.items():
        for k, t in fmt.prepare(p, shapes[m]).items():
            if t is not p[k]:
                if t.dtype != p[k].dtype or t.numel() != p[k].numel():
                    raise RuntimeError(f"{fmt.name}: this torch's kernel layout for {m}.{k} ({t.dtype}, {t.numel()}) "
                                       f"differs in size from the stored one; it cannot be repacked in place")
                p[k].copy_(t.reshape(p[k].shape))


def expert_act(moe: dict):
    """The routed experts' gated activation from the manifest's moe entry: None for SwiGLU (the default), or
    (beta, linear_beta) for Kimi K3's SiTU-GLU (`expert_act: "situ_glu"`), ("oai_glu", alpha, limit) for gpt-oss."""
    act = moe.get("expert_act", "swiglu")
    if act == "swiglu":
        return None
    if act == "situ_glu":
        return (moe.get("situ_beta", 1.0), moe.get("situ_linear_beta"))
    if act == "oai_glu":        # gpt-oss
        return ("oai_glu", float(moe["glu_alpha"]), float(moe["glu_limit"]))
    raise WasteError(f"the container's expert activation {act!r} is not known to this waste "
                     "(swiglu, situ_glu, oai_glu)")
