"""Model families: one module per family composing layers from the manifest's config."""
from __future__ import annotations

from ..errors import WasteError

SUPPORTED = ("qwen3_moe", "kimi_linear")


def check_family(family: str) -> None:
    if family not in SUPPORTED:
        raise WasteError(f"unsupported model family {family!r}; waste supports: {', '.join(SUPPORTED)}")


def build_model(family: str, config: dict, trunk: dict, experts, dtype, f32_names=frozenset()):
    check_family(family)
    if family == "qwen3_moe":
        from .qwen3_moe import Qwen3Moe as cls
    else:
        from .kimi_linear import KimiLinear as cls
    return cls(config, trunk, experts, dtype, f32_names)
