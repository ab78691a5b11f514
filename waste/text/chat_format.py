"""chat.json: the prompt format of a release that ships no Jinja template.

Schema (every field but roles.user / roles.assistant optional):
{
  "prelude": "[gMASK]<sop>",                         markup once, before everything
  "roles": {"system": {"prefix": .., "suffix": ..}, "user": {..}, "assistant": {..}},
  "default_system": "You are ...",                   a system turn when the conversation has none
  "think": {"open": "<think>", "close": "</think>",
            "prompt": "open" | "none",               the generation prompt opens the channel, or the model does
            "off": "<think></think>" | null,         appended to the generation prompt for thinking=false;
                                                     null: the format cannot turn thinking off (refused)
            "history": "drop" | "empty" | "keep"},   past reasoning: none; empty markers before the last
                                                     user turn (kept after it); always kept
  "effort": {"prefix": .., "suffix": .., "values": {"low": "Low", ..}, "default": "max" | null},
  "stop": ["<|user|>", ..],                          defaults to the control tokens of the assistant suffix
  "image": "<|begin_of_image|><|image|><|end_of_image|>"   markup for one image part
}
Everything else a request may ask for (tools, tool turns...) cannot be written with these strings
and is refused by name, never dropped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .errors import TextError
from .segments import MARKUP, Segment, merge, quote_controls, token_regex

_KEYS = {"prelude", "roles", "default_system", "think", "effort", "stop", "image"}
_MARKER = re.compile(r"<\|[^|<>\s]+\|>|<｜[^｜]+｜>|\[[A-Za-z][A-Za-z0-9_]*\]|</?[A-Za-z][A-Za-z0-9_:]*>")

_KIMI = {
    "roles": {
        "system": {"prefix": "<|im_system|>system<|im_middle|>", "suffix": "<|im_end|>"},
        "user": {"prefix": "<|im_user|>user<|im_middle|>", "suffix": "<|im_end|>"},
        "assistant": {"prefix": "<|im_assistant|>assistant<|im_middle|>", "suffix": "<|im_end|>"},
    },
    # Kimi-Linear's template (K2 format): this system turn when the caller sends none.
    "default_system": "You are Kimi, an AI assistant created by Moonshot AI.",
    "stop": ["<|im_end|>", "[EOS]", "[EOT]"],
}
_GLM5 = {
    "prelude": "[gMASK]<sop>",
    "roles": {
        "system": {"prefix": "<|system|>", "suffix": ""},
        "user": {"prefix": "<|user|>", "suffix": ""},
        "assistant": {"prefix": "<|assistant|>", "suffix": ""},
    },
    # turns end where the next role marker begins, so stop is explicit
    "stop": ["<|user|>", "<|observation|>", "<|endoftext|>"],
    # the generation prompt always opens the channel; the template has no way to keep it closed
    "think": {"open": "<think>", "close": "</think>", "prompt": "open", "off": None, "history": "empty"},
    "effort": {"prefix": "<|system|>Reasoning Effort: ", "suffix": "", "values": {"low": "Low", "high": "High", "max": "Max"}, "default": "max"},
    "image": "<|begin_of_image|><|image|><|end_of_image|>",
}
_CHATML = {
    "roles": {r: {"prefix": f"<|im_start|>{r}\n", "suffix": "<|im_end|>\n"} for r in ("system", "user", "assistant")},
    "stop": ["<|im_end|>", "<|endoftext|>"],
    "think": {"open": "<think>", "close": "</think>", "prompt": "none", "off": "<think>\n\n</think>\n\n", "history": "drop"},
}
# by name: a family's record (waste/models/family.py `chat`) says which one a release without a template gets
CHAT_JSON = {"kimi": _KIMI, "glm5": _GLM5, "chatml": _CHATML}


def default_chat_json(name: str | None) -> dict | None:
    """A built-in chat.json by name (a copy), or None for None or a name we do not have."""
    found = CHAT_JSON.get(name)
    return json.loads(json.dumps(found)) if found is not None else None


def load_chat_json(path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TextError(f"{path}: not a readable chat.json ({e})") from e
    if not isinstance(data, dict):
        raise TextError(f"{path}: chat.json must be an object")
    return data


def markers(chat_json: dict) -> list[str]:
    """Every control marker the format writes: each must be a single token of the vocabulary."""
    found = set()
    for s in _markup_strings(chat_json):
        found.update(_MARKER.findall(s))
    think = chat_json.get("think") or {}
    found.update(s for s in (think.get("open"), think.get("close"), *(chat_json.get("stop") or [])) if isinstance(s, str) and s)
    return sorted(found)


def check_markup(chat_json: dict, vocab_tokens) -> list[str]:
    """The markers of a chat.json that are not single tokens; pass the tokenizer's added tokens."""
    vocab = set(vocab_tokens)
    return [m for m in markers(chat_json) if m not in vocab]


class ChatFormat:
    """A validated chat.json, rendered into the same segments as a Jinja template."""

    def __init__(self, data: dict, vocab_tokens=None):
        problems = _problems(data)
        if not problems and vocab_tokens is not None:
            missing = check_markup(data, vocab_tokens)
            if missing:
                problems.append(f"markup the tokenizer does not carry as single tokens: {', '.join(missing)}")
        if problems:
            raise TextError("chat.json refused: " + "; ".join(problems))
        self.data = data
        self.roles = data["roles"]
        self.think = data.get("think")
        self.effort = data.get("effort")
        self.stop = list(data.get("stop") or _controls_in(self.roles["assistant"].get("suffix", "")))
        self.markers = markers(data)

    def render_segments(
        self, messages, add_generation_prompt=True, control=None, thinking=None, reasoning_effort=None, **unsupported
    ) -> list[Segment]:
        """Segments for a conversation. `control`: control tokens (default: this format's markers)."""
        asked = sorted(k for k, v in unsupported.items() if v not in (None, [], {}))
        if asked:
            raise TextError(f"chat.json cannot express {', '.join(map(repr, asked))}")
        ctl = token_regex(self.markers if control is None else control)
        out = [Segment(MARKUP, self.data.get("prelude", ""))]
        out += self._effort(reasoning_effort, thinking)
        msgs = list(messages)
        if self.data.get("default_system") and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": self.data["default_system"]})
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
        for i, m in enumerate(msgs):
            role = m.get("role")
            if role not in self.roles:
                raise TextError(f"chat.json has no {role!r} turn (message {i})")
            for key in ("tool_calls", "tool_call_id"):
                if m.get(key):
                    raise TextError(f"chat.json cannot express {key!r} (message {i})")
            out.append(Segment(MARKUP, self.roles[role].get("prefix", "")))
            if role == "assistant":
                out += self._history_reasoning(m, i > last_user, ctl)
            out += self._content(m.get("content"), ctl, i)
            out.append(Segment(MARKUP, self.roles[role].get("suffix", "")))
        if add_generation_prompt:
            out.append(Segment(MARKUP, self.roles["assistant"].get("prefix", "")))
            out.append(Segment(MARKUP, self._prompt_think(thinking)))
        return merge(out)

    def starts_in_reasoning(self, thinking=None) -> bool:
        """Whether the generation prompt leaves the model inside the reasoning channel."""
        return bool(self.think) and thinking is not False and self.think.get("prompt") == "open"

    def _effort(self, effort, thinking):
        spec = self.effort
        if spec is None:
            if effort is not None:
                raise TextError("chat.json cannot express 'reasoning_effort'")
            return []
        value = effort if effort is not None else spec.get("default")
        if value is None or thinking is False:
            return []
        if value not in spec["values"]:
            raise TextError(f"reasoning_effort {value!r} is not one of {sorted(spec['values'])}")
        return [Segment(MARKUP, spec.get("prefix", "") + spec["values"][value] + spec.get("suffix", ""))]

    def _prompt_think(self, thinking):
        t = self.think
        if t is None:
            if thinking is not None:
                raise TextError("chat.json cannot express 'thinking' (no think markup)")
            return ""
        if thinking is False:
            if t.get("off") is None:
                raise TextError("chat.json cannot express 'thinking': false (this format always reasons)")
            return t["off"]
        return t["open"] if t.get("prompt") == "open" else ""

    def _history_reasoning(self, m, after_last_user, ctl):
        t = self.think
        if t is None or t.get("history", "drop") == "drop":
            return []
        reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
        if t["history"] == "empty" and not after_last_user:
            reasoning = ""
        return [Segment(MARKUP, t["open"]), *quote_controls(reasoning, ctl), Segment(MARKUP, t["close"])]

    def _content(self, content, ctl, i):
        if content is None:
            return []
        if isinstance(content, str):
            return quote_controls(content, ctl)
        out = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                out += quote_controls(part.get("text", ""), ctl)
            elif kind in ("image", "image_url"):
                if not self.data.get("image"):
                    raise TextError(f"chat.json has no image markup (message {i})")
                out.append(Segment(MARKUP, self.data["image"]))
            else:
                raise TextError(f"chat.json cannot express a {kind!r} content part (message {i})")
        return out


def encode_chat_format(tokenizer, fmt: ChatFormat, messages, **kwargs) -> list[int]:
    """Render a conversation with a chat.json format and encode it."""
    control = tokenizer.control_tokens("\0".join(_markup_strings(fmt.data)))
    return tokenizer.encode_segments(fmt.render_segments(messages, control=control, **kwargs), control)


def _markup_strings(d: dict) -> list[str]:
    out = [d.get("prelude"), d.get("image")]
    for r in (d.get("roles") or {}).values():
        if isinstance(r, dict):
            out += [r.get("prefix"), r.get("suffix")]
    think, effort = d.get("think") or {}, d.get("effort") or {}
    out += [think.get("open"), think.get("close"), think.get("off"), effort.get("prefix"), effort.get("suffix")]
    out += list(d.get("stop") or [])
    return [s for s in out if isinstance(s, str) and s]


def _controls_in(s: str) -> list[str]:
    return _MARKER.findall(s)


def _problems(d) -> list[str]:
    """Structural problems of a chat.json, each a readable reason."""
    if not isinstance(d, dict):
        return ["it must be a JSON object"]
    p = []
    unknown = sorted(set(d) - _KEYS)
    if unknown:
        p.append(f"unknown fields {unknown}")
    roles = d.get("roles")
    if not isinstance(roles, dict):
        return p + ["'roles' is missing"]
    for name, r in roles.items():
        if name not in ("system", "user", "assistant"):
            p.append(f"role {name!r} is not one of system, user, assistant")
        elif not isinstance(r, dict) or not all(isinstance(r.get(k, ""), str) for k in ("prefix", "suffix")):
            p.append(f"roles.{name} needs string 'prefix' and 'suffix'")
    if not isinstance(roles.get("user"), dict):
        p.append("a user turn (roles.user) is required")
    assistant = roles.get("assistant")
    if not isinstance(assistant, dict) or not assistant.get("prefix"):
        p.append("an assistant turn with a prefix (the generation prompt) is required")
    stop = d.get("stop")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        p.append("'stop' must be a list of marker strings")
    elif not stop and not _controls_in((assistant or {}).get("suffix", "") if isinstance(assistant, dict) else ""):
        p.append("the assistant suffix carries no control token and there is no 'stop': replies would never end")
    think = d.get("think")
    if think is not None:
        if not isinstance(think, dict) or not think.get("open") or not think.get("close"):
            p.append("'think' needs 'open' and 'close' markers")
        else:
            if think.get("prompt", "none") not in ("open", "none"):
                p.append("think.prompt must be 'open' or 'none'")
            if think.get("history", "drop") not in ("drop", "empty", "keep"):
                p.append("think.history must be 'drop', 'empty' or 'keep'")
    effort = d.get("effort")
    if effort is not None:
        values = effort.get("values") if isinstance(effort, dict) else None
        if not isinstance(values, dict) or not values or not all(isinstance(v, str) for v in values.values()):
            p.append("'effort' needs a non-empty 'values' mapping to strings")
        elif effort.get("default") is not None and effort["default"] not in values:
            p.append(f"effort.default {effort['default']!r} is not among its values")
    for key in ("prelude", "image", "default_system"):
        if d.get(key) is not None and not isinstance(d[key], str):
            p.append(f"'{key}' must be a string")
    return p
