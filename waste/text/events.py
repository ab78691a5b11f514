"""What a reply parser yields as a reply streams: content text, reasoning text, whole tool calls (text/parsers.py,
text/harmony.py)."""

from __future__ import annotations

from typing import NamedTuple


class Content(NamedTuple):
    text: str


class Reasoning(NamedTuple):
    text: str


class ToolCall(NamedTuple):
    """One call, whole: OpenAI's streaming delta for it is `as_delta()`."""

    index: int
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_delta(self) -> dict:
        return {"index": self.index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
