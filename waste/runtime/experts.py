"""Expert stores: the runtime's answer to "apply these experts to these rows".

The model hands over rows, expert ids and weights; the store owns where the weights live. This one keeps
every record resident (read once at load, checksummed); the streaming cache replaces it without the
model noticing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..container import Container
from ..layers.mlp import swiglu
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


def apply_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, get) -> torch.Tensor:
    """y = sum_k weights[:, k] * SwiGLU_{idx[:, k]}(x), experts visited in ascending id order so the
    sum is the same whatever the cache state (determinism across budgets)."""
    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        rows, slots = (idx == e).nonzero(as_tuple=True)
        g, u, d = get(e)
        y = swiglu(x[rows], g, u, d) * weights[rows, slots, None]
        out.index_add_(0, rows, y.to(x.dtype))
    return out


class ResidentExperts:
    """Every expert of every MoE layer held in memory in the compute dtype."""

    def __init__(self, container: Container, dtype: torch.dtype, verify: bool = True):
        ex = container.manifest["experts"]
        cfg = container.config
        h, inter = cfg["hidden_size"], cfg["moe"]["intermediate_size"] if cfg.get("moe") else 0
        shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
        self.stats = ExpertStats()
        self.weights: dict[int, list[tuple]] = {}
        for layer, bank in container.banks.items():
            buf = torch.empty(bank.record_bytes, dtype=torch.uint8)
            experts = []
            for e in range(bank.num_experts):
                bank.read_into(e, buf, verify=verify)
                self.stats.bytes_read += bank.record_bytes
                views = bank.layout.views(buf)
                experts.append(tuple(t.clone() for t in unpack_record(views, ex["format"], shapes, dtype)))
            self.weights[layer] = experts

    def apply(self, layer: int, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n = int(torch.unique(idx).numel())
        self.stats.hits += n
        pl = self.stats.per_layer.setdefault(layer, [0, 0])
        pl[0] += n
        return apply_experts(x, idx, weights, self.weights[layer].__getitem__)
