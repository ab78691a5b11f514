"""Family adapters: a release's config.json -> the engine's normalised config, and checkpoint
tensor names -> trunk names or (layer, expert, matrix) slots in an expert bank.

Trunk names are the checkpoint's names without the `model.` prefix, so a person can match a
container tensor with the release's; only the MoE block is renamed to one spelling (`mlp.`).

Which adapter converts a release is the family registry's to say (waste/models/family.py): each family names its
adapter ("module:Class" in this package) and the `model_type` values it converts; an adapter whose family shares a
`model_type` with another says which releases are its own (`Adapter.claims`).
"""
from __future__ import annotations

import importlib

from ..errors import WasteError
from ..models import families
from ..models.family import Family
from .adapter_base import Adapter


def adapter_class(f: Family) -> type[Adapter]:
    module, _, name = f.adapter.partition(":")
    cls = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    if cls.family != f.name:
        raise RuntimeError(f"family {f.name!r} names the adapter {f.adapter}, whose family is {cls.family!r}")
    return cls


def convertible() -> list[str]:
    """Every `model_type` waste can convert, sorted."""
    return sorted({t for f in families().values() for t in f.converts})


def adapter_for(hf: dict) -> Adapter:
    mt = hf.get("model_type")
    found = [c for c in (adapter_class(f) for f in families().values() if mt in f.converts) if c.claims(hf)]
    if not found:
        raise WasteError(f"unsupported model_type {mt!r}; waste can convert: {', '.join(convertible())}")
    if len(found) > 1:
        raise RuntimeError(f"model_type {mt!r} is claimed by {', '.join(c.family for c in found)}")
    return found[0](hf)
