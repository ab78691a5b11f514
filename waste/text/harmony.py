"""gpt-oss's replies in OpenAI's harmony format, parsed as they stream into content, reasoning and tool calls.

A reply is a run of messages, each `[<|start|>ROLE][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE |
 TYPE]<|message|>BODY` ended by `<|end|>` (more follow), `<|return|>` or `<|call|>` (both end generation, so they are
end ids and never reach the text: the end of the output ends the message too). The prompt ends in
`<|start|>assistant`, so the first header starts at once. Channels: `analysis` is reasoning; `final`, and
`commentary` addressed to no one (a preamble the user may see), are content; a message to `functions.NAME` is a call
of NAME with the body as its JSON arguments. A call whose body is not a JSON object, a call when the request
declared no tools, a message to any other recipient, and text with no header at all come out as content text:
nothing is lost.
"""
from __future__ import annotations

import json
import re
import uuid

from .events import Content, Reasoning, ToolCall

START, END, RETURN, CALL = "<|start|>", "<|end|>", "<|return|>", "<|call|>"
MESSAGE, CHANNEL, CONSTRAIN = "<|message|>", "<|channel|>", "<|constrain|>"
ENDS = (END, RETURN, CALL)
HEADER_MAX = 256          # characters of header without a <|message|>: it is text, not a header
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def read_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a header (the text between a message's start and `<|message|>`)."""
    ch, to = _CHANNEL.search(header), _RECIPIENT.search(header)
    return (ch[1] if ch else None), (to[1] if to else None)


class HarmonyParser:
    """feed(text) -> events; finish() -> the events still held (the interface of parsers.OutputParser)."""

    def __init__(self, markup, tools=None, start_in_reasoning=False, id_factory=None):
        self.markup, self.tools = markup, tools
        self.calls = bool(markup.call_open)      # tools were declared (chat.py drops call markup otherwise)
        self.id_factory = id_factory or (lambda i: "call_" + uuid.uuid4().hex[:24])
        self.start_in_reasoning = False
        self._buf, self._head, self._body = "", "", ""
        self._mode = "header"                     # header | body
        self._kind: str | None = None             # body: reasoning | content | call
        self._name = ""
        self._index = 0

    def feed(self, text: str) -> list:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list:
        events = self._run(final=True)
        if self._mode == "body":
            events += self._close("")
        elif self._head.strip():
            events += [Content(self._head)]      # a header the output never finished: its text
        self._head, self._mode = "", "header"
        return events

    def _markers(self) -> tuple[str, ...]:
        return (MESSAGE, START, *ENDS) if self._mode == "header" else (START, *ENDS)

    def _run(self, final: bool) -> list:
        events = []
        while True:
            hit = _earliest(self._buf, self._markers())
            if hit is None:
                cut = len(self._buf) if final else len(self._buf) - _partial_tail(self._buf, self._markers())
                events += self._text(self._buf[:cut])
                self._buf = self._buf[cut:]
                return events
            i, marker = hit
            events += self._text(self._buf[:i])
            self._buf = self._buf[i + len(marker):]
            events += self._on_marker(marker)

    def _text(self, text: str) -> list:
        if not text:
            return []
        if self._mode == "header":
            self._head += text
            if len(self._head) > HEADER_MAX and CHANNEL not in self._head:   # plain text, no harmony at all
                self._mode, self._kind, self._body = "body", "content", ""
                text, self._head = self._head, ""
                return [Content(text)]
            return []
        if self._kind == "call":
            self._body += text
            return []
        return [(Reasoning if self._kind == "reasoning" else Content)(text)]

    def _on_marker(self, marker: str) -> list:
        if self._mode == "header":
            if marker == START:                  # the next message's role follows
                self._head = ""
                return []
            if marker == MESSAGE:
                return self._open()
            head, self._head = self._head, ""    # a message ended before its body began: keep its text
            return [Content(head)] if head.strip() else []
        return self._close(marker)

    def _open(self) -> list:
        channel, to = read_header(self._head)
        self._mode, self._body = "body", ""
        if to is not None and to != "assistant":
            if self.calls and to.startswith("functions.") and len(to) > len("functions."):
                self._kind, self._name = "call", to[len("functions."):]
            else:
                self._kind, self._name = "call", None      # not a call this request can take: kept as text
            self._raw_head = self._head
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"
        self._head = ""
        return []

    def _close(self, marker: str) -> list:
        self._mode = "header"
        if self._kind != "call":
            return []
        body, self._body = self._body, ""
        args = _arguments(body) if self._name else None
        if args is None:
            return [Content(f"{START}assistant{self._raw_head}{MESSAGE}{body}{marker or ''}")]
        call = ToolCall(self._index, self.id_factory(self._index), self._name, args)
        self._index += 1
        return [call]


def _arguments(body: str) -> str | None:
    try:
        obj = json.loads(body) if body.strip() else {}
    except ValueError:
        return None
    return json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else None


def _earliest(buf: str, markers) -> tuple[int, str] | None:
    best = None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, m)
    return best


def _partial_tail(buf: str, markers) -> int:
    """Length of the longest tail of buf that is a proper prefix of a marker (held until it is decided)."""
    longest = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), longest, -1):
            if buf.endswith(m[:n]):
                longest = n
                break
    return longest
