"""Model families: one module per family composing layers from the manifest's config, each declaring its
`FAMILY` record (models/family.py); `families()` is the registry every other place reads."""
from __future__ import annotations

import functools
import importlib
import pkgutil

from ..errors import WasteError
from .family import Family


@functools.cache
def families() -> dict[str, Family]:
    """Every family, by name: the `FAMILY` of each module of this package (a new family is its module)."""
    found: dict[str, Family] = {}
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        f = getattr(importlib.import_module(f"{__name__}.{m.name}"), "FAMILY", None)
        if isinstance(f, Family):
            if f.name in found:
                raise RuntimeError(f"two modules declare the family {f.name!r}")
            found[f.name] = f
    return found


def family(name: str) -> Family:
    """The family a container names, refused by name when waste does not run it."""
    found = families().get(name)
    if found is None:
        raise WasteError(f"unsupported model family {name!r}; waste supports: {', '.join(families())}")
    return found


def check_family(name: str) -> None:
    family(name)


def build_model(name: str, config: dict, trunk: dict, experts, dtype, f32_names=frozenset(), capacity=None,
                device="cpu"):
    return family(name).model(config, trunk, experts, dtype, f32_names, capacity=capacity, device=device)
