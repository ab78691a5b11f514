"""Model families: one module per family composing layers from the manifest's config."""
from __future__ import annotations

from ..errors import WasteError

SUPPORTED = ("qwen3_moe", "kimi_linear", "glm5_next", "deepseek_v3", "kimi_k3", "gpt_oss")


def check_family(family: str) -> None:
    if family not in SUPPORTED:
        raise WasteError(f"unsupported model family {family!r}; waste supports: {', '.join(SUPPORTED)}")


def build_model(family: str, config: dict, trunk: dict, experts, dtype, f32_names=frozenset(), capacity=None,
                device="cpu"):
    check_family(family)
    if family == "qwen3_moe":
        from .qwen3_moe import Qwen3Moe as cls
    elif family == "glm5_next":
        from .glm5_next import Glm5Next as cls
    elif family == "kimi_k3":
        from .kimi_k3 import KimiK3 as cls
    elif family == "gpt_oss":
        from .gpt_oss import GptOss as cls
    elif family == "deepseek_v3":
        from .deepseek_v3 import DeepseekV3 as cls
    else:
        from .kimi_linear import KimiLinear as cls
    return cls(config, trunk, experts, dtype, f32_names, capacity=capacity, device=device)
