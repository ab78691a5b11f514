"""The converter's text half: a chat.json per family when the release has no template, refused when the
tokenizer lacks its markup (only with a specials list to check against), embedded templates written out,
and an irreproducible tokenizer refused before anything is written."""
import base64
import json
import shutil
import subprocess
import sys

import pytest

from fixtures import TOKENIZER_TEXT
from waste.chat import UnsupportedChatFormat, load_chat_format
from waste.container import open_container
from waste.convert.convert import convert
from waste.convert.synthetic import write_tokenizer
from waste.errors import WasteError
from waste.text.chat_format import default_chat_json, markers
from waste.text.tokenizer import KIMI_PATTERN_BRANCHES, load_tokenizer

from waste.models import families

FAMILIES = [f.name for f in families().values() if f.chat]   # the families with a built-in chat.json


def builtin_chat(family: str) -> dict:
    return default_chat_json(families()[family].chat)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_TEMPLATE = "{{ tools | tojson }}<tool_call>" + TEMPLATE


def release(tmp_path, releases, family, specials=None, name="src"):
    """A copy of the family's fixture release, with a tokenizer carrying `specials` when given."""
    dst = tmp_path / name
    if family in releases:
        shutil.copytree(releases[family][1], dst)
    else:        # glm5_next is not among conftest's session releases (few tests need it): built here
        from fixtures import save_release
        from test_oracle_glm5 import glm5_model

        save_release(glm5_model(), dst)
    if specials is not None:
        write_tokenizer(dst, TOKENIZER_TEXT, vocab_size=300, specials=tuple(specials))
    return dst


def text_of(out):
    return json.loads((out / "manifest.json").read_text())["text"]


def chat_format_of(out):
    return load_chat_format(open_container(out), load_tokenizer(out))


@pytest.mark.parametrize("family", FAMILIES)
def test_family_chat_json_is_installed_when_the_tokenizer_carries_it(tmp_path, releases, family):
    want = builtin_chat(family)
    src = release(tmp_path, releases, family, specials=["<|endoftext|>", *markers(want)])
    out = convert(src, tmp_path / "o.waste", progress=False, chat="require")
    assert json.loads((out / "chat.json").read_text()) == want
    text = text_of(out)
    assert text["chat"] == "chat.json" and text["chat_origin"] == f"waste:{family}" and "chat_note" not in text
    assert "chat_template" not in text
    fmt = chat_format_of(out)
    tok = load_tokenizer(out)
    assert fmt.kind == "chat.json"
    assert {tok.token_to_id(s) for s in want["stop"]} <= fmt.stop_ids


@pytest.mark.parametrize("family,specials", [
    ("qwen3_moe", ["<|endoftext|>"]),            # a completion model's tokenizer: no ChatML at all
    ("kimi_linear", None),                       # the fixture's ChatML tokenizer: no <|im_user|> and friends
])
def test_missing_markup_is_refused_and_named(tmp_path, releases, family, specials):
    src = release(tmp_path, releases, family, specials)
    vocab = set(load_tokenizer(src).added_tokens)
    missing = [m for m in markers(builtin_chat(family)) if m not in vocab and m not in ("<think>", "</think>")]
    assert missing
    with pytest.raises(WasteError) as e:
        convert(src, tmp_path / "strict.waste", progress=False, chat="require")
    assert all(m in str(e.value) for m in missing), str(e.value)
    assert not any(tmp_path.glob("strict.waste*"))   # refused before writing

    out = convert(src, tmp_path / "auto.waste", progress=False)   # auto: a completion-only container, saying why
    assert not (out / "chat.json").exists()
    note = text_of(out)["chat_note"]
    assert all(m in note for m in missing) and "chat" not in text_of(out)
    with pytest.raises(UnsupportedChatFormat) as e:
        chat_format_of(out)
    assert all(m in str(e.value) for m in missing) and "no chat_template.jinja" in e.value.reasons

    if family == "kimi_linear":   # the command line says the same, without a traceback
        p = subprocess.run([sys.executable, "-m", "waste", "convert", src, tmp_path / "cli.waste", "--chat", "require"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 1 and "Traceback" not in p.stderr and missing[0] in p.stderr


def test_optional_sections_without_markers_are_left_out(releases):
    """The fixture tokenizer has ChatML but no <think>: the Qwen chat.json goes in without its think section."""
    out = releases["qwen3_moe"][2]
    data = json.loads((out / "chat.json").read_text())
    want = builtin_chat("qwen3_moe")
    del want["think"]
    assert data == want
    assert "without think" in text_of(out)["chat_note"] and "<think>" in text_of(out)["chat_note"]
    assert chat_format_of(out).markup.think is None


def test_no_specials_list_is_no_evidence(tmp_path, releases):
    """A tiktoken release whose tokenizer_config.json lists no added tokens names no special tokens: the
    chat.json is installed unchecked (the converter cannot know), and the chat format's own check refuses it
    at use."""
    src = release(tmp_path, releases, "kimi_linear")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TikTokenTokenizer"}))
    (src / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    (src / "tokenization_kimi.py").write_text("\n".join(KIMI_PATTERN_BRANCHES))
    out = convert(src, tmp_path / "o.waste", progress=False, chat="require")
    assert json.loads((out / "chat.json").read_text()) == builtin_chat("kimi_linear")
    assert "not checked" in text_of(out)["chat_note"]
    assert (out / "tokenization_kimi.py").is_file() and load_tokenizer(out).kind == "tiktoken"
    with pytest.raises(UnsupportedChatFormat, match="<\\|im_user\\|>"):
        chat_format_of(out)


def test_embedded_template_string_is_written_out(tmp_path, releases):
    src = release(tmp_path, releases, "kimi_linear")   # no chat.json markup needed: the release has a template
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    out = convert(src, tmp_path / "o.waste", progress=False, chat="require")
    assert (out / "chat_template.jinja").read_text() == TEMPLATE and not (out / "chat.json").exists()
    text = text_of(out)
    assert text["chat_template"] == "chat_template.jinja" and text["chat_origin"] == "tokenizer_config"
    fmt = chat_format_of(out)
    assert fmt.kind == "chat_template"
    rendered = fmt.render([{"role": "user", "content": "hi"}])
    assert rendered.text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert load_tokenizer(out).token_to_id("<|im_end|>") in fmt.stop_ids   # the turn end, found by rendering


def test_named_templates_are_written_out_and_tool_use_serves_tools(tmp_path, releases):
    src = release(tmp_path, releases, "qwen3_moe")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": TOOL_TEMPLATE}]
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = convert(src, tmp_path / "o.waste", progress=False)
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == TOOL_TEMPLATE
    assert text_of(out)["chat_templates"] == {"tool_use": "additional_chat_templates/tool_use.jinja"}
    fmt = chat_format_of(out)
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert fmt.render(msgs).text.startswith("<|im_start|>user")
    assert fmt.render(msgs, tools=tools).text.startswith('[{"type": "function"')


def test_release_template_file_wins_and_is_kept(tmp_path, releases):
    src = release(tmp_path, releases, "qwen3_moe")
    (src / "chat_template.jinja").write_text(TEMPLATE)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{{ 'other' }}"}))
    out = convert(src, tmp_path / "o.waste", progress=False)
    assert (out / "chat_template.jinja").read_text() == TEMPLATE and not (out / "chat.json").exists()
    assert text_of(out)["chat_origin"] == "release"


@pytest.mark.parametrize("change,reason", [
    (lambda d: _config(d, tokenizer_class="LlamaTokenizer"), "LlamaTokenizer"),
    (lambda d: _config(d, eos_token="<|not_a_token|>"), "<|not_a_token|>"),
    (lambda d: ((d / "tokenizer.json").unlink(), (d / "tokenizer.model").write_bytes(b"\0")), "SentencePiece"),
])
def test_irreproducible_tokenizer_is_refused_before_writing(tmp_path, releases, change, reason):
    src = release(tmp_path, releases, "qwen3_moe")
    change(src)
    with pytest.raises(WasteError) as e:
        convert(src, tmp_path / "o.waste", progress=False)
    assert "cannot be reproduced exactly" in str(e.value) and reason in str(e.value)
    assert not any(tmp_path.glob("o.waste*"))


def _config(d, **kw):
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **kw}))
