"""The text half of a conversion: the tokenizer files, the chat format, generation_config.json.

Planned before a byte is written (`plan_text`), installed into the container at the end (`TextPlan.install`):
  - the tokenizer must be reproducible exactly (waste.text.check_reproducible), or the release is refused;
  - a chat template travels as `chat_template.jinja`: copied when the release has the file, otherwise
    written out of tokenizer_config.json's `chat_template` (a string, or a list of named templates:
    "default" becomes chat_template.jinja, the others additional_chat_templates/NAME.jinja, as
    transformers itself saves them);
  - a release with no template gets waste's chat.json for its family, but only when the tokenizer carries
    every marker of it as a single token. An optional section whose markers are missing (think, effort,
    image) is left out; a missing role or stop marker means no chat.json at all, with the markers named
    (chat="require" makes that a refusal of the conversion). The check needs a specials list to check
    against: a tokenizer.json's added tokens, or tokenizer_config.json's added_tokens_decoder for a tiktoken
    release (whose tokenizer_config.json is required anyway); a release without one is no evidence, and the
    chat.json is installed unchecked, for the chat format's own check at load to judge.
The manifest's `text` records every file by key, plus `chat_origin` and `chat_note` (docs/FORMAT.md).
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import WasteError
from ..models import families

CHAT_MODES = ("auto", "require", "none")
PLAIN_FILES = ("generation_config.json", "chat_template.jinja", "chat.json")
OPTIONAL_SECTIONS = ("think", "effort", "image")  # chat.json parts a format can do without
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class TextPlan:
    copies: list[tuple[Path, str]] = field(default_factory=list)  # release file -> path in the container
    writes: dict[str, str] = field(default_factory=dict)  # path in the container -> text to write
    origin: str | None = None  # "release", "tokenizer_config", "waste:FAMILY"; None: no chat format
    note: str | None = None  # what was adjusted, or why there is no chat format

    def install(self, root: Path) -> dict:
        """Write the files into the container directory; returns the manifest's `text` entry."""
        text: dict = {}
        for src, name in self.copies:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / name)
            _record(text, name)
        for name, content in self.writes.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(content, encoding="utf-8")
            _record(text, name)
        if self.origin:
            text["chat_origin"] = self.origin
        if self.note:
            text["chat_note"] = self.note
        return text



def describe_chat(text: dict) -> str:
    """One line for the user from a manifest's `text`: which chat format the container carries, and why."""
    kind = "chat_template.jinja" if text.get("chat_template") else "chat.json" if text.get("chat") else None
    origin, note = text.get("chat_origin"), text.get("chat_note")
    if kind is None:
        return f"none ({(note or 'the release has no chat template').removeprefix('no chat format: ')})"
    where = {"release": "from the release", "tokenizer_config": "from tokenizer_config.json"}.get(
        origin, f"waste's {str(origin).removeprefix('waste:')} format" if origin else "")
    detail = "; ".join(x for x in (where, note) if x)
    return f"{kind} ({detail})" if detail else kind


def _record(text: dict, name: str) -> None:
    if name.startswith("additional_chat_templates/"):
        text.setdefault("chat_templates", {})[Path(name).stem] = name
    else:
        text[name.split(".")[0]] = name


def plan_text(src: Path, family: str, chat: str = "auto") -> TextPlan:
    """Decide every text file of the container, refusing (WasteError) what cannot be reproduced."""
    from ..text.chat_format import ChatFormat, check_markup, default_chat_json
    from ..text.errors import TextError
    from ..text.tokenizer import check_reproducible, load_tokenizer, tokenizer_files

    if chat not in CHAT_MODES:
        raise WasteError(f"unknown chat mode {chat!r}; choose {', '.join(CHAT_MODES)}")
    src = Path(src)
    try:
        check_reproducible(src)
        files = tokenizer_files(src)
    except TextError as e:
        raise WasteError(f"the release's tokenizer cannot be reproduced exactly, so it is not converted: {e}") from None
    plan = TextPlan(copies=[(p, p.name) for p in files])
    plan.copies += [(src / n, n) for n in PLAIN_FILES if (src / n).is_file()]
    extra = src / "additional_chat_templates"
    if extra.is_dir():
        plan.copies += [(p, f"additional_chat_templates/{p.name}") for p in sorted(extra.glob("*.jinja"))]

    config = _tokenizer_config(src)
    embedded = config.get("chat_template")
    if (src / "chat_template.jinja").is_file():
        plan.origin = "release"
    elif embedded:
        plan.origin = "tokenizer_config"
        templates = _named_templates(embedded, src)
        for name, source in templates.items():
            target = "chat_template.jinja" if name == "default" else f"additional_chat_templates/{name}.jinja"
            plan.writes[target] = source
        if "default" not in templates:
            plan.note = f"tokenizer_config.json names no 'default' template (only {', '.join(sorted(templates))})"
    elif extra.is_dir():
        plan.origin = "release"
    elif (src / "chat.json").is_file():  # a release (or a person) already wrote one: kept as it is
        plan.origin = "release"
    if plan.origin is not None:
        return plan

    # No template at all: waste's chat.json for the family, if the vocabulary carries its markup.
    if chat == "none":
        plan.note = "the release has no chat template and the conversion was asked for no chat.json"
        return plan
    data = default_chat_json(families()[family].chat)
    if data is None:
        return _no_chat(plan, chat, f"the release has no chat template and waste has no chat.json for {family}")
    tok = load_tokenizer(src)
    evidence = tok.kind == "tokenizers" or bool(config.get("added_tokens_decoder"))
    if not evidence:
        plan.note = "markers not checked: the release lists no special tokens to check them against"
    else:
        vocab = set(tok.added_tokens)
        dropped, lacks = [], []
        for section in OPTIONAL_SECTIONS:
            gone = check_markup({"roles": {}, section: data[section]}, vocab) if section in data else []
            if gone:
                dropped.append(section)
                lacks += gone
                del data[section]
        missing = check_markup(data, vocab)
        if missing:
            return _no_chat(plan, chat, f"waste's {family} chat.json needs {', '.join(missing)}, which the release's "
                                        "tokenizer does not carry as single tokens")
        if dropped:
            plan.note = f"without {', '.join(dropped)}: the tokenizer lacks {', '.join(dict.fromkeys(lacks))}"
    try:
        ChatFormat(data, vocab_tokens=set(tok.added_tokens) if evidence else None)
    except TextError as e:  # a built-in format is valid; this guards an edit to one
        return _no_chat(plan, chat, str(e))
    plan.writes["chat.json"] = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    plan.origin = f"waste:{family}"
    return plan


def _no_chat(plan: TextPlan, chat: str, reason: str) -> TextPlan:
    if chat == "require":
        raise WasteError(f"no chat format can be installed: {reason} (convert with --chat auto for a completion-only "
                         "container, or add a chat_template.jinja to the release)")
    plan.note = f"no chat format: {reason}"
    return plan


def _tokenizer_config(src: Path) -> dict:
    path = src / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise WasteError(f"{path} is not readable JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _named_templates(value, src: Path) -> dict[str, str]:
    """tokenizer_config.json's chat_template: a string is the default; a list holds {name, template}."""
    if isinstance(value, str):
        return {"default": value}
    where = f"{src / 'tokenizer_config.json'}: chat_template"
    if not isinstance(value, list):
        raise WasteError(f"{where} is neither a string nor a list of named templates")
    out = {}
    for item in value:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)):
            raise WasteError(f"{where} holds an entry that is not {{'name': str, 'template': str}}")
        if not _NAME.fullmatch(item["name"]) or item["name"] in (".", ".."):
            raise WasteError(f"{where}: template name {item['name']!r} is not usable as a file name")
        out[item["name"]] = item["template"]
    return out
