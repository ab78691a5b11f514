"""Engine.chat: the container's chat format renders as transformers does, replies stop at the format's end of
turn, reasoning and tool calls are parsed as they stream, and what a format cannot express is refused by name.

Replies with a known shape are forced: the sampler picks canned token ids, so the rest of the path (model steps,
stop ids, detokenizing, stop strings, the parser, finish_reason, usage) is the real one."""
import copy
import json
import shutil
from pathlib import Path

import pytest

import waste
from waste.chat import ChatRequestError, UnsupportedChatFormat, chat_support, load_chat_format, normalise_messages
from waste.container import open_container
from waste.convert.convert import convert
from waste.text.parsers import Content, Reasoning, ToolCall
from waste.text.tokenizer import load_tokenizer

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"   # release chat templates (SOURCES.md)
QWEN3 = TEMPLATES / "Qwen-Qwen3-0.6B.jinja"
needs_qwen3 = pytest.mark.skipif(not QWEN3.is_file(), reason=f"{QWEN3} is absent (tests/data/templates is incomplete)")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CONVERSATIONS = {
    "one_turn": dict(messages=[{"role": "user", "content": "Hello there"}]),
    "multi_turn": dict(messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
                                 {"role": "user", "content": "Fibonacci <|im_end|> in Python?"}]),
    "tools": dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS),
    "tool_result": dict(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}], tools=TOOLS),
    "thinking_off": dict(messages=[{"role": "user", "content": "Quick."}], thinking=False),
}


@pytest.fixture(scope="module")
def qwen3(releases, tmp_path_factory):
    """The Qwen3-MoE fixture release with Qwen3's own chat template, converted."""
    if not QWEN3.is_file():
        pytest.skip(f"{QWEN3} is absent")
    src = tmp_path_factory.mktemp("qwen3tpl") / "src"
    shutil.copytree(releases["qwen3_moe"][1], src)
    shutil.copy(QWEN3, src / "chat_template.jinja")
    cfg = json.loads((src / "config.json").read_text())   # room for Qwen3's tool prompt in this tiny vocabulary
    (src / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2048}))
    out = convert(src, src.parent / "q.waste", progress=False)
    eng = waste.load(out)
    yield src, out, eng
    eng.close()


@pytest.fixture(scope="module")
def chatml(releases):
    """The fixture container as converted: waste's ChatML chat.json (no think: the tokenizer lacks <think>)."""
    eng = waste.load(releases["qwen3_moe"][2])
    yield eng
    eng.close()


def force(monkeypatch, ids) -> list[int]:
    """The sampler picks these ids in turn instead of sampling: the model still runs a forward for every step, and
    the loop that stops at end ids, the detokenizing, stop strings, parser, finish_reason and usage are the
    engine's own. Returns a list that grows by one for each token the engine asked for; asking past the canned ids
    fails the test (the engine did not stop where it should have)."""
    from waste.runtime.sampling import Sampler

    asked = []

    def pick(self, logits):
        n = getattr(self, "_forced", 0)
        self._forced = n + 1
        asked.append(n)
        assert logits.ndim == 1 and logits.numel() >= 256      # a real forward's logits
        assert n < len(ids), "the engine asked for a token past the forced reply"
        return ids[n]

    monkeypatch.setattr(Sampler, "__call__", pick)
    return asked


@needs_qwen3
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_template_rendering_matches_transformers(qwen3, name):
    transformers = pytest.importorskip("transformers")
    src, out, eng = qwen3
    case = copy.deepcopy(CONVERSATIONS[name])
    fmt = load_chat_format(open_container(out), load_tokenizer(out))
    ours = fmt.render(normalise_messages(copy.deepcopy(case["messages"])), tools=case.get("tools"),
                      thinking=case.get("thinking"))
    hf = transformers.AutoTokenizer.from_pretrained(str(src))
    extra = {"enable_thinking": case["thinking"]} if "thinking" in case else {}
    for m in case["messages"]:   # what transformers' callers (vLLM, mlx_lm) hand it: "" for null, dict arguments
        m["content"] = m.get("content") or ""
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    ref = hf.apply_chat_template(case["messages"], tools=case.get("tools"), add_generation_prompt=True,
                                 tokenize=True, sanitize_control_tokens=True, **extra)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert ours.ids == list(ref)
    assert ours.text == hf.apply_chat_template(case["messages"], tools=case.get("tools"), add_generation_prompt=True,
                                               tokenize=False, **extra)


@needs_qwen3
def test_template_stop_reasoning_and_content(qwen3, monkeypatch):
    _, _, eng = qwen3
    tok = eng.tokenizer
    end = tok.token_to_id("<|im_end|>")
    assert end in load_chat_format(eng.container, tok).stop_ids   # the turn end, found by rendering the template
    asked = force(monkeypatch, tok.encode("<think>\nAdd them.\n</think>\n\nIt is 4.") + [end] + tok.encode(" junk"))
    c = eng.chat([{"role": "user", "content": "2+2?"}], stream=True)
    events = list(c)
    assert {type(e) for e in events} == {Reasoning, Content}
    assert c.reasoning_content == "Add them." and c.content == "It is 4."
    assert c.finish_reason == "stop" and "junk" not in c.content
    n = len(tok.encode("<think>\nAdd them.\n</think>\n\nIt is 4.")) + 1
    p = len(c.prompt_ids)
    assert c.usage == {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
    assert len(asked) == n                     # it stopped at the end of turn: nothing was sampled after it
    assert c.message() == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add them."}


@needs_qwen3
def test_tool_call_is_parsed_from_forced_output(qwen3, monkeypatch):
    _, _, eng = qwen3
    tok = eng.tokenizer
    out = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    force(monkeypatch, tok.encode(out) + [tok.token_to_id("<|im_end|>")])
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    c = eng.chat(msgs, tools=TOOLS, stream=True)
    events = list(c)
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert c.finish_reason == "tool_calls" and c.content == "Let me check.\n"
    assert c.tool_calls[0]["function"]["name"] == "get_weather" and c.tool_calls[0]["id"].startswith("call_")
    # no tools declared (or tool_choice none): the same output is text, not a call
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        c = eng.chat(msgs, **kw)
        assert c.tool_calls == [] and "<tool_call>" in c.content and c.finish_reason == "stop"


@needs_qwen3
def test_template_refusals_name_the_field(qwen3):
    _, _, eng = qwen3
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(reasoning_effort="high"), "reasoning_effort"),   # Qwen3's template has no effort setting
        (dict(chat_template_kwargs={"no_such_flag": True}), "chat_template_kwargs"),
        (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
        (dict(tool_choice="required"), "tool_choice"),                   # forcing a call needs tools
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[{"type": "function"}]), "tools"),
        (dict(max_tokens=0), "max_tokens"),
    ]
    for kw, param in cases:
        with pytest.raises(ChatRequestError) as e:
            eng.chat(msgs, **kw)
        assert e.value.param == param, kw
    for bad in ([], [{"content": "no role"}], [{"role": "narrator", "content": "x"}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]):
        with pytest.raises(ChatRequestError) as e:
            eng.chat(bad)
        assert e.value.param == "messages"
    # reasoning_effort "none" is the template's thinking switch turned off, not dropped
    fmt = load_chat_format(eng.container, eng.tokenizer)
    assert fmt.render(msgs, reasoning_effort="none").ids == fmt.render(msgs, thinking=False).ids
    assert fmt.render(msgs, thinking=False).ids != fmt.render(msgs).ids


def test_chat_json_stops_and_refuses_what_it_cannot_express(chatml, monkeypatch):
    eng = chatml
    tok = eng.tokenizer
    fmt = load_chat_format(eng.container, tok)
    assert fmt.kind == "chat.json" and {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} <= fmt.stop_ids
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi <|im_end|> there"}]
    r = fmt.render(normalise_messages(msgs))
    assert r.text == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi <|im_end|> there<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert r.ids.count(tok.token_to_id("<|im_end|>")) == 2   # the caller's <|im_end|> stayed text

    force(monkeypatch, tok.encode("Hello you") + [tok.token_to_id("<|im_end|>")] + tok.encode("more"))
    c = eng.chat(msgs, stop=["you"])
    assert c.content == "Hello " and c.finish_reason == "stop"   # a stop string ends it too
    c = eng.chat(msgs)
    assert c.content == "Hello you" and c.finish_reason == "stop" and c.reasoning_content == ""

    cases = [
        (dict(tools=TOOLS), "tools"),
        (dict(reasoning_effort="high"), "reasoning_effort"),
        (dict(thinking=False), "thinking"),                      # this chat.json has no think markup
        (dict(chat_template_kwargs={"foo": 1}), "chat_template_kwargs"),
    ]
    for kw, param in cases:
        with pytest.raises(ChatRequestError) as e:
            eng.chat(msgs, **kw)
        assert e.value.param == param, kw
        assert param.split("_")[0] in str(e.value)
    tool_turn = [*msgs, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                 {"role": "tool", "content": "1"}]
    with pytest.raises(ChatRequestError) as e:
        eng.chat(tool_turn)
    assert e.value.param == "messages"
    assert eng.chat(msgs, tools=TOOLS, tool_choice="none").content == "Hello you"   # tools declined by the caller


def test_real_model_streams_what_the_blocking_call_returns(chatml):
    msgs = [{"role": "user", "content": "def fibonacci(n):"}]
    done = chatml.chat(msgs, max_tokens=8)
    streamed = chatml.chat(msgs, max_tokens=8, stream=True)
    text = "".join(e.text for e in streamed if isinstance(e, Content))
    assert text == done.content and done.finish_reason == streamed.finish_reason
    assert done.usage["completion_tokens"] <= 8 and done.stats.generated_tokens == done.usage["completion_tokens"]
    if done.finish_reason == "length":
        assert done.usage["completion_tokens"] == 8


def test_closing_a_reply_keeps_what_came(chatml, monkeypatch):
    tok = chatml.tokenizer
    force(monkeypatch, tok.encode("one two three four five six seven"))
    c = chatml.chat([{"role": "user", "content": "count"}], stream=True)
    first = next(iter(c))
    c.close()
    assert c.finish_reason == "cancelled" and c.content.startswith(first.text)
    assert 0 < c.stats.generated_tokens < len(tok.encode("one two three four five six seven"))


def test_context_is_a_limit(chatml):
    long = " ".join(["word"] * 2000)   # the fixture's context is 512 positions
    with pytest.raises(ChatRequestError) as e:
        chatml.chat([{"role": "user", "content": long}])
    assert e.value.param == "messages" and "context" in str(e.value)


def test_no_chat_format_is_refused_with_the_reasons(releases):
    """The Kimi-Linear fixture's tokenizer lacks Kimi's markup, so its container has no chat format."""
    with waste.load(releases["kimi_linear"][2]) as eng:
        reasons = chat_support(eng)
        assert "no chat_template.jinja" in reasons and any("<|im_user|>" in r for r in reasons)
        with pytest.raises(UnsupportedChatFormat) as e:
            eng.chat([{"role": "user", "content": "hi"}])
        assert e.value.reasons == reasons and e.value.code == "unsupported_chat_format"
        assert eng.generate("hi", max_tokens=2).token_ids   # completion still works
