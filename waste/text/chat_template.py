"""Render a release's Jinja chat template the way HF `apply_chat_template` does, keeping markup apart.

`render` gives the exact string transformers gives. `render_segments` renders the caller's strings
marked, so the result says which text the template wrote (markup: its control tokens count) and
which the caller wrote (text: a `<|im_end|>` in it stays text). Two kinds of private-use marks:
  - every control token's text inside a caller string is wrapped in a numbered pair; this is what
    makes encoding safe, and survives templates that strip, split or search the content;
  - every caller string is wrapped whole, which tells text from markup exactly when the template
    only copies strings. When the marks change what the template renders (it compares, slices or
    strips the content), the whole-string marks are dropped and the rest still holds.
"""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import datetime
from functools import lru_cache

from .errors import TextError
from .segments import BREAK, MARKUP, QUOTED, TEXT, Segment, merge, token_regex

# Plane-15 private-use marks (the first two are the ones transformers uses for the same purpose).
TOK_OPEN, TOK_CLOSE, LEAF_OPEN, LEAF_CLOSE = "\U000f0000", "\U000f0001", "\U000f0002", "\U000f0003"
_MARKS = TOK_OPEN + TOK_CLOSE + LEAF_OPEN + LEAF_CLOSE
_STRIP_MARKS = str.maketrans("", "", _MARKS)
_PAIR_BASE = 0x100000  # plane-16 character numbering each token pair, so halves can't pair up wrongly
_PAIR_COUNT = 0xFFFE
_SCAN = re.compile(
    f"{TOK_OPEN}(?P<k>[\U00100000-\U0010fffd])(?P<tok>[^{_MARKS}]*?)(?P=k){TOK_CLOSE}"  # an intact pair: quoted
    f"|{TOK_OPEN}[^{_MARKS}]?|[^{_MARKS}]?{TOK_CLOSE}"  # a half the template cut off: a break
    f"|[{LEAF_OPEN}{LEAF_CLOSE}]",
    re.S,
)
_NO_LEAF_WRAP = {"role", "type"}  # values templates compare with literals
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplate:
    """A compiled chat template. `now` replaces the clock behind `strftime_now` (tests freeze it)."""

    def __init__(self, source: str, now=None):
        if not isinstance(source, str) or not source.strip():
            raise TextError("chat template is empty")
        self.source = source
        self._now = now or datetime.now
        try:
            clock = {"strftime_now": lambda fmt: self._now().strftime(fmt)}
            self._template = _environment().from_string(source, globals=clock)
        except Exception as e:
            raise TextError(f"chat template does not compile: {e}") from e

    @property
    def literal_text(self) -> str:
        """The template's own strings (text and constants), NUL-joined: where its markup comes from."""
        return _literal_text(self.source)

    @property
    def variables(self) -> frozenset[str]:
        """The names the template reads from its context (messages, tools, enable_thinking, ...)."""
        return _variables(self.source)

    def render(self, messages, tools=None, documents=None, add_generation_prompt=False, **kwargs) -> str:
        """The exact string HF `apply_chat_template(..., tokenize=False)` renders."""
        data = _inputs(messages, tools, documents)
        return self._render(*data, add_generation_prompt, kwargs)

    def render_segments(
        self, messages, control=(), tools=None, documents=None, add_generation_prompt=False, trusted=None, **kwargs
    ) -> list[Segment]:
        """Render to segments. `control`: the control-token strings (Tokenizer.control_tokens);
        `trusted`: variables that are markup themselves (bos_token...), overridden by kwargs as in HF."""
        messages, tools, documents = _inputs(messages, tools, documents)
        control_re = token_regex(control)
        # Both passes number the token pairs in the same order, so their renders can be compared.
        counter = iter(range(1 << 62))
        plain = [_mark(v, control_re, counter, wrap=False) for v in (messages, tools, documents)]
        marked_kw = {**(trusted or {}), **{k: _mark(v, control_re, counter, wrap=False) for k, v in kwargs.items()}}
        reference = self._render(*plain, add_generation_prompt, marked_kw)
        counter = iter(range(1 << 62))
        wrapped_in = [_mark(v, control_re, counter, wrap=True) for v in (messages, tools, documents)]
        try:
            wrapped = self._render(*wrapped_in, add_generation_prompt, marked_kw)
        except TextError:
            wrapped = None
        if wrapped is not None and wrapped.replace(LEAF_OPEN, "").replace(LEAF_CLOSE, "") == reference:
            segments = _scan(wrapped)
            if segments is not None:
                return segments
        return _scan(reference, leaves=False)

    def _render(self, messages, tools, documents, add_generation_prompt, kwargs) -> str:
        try:
            return self._template.render(
                messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # raise_exception(), or the template tripping over its input
            raise TextError(f"chat template refused the conversation: {e}") from e


def encode_chat(tokenizer, template, messages, tools=None, documents=None, add_generation_prompt=False, **kwargs) -> list[int]:
    """Render with the release's template and encode; caller text never becomes a control token."""
    return tokenizer.encode_segments(
        *chat_segments(tokenizer, template, messages, tools, documents, add_generation_prompt, **kwargs)
    )


def chat_segments(tokenizer, template, messages, tools=None, documents=None, add_generation_prompt=False, **kwargs):
    """(segments, control tokens) for a conversation, with the tokenizer's special tokens passed in."""
    tpl = template if isinstance(template, ChatTemplate) else _cached(template)
    control = tokenizer.control_tokens(tpl.literal_text)
    if tools is not None and tokenizer.kind == "tiktoken":
        tools = _deep_sorted(tools)  # Moonshot's TikTokenTokenizer.apply_chat_template sorts tool keys
    segments = tpl.render_segments(
        messages, control, tools, documents, add_generation_prompt, trusted=tokenizer.special_tokens_map(), **kwargs
    )
    return segments, control


def template_arguments_as_dicts(source: str) -> bool:
    """Whether a template iterates tool-call arguments as a mapping (GLM's `.items()`, Qwen-coder's
    `|items`), or writes them with `|tojson` and never asks whether they are a string (gpt-oss: a string would be
    written as a JSON string): the server then turns OpenAI's JSON-string arguments into dicts before rendering."""
    return bool(re.search(r"arguments\s*\|\s*items|arguments\.items\(\)|_args\.items\(\)|arguments is mapping", source)
                or (re.search(r"arguments\s*\|\s*tojson", source) and "is string" not in source))


def prepare_messages(messages, arguments_as_dicts: bool) -> list[dict]:
    """What OpenAI-style servers do before rendering: null content -> "", and (optionally) tool-call
    arguments from JSON strings to dicts; a string that is not a JSON object is left as it is."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content", "") is None:
            m["content"] = ""
        if arguments_as_dicts and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args) if args.strip() else {}
                    except ValueError:
                        parsed = args
                    fn["arguments"] = parsed if isinstance(parsed, dict) else args
                c["function"] = fn
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


@lru_cache(maxsize=16)
def _cached(source: str) -> ChatTemplate:
    return ChatTemplate(source)


# inputs ----------------------------------------------------------------------------------------


def _inputs(messages, tools, documents):
    """HF's preprocessing: plain JSON data, keys with None values dropped, reasoning aliases filled."""
    msgs = []
    for m in _plain(messages):
        if not isinstance(m, dict):
            raise TextError(f"a chat message must be a mapping, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        msgs.append(m)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise TextError("tools must be JSON-schema mappings")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TextError("documents must be mappings with 'title' and 'text'")
    return msgs, _plain(tools), _plain(documents)


def _plain(value):
    """Rebuild from JSON types only: the sandbox then sees nothing with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _deep_sorted(obj):
    if isinstance(obj, dict):
        return {k: _deep_sorted(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [_deep_sorted(v) for v in obj]
    return obj


def _mark(value, control_re, counter, wrap: bool, key=None):
    """Caller strings with control tokens pair-marked and (if wrap) the whole string leaf-marked."""
    if isinstance(value, str):
        s = value.translate(_STRIP_MARKS)  # a caller can't forge marks
        if control_re is not None:

            def pair(m):
                k = chr(_PAIR_BASE + next(counter) % _PAIR_COUNT)
                return f"{TOK_OPEN}{k}{m.group()}{k}{TOK_CLOSE}"

            s = control_re.sub(pair, s)
        # empty strings stay unwrapped: wrapping would make them truthy
        return LEAF_OPEN + s + LEAF_CLOSE if wrap and s and key not in _NO_LEAF_WRAP else s
    if isinstance(value, dict):
        return {k: _mark(v, control_re, counter, wrap, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark(v, control_re, counter, wrap) for v in value]
    return value


def _scan(rendered: str, leaves: bool = True) -> list[Segment] | None:
    """Marked render -> segments; None when the leaf marks are not properly paired."""
    out, pos, in_leaf = [], 0, False
    for m in _SCAN.finditer(rendered):
        if m.start() > pos:
            out.append(Segment(TEXT if in_leaf else MARKUP, rendered[pos : m.start()]))
        pos = m.end()
        g = m.group()
        if m.group("tok") is not None:
            out.append(Segment(QUOTED, m.group("tok")))
        elif g == LEAF_OPEN or g == LEAF_CLOSE:
            if not leaves or in_leaf == (g == LEAF_OPEN):
                return None
            in_leaf = g == LEAF_OPEN
        else:  # a lone half of a pair, with its number when that survived
            lone = g.replace(TOK_OPEN, "").replace(TOK_CLOSE, "")
            real = lone and not _PAIR_BASE <= ord(lone) < _PAIR_BASE + _PAIR_COUNT  # a neighbour, not a number
            around = [Segment(BREAK, "")]
            if real:
                text = Segment(TEXT if in_leaf else MARKUP, lone)
                around = [*around, text] if g[0] == TOK_OPEN else [text, *around]
            out += around
    if in_leaf:
        return None
    if pos < len(rendered):
        out.append(Segment(TEXT if in_leaf else MARKUP, rendered[pos:]))
    return merge(out)


# environment -----------------------------------------------------------------------------------


@lru_cache
def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (HF's assistant-mask tag): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore attributes, as HF's does (no reach into internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # HF's filter: no HTML escaping, non-ASCII kept, indent/separators/sort_keys passed through
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=TemplateDict(), namespace=Namespace)
    return env


@lru_cache(maxsize=32)
def _variables(source: str) -> frozenset[str]:
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(_environment().parse(source)))


@lru_cache(maxsize=32)
def _literal_text(source: str) -> str:
    import jinja2.nodes

    ast = _environment().parse(source)
    literals = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return "\0".join(sorted(literals))
