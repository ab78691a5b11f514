"""Split model output, as it streams, into content, reasoning and OpenAI-shaped tool calls.

One state machine serves every family; a `Markup` says which markers open and close the reasoning
channel and a tool call, and how a call's body reads (tool_calls.py). Text that could still be the
start of a marker is held back until it is resolved. A call is buffered whole and emitted once it
parses: a malformed or unfinished call comes out as content text, never lost.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable

from . import tool_calls


from .events import Content, Reasoning, ToolCall  # noqa: F401  (the parsers' events, importable from here)


@dataclass(frozen=True)
class Markup:
    name: str
    think: tuple[str, str] | None = ("<think>", "</think>")
    call_open: tuple[str, ...] = ()
    call_close: str = ""
    # body (text between the markers) -> (id or None, name, arguments JSON) or None when malformed
    parse_call: Callable | None = None
    swallow: tuple[str, ...] = ()  # structure markers that carry nothing (sections, channel frames)
    strip_after_think: bool = True  # drop the newlines a model writes after <think> / </think>
    strip_around_calls: bool = False  # drop content whitespace right before a call or structure marker (DSML)


MARKUPS = {
    "plain": Markup("plain", think=None),
    "think": Markup("think"),
    "hermes": Markup("hermes", call_open=("<tool_call>",), call_close="</tool_call>", parse_call=tool_calls.hermes),
    "glm": Markup("glm", call_open=("<tool_call>",), call_close="</tool_call>", parse_call=tool_calls.glm),
    "kimi_k2": Markup(
        "kimi_k2",
        call_open=("<|tool_call_begin|>",),
        call_close="<|tool_call_end|>",
        parse_call=tool_calls.kimi_k2,
        swallow=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    ),
    "xtml": Markup(
        "xtml",
        think=("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
        call_open=("<|open|>call",),
        call_close="<|close|>call<|sep|>",
        parse_call=tool_calls.xtml,
        swallow=(
            "<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|open|>tools<|sep|>",
            "<|close|>tools<|sep|>", "<|close|>message<|sep|>", "<|end_of_msg|>",
        ),  # fmt: skip
        strip_after_think=False,
    ),
    # DeepSeek-V3.2: DSML invoke elements inside one function_calls block
    "dsml": Markup(
        "dsml",
        call_open=("<｜DSML｜invoke",),
        call_close="</｜DSML｜invoke>",
        parse_call=tool_calls.dsml,
        swallow=("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),
        strip_around_calls=True,
    ),
    # gpt-oss: messages with channel headers (text/harmony.py's parser reads them, not OutputParser)
    "harmony": Markup("harmony", think=None, call_open=("to=functions.",), call_close="<|call|>"),
}


@dataclass
class OutputParser:
    """feed(text) -> events; finish() -> the events still held. Events: Content, Reasoning, ToolCall."""

    markup: Markup
    tools: list | None = None  # the request's tools: typed GLM argument values by their schema
    start_in_reasoning: bool = False  # the prompt already opened the reasoning channel
    id_factory: Callable[[int], str] = field(default=lambda i: "call_" + uuid.uuid4().hex[:24])

    def __post_init__(self):
        self._mode = "reasoning" if self.start_in_reasoning and self.markup.think else "content"
        self._buf = ""
        self._call = ""  # raw text of the call being read, its opening marker included
        self._opened = ""
        self._index = 0
        self._strip = self._mode == "reasoning" and self.markup.strip_after_think
        self._trail = ""  # reasoning's trailing whitespace, dropped if </think> follows it
        # whitespace opening a reply is held until we know whether <think> follows it (GLM-4.5 / 4.6 write
        # "\n<think>"): dropped if it does, content if anything else comes first
        self._lead = "" if self._mode == "content" and self.markup.think else None
        self._held = ""  # strip_around_calls: content's trailing whitespace, dropped if a call marker follows

    def feed(self, text: str) -> list:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list:
        events = self._run(final=True)
        rest, self._buf = self._buf, ""
        if self._mode == "call":  # cut off inside a call: its text is content
            events += self._emit(Content, self._call + rest)
            self._call, self._mode = "", "content"
        else:
            events += self._emit(Reasoning if self._mode == "reasoning" else Content, rest)
        if self._lead:          # a reply of whitespace alone: it is the content
            events += self._emit(Content, self._lead, release=True)
        if self._held:
            events.append(Content(self._held))
            self._held = ""
        return events

    def _markers(self) -> list[str]:
        m = self.markup
        if self._mode == "reasoning":
            return [m.think[1]]
        if self._mode == "call":
            return [m.call_close]
        return [*((m.think[0],) if m.think else ()), *m.call_open, *m.swallow]

    def _run(self, final: bool) -> list:
        events = []
        while True:
            markers = self._markers()
            hit = _earliest(self._buf, markers)
            if hit is not None:
                i, marker = hit
                # a longer marker might still be completed by text not yet seen: wait for it
                if not final and any(len(m) > len(marker) and m.startswith(self._buf[i:]) for m in markers):
                    events += self._text(self._buf[:i])
                    self._buf = self._buf[i:]
                    return events
                events += self._text(self._buf[:i])
                self._buf = self._buf[i + len(marker) :]
                events += self._on_marker(marker)
                continue
            keep = 0 if final else _partial_tail(self._buf, markers)
            cut = len(self._buf) - keep
            events += self._text(self._buf[:cut])
            self._buf = self._buf[cut:]
            return events

    def _on_marker(self, marker: str) -> list:
        m = self.markup
        if self._mode == "content" and (marker in m.call_open or marker in m.swallow):
            self._held = ""
        if self._mode == "content" and m.think and marker == m.think[0]:
            self._mode, self._strip, self._lead = "reasoning", m.strip_after_think, None
        elif self._mode == "reasoning":
            self._mode, self._strip, self._trail = "content", m.strip_after_think, ""
        elif self._mode == "content" and marker in m.call_open:
            held = self._emit(Content, self._lead, release=True) if self._lead else []
            self._mode, self._call, self._opened = "call", marker, marker
            return held
        elif self._mode == "call":
            return self._close_call(marker)
        return []  # swallowed structure

    def _close_call(self, close: str) -> list:
        raw, body = self._call + close, self._call[len(self._opened) :]
        self._mode, self._call = "content", ""
        parsed = self.markup.parse_call(body, self.tools)
        if parsed is None:
            return self._emit(Content, raw)
        call_id, name, arguments = parsed
        call = ToolCall(self._index, call_id or self.id_factory(self._index), name, arguments)
        self._index += 1
        return [call]

    def _text(self, text: str) -> list:
        if self._mode == "call":
            self._call += text
            return []
        return self._emit(Reasoning if self._mode == "reasoning" else Content, text)

    def _emit(self, kind, text: str, release: bool = False) -> list:
        if kind is Content and self._lead is not None and not release:
            if not text.strip():
                self._lead += text
                return []
            text, self._lead = self._lead + text, None
        if release:
            self._lead = None
        if kind is Reasoning and self.markup.strip_after_think:
            text = self._trail + text
            body = text.rstrip()
            self._trail, text = text[len(body) :], body
        if self._strip and text:
            text = text.lstrip()
            self._strip = not text
        if kind is Content and self.markup.strip_around_calls and text:
            text = self._held + text
            body = text.rstrip()
            self._held, text = text[len(body) :], body
        return [kind(text)] if text else []


def parse_output(parser: OutputParser, text: str) -> dict:
    """One-shot parse of a whole output into a message dict."""
    return collect(parser.feed(text) + parser.finish())


def collect(events) -> dict:
    """Events -> {"content", "reasoning_content", "tool_calls"} (None where there is nothing)."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    calls = [e.as_openai() for e in events if isinstance(e, ToolCall)]
    return {"content": content or None, "reasoning_content": reasoning or None, "tool_calls": calls or None}


def markup_for(template: str | None = None) -> Markup:
    """The output markup of a release, sniffed from its chat template (plain without one)."""
    if template:
        if "<|channel|>" in template and "<|message|>" in template:
            return MARKUPS["harmony"]
        if "<|open|>" in template and "<|sep|>" in template:
            return MARKUPS["xtml"]
        if any(m in template for m in ("<|tool_call_begin|>", "<|tool_calls_section_begin|>", "<|im_middle|>")):
            return MARKUPS["kimi_k2"] if "<think>" in template else _no_think(MARKUPS["kimi_k2"])
        if "｜DSML｜" in template:
            return MARKUPS["dsml"]
        if "<arg_key>" in template:
            return MARKUPS["glm"]
        if "<tool_call>" in template:
            return MARKUPS["hermes"] if "<think>" in template else _no_think(MARKUPS["hermes"])
        return MARKUPS["think"] if "<think>" in template else MARKUPS["plain"]
    return MARKUPS["plain"]


def parser_for(template=None, prompt=None, tools=None, id_factory=None, think=None) -> OutputParser:
    """A fresh parser for one reply. `prompt`: the rendered prompt, whose tail says whether the
    reasoning channel is already open; `think`: (open, close) from a chat.json, overriding."""
    markup = markup_for(template)
    if think is not None:
        markup = Markup(**{**markup.__dict__, "think": tuple(think)})
    opened = bool(prompt and markup.think and prompt.rstrip().endswith(markup.think[0]))
    kw = {"id_factory": id_factory} if id_factory else {}
    return new_parser(markup, tools=tools, start_in_reasoning=opened, **kw)


def new_parser(markup: Markup, **kw):
    """The parser a markup is read with: OutputParser, or harmony's own (its messages carry headers)."""
    if markup.name == "harmony":
        from .harmony import HarmonyParser

        return HarmonyParser(markup, **kw)
    return OutputParser(markup, **kw)


def _no_think(m: Markup) -> Markup:
    return Markup(**{**m.__dict__, "think": None, "name": m.name})


def _earliest(buf: str, markers) -> tuple[int, str] | None:
    best = None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(m) > len(best[1]))):
            best = (i, m)
    return best


def _partial_tail(buf: str, markers) -> int:
    """Length of the longest tail of buf that is a proper prefix of a marker."""
    longest = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), longest, -1):
            if buf.endswith(m[:n]):
                longest = n
                break
    return longest

