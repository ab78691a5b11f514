"""What waste knows about a model family, in one record per family (`FAMILY` beside its model class).

The registry (models/__init__.py `families()`) collects every module of this package that declares a `FAMILY`;
every place that needs a family reads its record from there: the engine builds `model`, the converter picks and
loads `adapter` by `model_types`, the converter writes the built-in `chat` format for a release with no template,
and `waste info` adds the family's `features`. Below this tier (runtime, layers, quant, container) nothing knows a
family: those read the normalised config only (docs/ARCHITECTURE.md, "Adding a family").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str                          # the manifest's `family`
    model: type                        # the DecoderModel subclass the engine builds
    adapter: str                       # "module:Class" in waste/convert (the converter's tier resolves it)
    model_types: tuple[str, ...] = ()  # config.json `model_type` values converted as this family (default: name)
    chat: str | None = None            # waste's built-in chat.json (text/chat_format.py CHAT_JSON) when a release
                                       # ships no template; None: such a release converts without a chat format
    features: Callable[[dict], list[str]] | None = None   # `waste info` lines from the normalised config that
                                                          # only this family's code reaches
    title: str = ""                    # the releases in words ("Qwen3-30B-A3B, Qwen3-235B-A22B")

    @property
    def converts(self) -> tuple[str, ...]:
        return self.model_types or (self.name,)

    def features_of(self, config: dict) -> list[str]:
        return list(self.features(config)) if self.features else []
