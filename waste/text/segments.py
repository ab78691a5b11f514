"""A rendered prompt as segments, so that markup and caller text never mix.

The chat renderers (Jinja templates and chat.json) return segments and the tokenizer encodes them:
control tokens are taken from "markup" only; a control token's text that came from a caller is
"quoted" and always encodes as ordinary text. The other two kinds only carry information.
"""

from __future__ import annotations

import re
from typing import NamedTuple

MARKUP = "markup"  # the template's own text: control tokens in it are control tokens
TEXT = "text"  # caller text (message content, names, arguments...)
QUOTED = "quoted"  # a control token's text written by a caller: plain text, its own BPE run
BREAK = "break"  # empty; a BPE run may not join across it (a template split caller text here)


class Segment(NamedTuple):
    kind: str
    text: str


def token_regex(tokens) -> re.Pattern | None:
    """Leftmost-longest matcher for a set of token strings (longest first wins at one position)."""
    tokens = sorted({t for t in tokens if t}, key=lambda t: (-len(t), t))
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def quote_controls(text: str, control_re: re.Pattern | None, kind: str = TEXT) -> list[Segment]:
    """Split caller text so that every control token's text in it becomes a QUOTED segment."""
    if control_re is None:
        return [Segment(kind, text)] if text else []
    out, pos = [], 0
    for m in control_re.finditer(text):
        if m.start() > pos:
            out.append(Segment(kind, text[pos : m.start()]))
        out.append(Segment(QUOTED, m.group()))
        pos = m.end()
    if pos < len(text):
        out.append(Segment(kind, text[pos:]))
    return out


def joined(segments) -> str:
    return "".join(s.text for s in segments)


def merge(segments) -> list[Segment]:
    """Join neighbours of the same kind (never QUOTED or BREAK, which are boundaries)."""
    out: list[Segment] = []
    for s in segments:
        if s.kind != BREAK and not s.text:
            continue
        if out and s.kind == out[-1].kind and s.kind in (MARKUP, TEXT):
            out[-1] = Segment(s.kind, out[-1].text + s.text)
        else:
            out.append(s)
    return out
