"""Mixtral (`mixtral`): the Qwen3-MoE decoder without q/k norm (GQA with RoPE, softmax top-k router renormalised
over the chosen experts, every layer MoE); the config's `gqa.qk_norm: false` is the whole difference."""
from __future__ import annotations

from .family import Family
from .qwen3_moe import Qwen3Moe

FAMILY = Family("mixtral", Qwen3Moe, "adapter_mixtral:MixtralAdapter", title="Mixtral-8x7B, Mixtral-8x22B")
