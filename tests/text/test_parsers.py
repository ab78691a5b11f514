"""Output parsing on hand-written model outputs: one-shot, char by char and in random chunks (all
three must agree), cuts inside markers, malformed and unfinished calls kept as content."""

import json
import random
import zlib
from pathlib import Path

import pytest

from waste.text.parsers import (
    MARKUPS,
    Content,
    OutputParser,
    Reasoning,
    ToolCall,
    collect,
    markup_for,
    parse_output,
    parser_for,
)

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"   # release chat templates (SOURCES.md)

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}]


def ids(i):
    return f"call_{i}"


def call(name, args, call_id):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


# (markup, starts in reasoning, output, expected message)
CASES = {
    "hermes": (
        "hermes", False,
        '<think>\nLet me check.\n</think>\n\nSure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "days": 3}}\n</tool_call>',
        {"content": "Sure.\n\n", "reasoning_content": "Let me check.",
         "tool_calls": [call("get_weather", {"city": "Paris"}, "call_0"), call("get_weather", {"city": "東京", "days": 3}, "call_1")]},
    ),
    "glm45": (
        "glm", False,
        "<think>hmm</think>Ok.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n</tool_call>",
        {"content": "Ok.", "reasoning_content": "hmm", "tool_calls": [call("get_weather", {"city": "Paris", "days": 2, "zip": "75001"}, "call_0")]},
    ),
    "glm5": (
        "glm", True,
        "reasoning goes here</think>Checking<tool_call>get_weather<arg_key>city</arg_key><arg_value>New York</arg_value>"
        "<arg_key>days</arg_key><arg_value>5</arg_value></tool_call>",
        {"content": "Checking", "reasoning_content": "reasoning goes here", "tool_calls": [call("get_weather", {"city": "New York", "days": 5}, "call_0")]},
    ),
    "kimi_k2": (
        "kimi_k2", False,
        "<think>plan</think>Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
        '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>',
        {"content": "Let me look.", "reasoning_content": "plan",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Beijing"}'}},
                        {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    ),
    "xtml": (
        "xtml", True,
        "I should check the weather.<|close|>think<|sep|><|open|>response<|sep|>Visible answer.<|close|>response<|sep|>"
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>'
        'Seoul<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
        '<|open|>argument key="opts" type="object"<|sep|>{"unit": "C"}<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="a&quot;b&amp;c" index="2"<|sep|><|open|>json type="object"<|sep|>{"q": [1, true, null]}'
        "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
        {"content": "Visible answer.", "reasoning_content": "I should check the weather.",
         "tool_calls": [call("get_weather", {"city": "Seoul", "days": 3, "opts": {"unit": "C"}}, "call_0"), call('a"b&c', {"q": [1, True, None]}, "call_1")]},
    ),
    "dsml": (
        "dsml", True,
        'Look it up.</think>Sure.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris 75</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"unit": ["C"]}</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
        {"content": "Sure.", "reasoning_content": "Look it up.",
         "tool_calls": [call("get_weather", {"city": "Paris 75", "days": 3, "opts": {"unit": ["C"]}}, "call_0"),
                        call("get_time", {}, "call_1")]},
    ),
    "plain_think": ("think", False, "<think>\nx\n</think>\n\nanswer", {"content": "answer", "reasoning_content": "x", "tool_calls": None}),
    "no_markup": ("plain", False, "just <b>text</b> <think>", {"content": "just <b>text</b> <think>", "reasoning_content": None, "tool_calls": None}),
}

MALFORMED = {
    "hermes_bad_json": ("hermes", '<tool_call>{"name": get_weather}</tool_call>after'),
    "hermes_no_name": ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    "glm_text_between": ("glm", "<tool_call>f<arg_key>a</arg_key>junk<arg_value>1</arg_value></tool_call>"),
    "glm_no_name": ("glm", "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"),
    "kimi_bad_args": ("kimi_k2", "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{city: x}<|tool_call_end|>"),
    "kimi_no_args": ("kimi_k2", "<|tool_call_begin|>functions.f:0<|tool_call_end|>"),
    "dsml_bad_json": ("dsml", '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">three</｜DSML｜parameter>\n</｜DSML｜invoke>after'),
    "dsml_text_between": ("dsml", '<｜DSML｜invoke name="f">junk<｜DSML｜parameter name="a" string="true">1</｜DSML｜parameter></｜DSML｜invoke>'),
    "dsml_no_name": ("dsml", '<｜DSML｜invoke>\n</｜DSML｜invoke>'),
    "xtml_bad_element": ("xtml", '<|open|>call tool="f"<|sep|><|open|>weird<|sep|>x<|close|>weird<|sep|><|close|>call<|sep|>'),
    "xtml_bad_number": ("xtml", '<|open|>call tool="f"<|sep|><|open|>argument key="n" type="number"<|sep|>three<|close|>argument<|sep|><|close|>call<|sep|>'),
}


def parse_in_chunks(markup, start, text, sizes):
    p = OutputParser(MARKUPS[markup], tools=WEATHER, start_in_reasoning=start, id_factory=ids)
    events, i = [], 0
    for n in sizes:
        events += p.feed(text[i : i + n])
        i += n
    events += p.feed(text[i:]) + p.finish()
    return events


def chunkings(text, seed):
    rng = random.Random(seed)
    yield [1] * len(text)  # char by char
    for _ in range(30):
        sizes, total = [], 0
        while total < len(text):
            sizes.append(rng.randint(1, 12))
            total += sizes[-1]
        yield sizes


@pytest.mark.parametrize("name", CASES)
def test_outputs_parse_the_same_in_any_chunking(name):
    markup, start, text, expected = CASES[name]
    one = parse_output(OutputParser(MARKUPS[markup], tools=WEATHER, start_in_reasoning=start, id_factory=ids), text)
    assert one == expected
    for sizes in chunkings(text, zlib.crc32(name.encode())):     # not hash(): salted per process
        assert collect(parse_in_chunks(markup, start, text, sizes)) == one


@pytest.mark.parametrize("name", CASES)
def test_every_prefix_is_consistent(name):
    """An output cut anywhere (max_tokens) parses the same streamed as one-shot, and loses no text."""
    markup, start, text, _ = CASES[name]
    for cut in range(len(text) + 1):
        prefix = text[:cut]
        one = parse_output(OutputParser(MARKUPS[markup], tools=WEATHER, start_in_reasoning=start, id_factory=ids), prefix)
        assert collect(parse_in_chunks(markup, start, prefix, [1] * cut)) == one, prefix


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_calls_are_kept_as_content(name):
    markup, text = MALFORMED[name]
    for sizes in chunkings(text, 7):
        events = parse_in_chunks(markup, False, text, sizes)
        assert not any(isinstance(e, ToolCall) for e in events)
        assert collect(events)["content"] == text


def test_unfinished_call_is_content_and_later_calls_still_parse():
    text = "A<tool_call>\n{\"name\": \"f\", \"argum"
    assert parse_output(OutputParser(MARKUPS["hermes"]), text)["content"] == text
    text = 'x<tool_call>{"name": broken}</tool_call>y<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    msg = parse_output(OutputParser(MARKUPS["hermes"], id_factory=ids), text)
    assert msg["content"] == 'x<tool_call>{"name": broken}</tool_call>y'
    assert msg["tool_calls"] == [call("g", {}, "call_0")]  # indices count parsed calls only


def test_partial_markers_are_held_back():
    p = OutputParser(MARKUPS["hermes"], id_factory=ids)
    assert p.feed("Hello <tool") == [Content("Hello ")]
    assert p.feed("box") == [Content("<toolbox")]
    assert p.feed("<thi") == []
    assert p.feed("nk>deep") == [Reasoning("deep")]
    assert p.feed("</thi") == []
    assert p.finish() == [Reasoning("</thi")]
    k3 = OutputParser(MARKUPS["xtml"], start_in_reasoning=True)
    assert k3.feed("a<|close|>think<|sep") == [Reasoning("a")]
    assert k3.feed("|><|open|>response<|sep|>b<|clo") == [Content("b")]
    assert k3.finish() == [Content("<|clo")]


def test_tool_call_shapes():
    c = ToolCall(0, "call_x", "f", '{"a": 1}')
    assert c.as_delta() == {"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert c.as_openai() == {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    default_ids = parse_output(OutputParser(MARKUPS["hermes"]), '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert default_ids["tool_calls"][0]["id"].startswith("call_") and len(default_ids["tool_calls"][0]["id"]) == 29


def test_glm_values_follow_the_tool_schema():
    text = "<tool_call>get_weather<arg_key>zip</arg_key><arg_value>007</arg_value><arg_key>days</arg_key><arg_value>7</arg_value></tool_call>"
    typed = parse_output(OutputParser(MARKUPS["glm"], tools=WEATHER), text)["tool_calls"][0]["function"]["arguments"]
    assert json.loads(typed) == {"zip": "007", "days": 7}
    untyped = parse_output(OutputParser(MARKUPS["glm"]), text)["tool_calls"][0]["function"]["arguments"]
    assert json.loads(untyped) == {"zip": "007", "days": 7}  # "007" is not JSON: kept as text


def test_picking_the_parser():
    assert markup_for(None).name == "plain" and markup_for("{{ messages }}").name == "plain"
    glm = (TEMPLATES / "GLM-5.3-Flash.jinja").read_text() if TEMPLATES.is_dir() else "<arg_key>"
    p = parser_for(glm, prompt="[gMASK]<sop><|user|>hi<|assistant|><think>")
    assert p.markup.name == "glm" and p.start_in_reasoning
    assert not parser_for(glm, prompt="<|user|>hi<|assistant|><think></think>").start_in_reasoning
    p = parser_for(template="{{ '<think>' }}", think=("<seed:think>", "</seed:think>"), prompt="x<seed:think>")
    assert p.markup.think == ("<seed:think>", "</seed:think>") and p.start_in_reasoning


@pytest.mark.skipif(not TEMPLATES.is_dir(), reason=f"{TEMPLATES} is absent (tests/data/templates is incomplete)")
def test_parser_from_each_shipped_template():
    expect = {
        "Kimi-K3": "xtml", "moonshotai-Kimi-K2": "kimi_k2", "moonshotai-Kimi-K2-Thinking": "kimi_k2",
        "Kimi-K2-Thinking": "kimi_k2", "GLM-4.6": "glm", "glm_4_5": "glm", "GLM-5.3-Flash": "glm",
        "GLM-5.3-Flash-0xSero-EXL3": "glm", "Qwen-Qwen3-0.6B": "hermes", "DeepSeek-V3.2": "dsml",
    }  # fmt: skip
    for path in sorted(TEMPLATES.glob("*.jinja")):
        markup = markup_for(template=path.read_text())
        if path.stem in expect:
            assert markup.name == expect[path.stem], path.stem
    assert markup_for(template=(TEMPLATES / "moonshotai-Kimi-K2.jinja").read_text()).think is None
    assert markup_for(template=(TEMPLATES / "moonshotai-Kimi-K2-Thinking.jinja").read_text()).think == ("<think>", "</think>")


def test_whitespace_before_the_first_think_is_not_content():
    """GLM-4.5 / 4.6 open a reply with "\\n<think>": that newline is neither content nor reasoning, whether the
    text comes whole or a character at a time; whitespace followed by anything else is kept."""
    text = '\n<think>Add them.</think>\nIt is 4.'
    whole = parse_output(OutputParser(MARKUPS["glm"]), text)
    p = OutputParser(MARKUPS["glm"])
    pieces = collect([e for ch in text for e in p.feed(ch)] + p.finish())
    assert whole == pieces == {"content": "It is 4.", "reasoning_content": "Add them.", "tool_calls": None}
    assert parse_output(OutputParser(MARKUPS["glm"]), "\n It is 4.")["content"] == "\n It is 4."
    assert parse_output(OutputParser(MARKUPS["glm"]), "\n\n")["content"] == "\n\n"
    call = parse_output(OutputParser(MARKUPS["glm"]), "\n<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>")
    assert call["content"] == "\n" and call["tool_calls"][0]["function"]["name"] == "f"
