"""What every expert store shares: counters, and rebuilding matrices from a record's parts.

A store answers "apply these experts to these rows" (`apply(layer, x, idx, weights)`); the model never
sees where the weights live. The one store is runtime/cache.py's ExpertCache.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..quant.formats import get_format


@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    evictions: int = 0
    per_layer: dict = field(default_factory=dict)

    def snapshot(self) -> "ExpertStats":
        return ExpertStats(self.hits, self.misses, self.bytes_read, self.read_seconds, self.evictions,
                           {k: list(v) for k, v in self.per_layer.items()})


def unpack_record(views: dict[str, torch.Tensor], fmt_name: str, shapes: dict, dtype) -> tuple:
    fmt = get_format(fmt_name)
    out = []
    for m in ("gate", "up", "down"):
        parts = {k[len(m) + 1:] if k != m else "": v for k, v in views.items() if k == m or k.startswith(m + ".")}
        out.append(fmt.unpack(parts, shapes[m], dtype))
    return tuple(out)
