"""gpt-oss's text side: the release's harmony template (tests/data/templates/openai-gpt-oss-120b.jinja) on a tiny
gpt-oss container whose tokenizer carries the harmony markers as special tokens; replies parsed into
`reasoning_content` (the analysis channel) and `tool_calls` (messages to functions.NAME) through Engine.chat, the
server and `waste chat`. Replies with a known shape are forced (the sampler's choice is replaced), so the rest of
the path (end ids, detokenizing, the parser, finish_reason) is the real one. openai-harmony (OpenAI's own renderer
and parser) is the second reference where its o200k vocabulary is on this machine."""
import io
import json
import os
import re
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from serve_util import ThreadServer, sse_events
from test_chat_kimi_k3 import force_generation
from test_oracle_gpt_oss import gpt_oss_model

import waste
from waste.convert.convert import convert
from waste.convert.synthetic import write_tokenizer
from waste.engine import Decoding
from waste.serve.app import ServerState
from waste.text.harmony import HarmonyParser
from waste.text.parsers import MARKUPS, collect, parser_for

TEMPLATE = Path(__file__).resolve().parent / "data" / "templates" / "openai-gpt-oss-120b.jinja"
pytestmark = pytest.mark.skipif(not TEMPLATE.is_file(), reason=f"{TEMPLATE} is absent")
SPECIALS = ("<|return|>", "<|endoftext|>", "<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
            "<|constrain|>", "<|call|>")
MARKERS = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
CORPUS = ("The user wants the weather. Checking the weather now. get_weather city Paris days 3 temp 21 "
          "It is sunny. analysis final commentary functions json assistant user system ") * 4
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# after the prompt's `<|start|>assistant`: reasoning, a preamble, then a call (its <|call|> is an end id)
CALL = ('<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary'
        '<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
        '<|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>')
ANSWER = ('<|channel|>analysis<|message|>Fine.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.'
          '<|return|>')


def parse(text, tools=True, chunk=None):
    markup = MARKUPS["harmony"]
    if not tools:
        markup = MARKUPS["harmony"].__class__(**{**markup.__dict__, "call_open": ()})
    p = HarmonyParser(markup, id_factory=lambda i: f"call_{i}")
    pieces = [text] if chunk is None else [text[i:i + chunk] for i in range(0, len(text), chunk)]
    return collect([e for s in pieces for e in p.feed(s)] + p.finish())


def test_parser_channels_calls_and_streaming():
    whole = parse(CALL.removesuffix("<|call|>"))       # as the engine hands it over: end ids are not text
    assert whole == {"content": "Checking.", "reasoning_content": "The user wants the weather.",
                     "tool_calls": [{"id": "call_0", "type": "function", "function": {
                         "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]}
    for n in (1, 3, 7):                                # any split of the stream gives the same message
        assert parse(CALL.removesuffix("<|call|>"), chunk=n) == whole
    assert parse(ANSWER.removesuffix("<|return|>")) == {"content": "It is sunny.", "reasoning_content": "Fine.",
                                                        "tool_calls": None}
    # the recipient in the role header, the content type without <|constrain|>
    alt = parse('<|channel|>analysis<|message|>r<|end|><|start|>assistant to=functions.f<|channel|>commentary json'
                '<|message|>{}')
    assert alt["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_parser_keeps_what_is_not_a_call_as_text():
    bad = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city": '
    got = parse(bad)
    assert got["tool_calls"] is None and got["content"].endswith('<|message|>{"city": ')
    assert "to=functions.f" in got["content"]
    assert parse(bad.replace('{"city": ', '{"a": 1}'), tools=False)["tool_calls"] is None
    assert parse("no harmony here at all")["content"] == "no harmony here at all"
    assert parse("x" * 300)["content"] == "x" * 300


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("osschat")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src = root / "src"
    src.mkdir()
    n = write_tokenizer(src, CORPUS, vocab_size=300, specials=SPECIALS)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    eos = [tok.token_to_id(s) for s in ("<|return|>", "<|endoftext|>", "<|call|>")]
    gpt_oss_model(vocab_size=n, eos_token_id=eos[0], pad_token_id=eos[1], max_position_embeddings=2048).save_pretrained(src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": eos[1]}))
    shutil.copy(TEMPLATE, src / "chat_template.jinja")
    eng = waste.load(convert(src, root / "oss.waste", experts="bf16", trunk="bf16", progress=False))
    yield eng
    eng.close()
    torch.set_num_threads(threads)


def ids_of(tok, text: str) -> list[int]:
    """Model output as token ids: harmony markers as their special ids, the rest as text."""
    return [i for part in MARKERS.split(text) if part
            for i in ([tok.token_to_id(part)] if MARKERS.fullmatch(part) else tok.encode(part))]


def test_template_renders_and_stops(oss):
    fmt = oss.chat_format()
    tok = oss.tokenizer
    assert {tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")} <= fmt.stop_ids
    r = fmt.render(ASK, tools=TOOLS, reasoning_effort="high")
    assert r.text.endswith("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")
    assert "Reasoning: high" in r.text and "type get_weather = (_: {" in r.text
    assert isinstance(r.parser, HarmonyParser) and r.parser.calls
    msg = tok.token_to_id("<|message|>")
    assert r.ids.count(msg) == r.text.count("<|message|>") == 3     # markup as control tokens: system, developer, user
    inj = fmt.render([{"role": "user", "content": "say <|message|>x"}])     # caller text spelling a marker stays text
    assert inj.ids.count(msg) == fmt.render(ASK).ids.count(msg) == 2


def test_engine_chat_reasoning_tool_call_and_result_round_trip(oss, monkeypatch):
    tok = oss.tokenizer
    force_generation(monkeypatch, ids_of(tok, CALL) + tok.encode(" junk"))
    c = oss.chat(ASK, tools=TOOLS, max_tokens=200)
    assert c.reasoning_content == "The user wants the weather." and c.content == "Checking."
    assert c.finish_reason == "tool_calls" and len(c.tool_calls) == 1
    call = c.tool_calls[0]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    # the call, its reasoning (as the template's `thinking`) and the result go back in harmony
    # (the template takes reasoning or content beside a call, not both: the preamble is left out)
    history = [*ASK, c.message(), {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}]
    text = oss.chat_format().render(history, tools=TOOLS).text
    assert ("<|start|>assistant<|channel|>analysis<|message|>The user wants the weather.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris", "days": 3}<|call|>') in text
    assert "Checking." not in text
    assert ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 21}"<|end|>'
            '<|start|>assistant') in text
    force_generation(monkeypatch, ids_of(tok, ANSWER))
    c2 = oss.chat(history, tools=TOOLS, max_tokens=64)
    assert c2.content == "It is sunny." and c2.reasoning_content == "Fine."
    assert c2.tool_calls == [] and c2.finish_reason == "stop"


@pytest.fixture(scope="module")
def server(oss):
    srv = ThreadServer(ServerState(engine=oss))
    yield srv
    srv.stop()


def test_server_chat_route(oss, server, monkeypatch):
    force_generation(monkeypatch, ids_of(oss.tokenizer, CALL))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="oss", messages=ASK, tools=TOOLS, max_tokens=200, reasoning_effort="low")
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Checking."
    assert m.reasoning_content == "The user wants the weather."
    assert m.tool_calls[0].function.name == "get_weather"
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "model": "oss", "messages": ASK, "tools": TOOLS, "max_tokens": 200, "stream": True}) as s:
        events = sse_events(s.iter_lines())
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user wants the weather."
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Paris", "days": 3}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    follow = [*ASK, m.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": '{"temp": 21}'}]
    force_generation(monkeypatch, ids_of(oss.tokenizer, ANSWER))
    r = client.chat.completions.create(model="oss", messages=follow, tools=TOOLS, max_tokens=64)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.reasoning_content == "Fine."


def test_waste_chat_session(oss, tmp_path, monkeypatch):
    """`waste chat --tools FILE`, in process (the Session the command runs): reasoning, the tool call as the screen
    shows it, then `/result` answers it and the model replies."""
    from waste.chat_cli import Session
    from waste.cli import build_parser

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    replies = iter([ids_of(oss.tokenizer, CALL), ids_of(oss.tokenizer, ANSWER)])
    real = Decoding.sample

    def sample(self, logits):
        real(self, logits)
        if not hasattr(self, "forced"):
            self.forced = next(replies)
        self.token_ids[-1] = self.forced[min(len(self.token_ids) - 1, len(self.forced) - 1)]
        return self.token_ids[-1]

    monkeypatch.setattr(Decoding, "sample", sample)
    lines = iter(["Weather in Paris?", '/result {"temp": 21}'])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["chat", "oss", "-n", "200", "--reasoning-effort", "low", "--tools", str(tools)])
    s = Session(oss, args, out=out, err=err)
    s.loop()
    shown = out.getvalue()
    assert shown.startswith("The user wants the weather.\n\nChecking.[tool call get_weather("), shown
    assert shown.rstrip().endswith("Fine.\n\nIt is sunny."), shown
    assert [m["role"] for m in s.history] == ["user", "assistant", "tool", "assistant"]
    assert s.history[3]["content"] == "It is sunny."


def test_parser_for_the_template():
    assert isinstance(parser_for(TEMPLATE.read_text()), HarmonyParser)


def harmony_encoding():
    """OpenAI's own harmony encoding, or a skip saying why: it needs the o200k_base vocabulary, which it downloads
    unless TIKTOKEN_ENCODINGS_BASE names a folder holding o200k_base.tiktoken (tests download nothing)."""
    h = pytest.importorskip("openai_harmony")
    if not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        pytest.skip("openai-harmony needs o200k_base.tiktoken: set TIKTOKEN_ENCODINGS_BASE to a folder holding it")
    try:
        return h, h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:         # the Rust side raises its own error types
        pytest.skip(f"openai-harmony cannot load its encoding here: {e}")


@pytest.mark.parametrize("reply", [CALL, ANSWER, CALL.replace("commentary to=functions.get_weather <|constrain|>json",
                                                              "commentary to=functions.get_weather json")])
def test_parser_agrees_with_openai_harmony(reply):
    """The same reply through OpenAI's parser (its tokens, end id included) and ours (its text, end id excluded, as
    the engine hands it over): the same reasoning, content and calls."""
    h, enc = harmony_encoding()
    messages = enc.parse_messages_from_completion_tokens(enc.encode(reply, allowed_special="all"), h.Role.ASSISTANT)
    want = {"reasoning": "", "content": "", "calls": []}
    for m in messages:
        text = "".join(c.text for c in m.content)
        if m.recipient and m.recipient.startswith("functions."):
            want["calls"].append((m.recipient.removeprefix("functions."), json.loads(text)))
        elif m.channel == "analysis":
            want["reasoning"] += text
        else:
            want["content"] += text
    ours = parse(re.sub(r"<\|(call|return)\|>$", "", reply))
    got = {"reasoning": ours["reasoning_content"] or "", "content": ours["content"] or "",
           "calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ours["tool_calls"] or []]}
    assert got == want
