"""gpt-oss's text side: the release's harmony template (tests/data/templates/openai-gpt-oss-120b.jinja) on a tiny
gpt-oss container whose tokenizer carries the harmony markers as special tokens; replies parsed into
`reasoning_content` (the analysis channel) and `tool_calls` (messages to functions.NAME) through Engine.chat, the
server and `waste chat`. Replies with a known shape are forced (the sampler's choice is replaced), so the rest of
the path (end ids, detokenizing, the parser, finish_reason) is the real one. openai-harmony (OpenAI's own renderer
and parser) is the second reference, on the genuine o200k vocabulary rebuilt offline from quicktok-v1's copy."""
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import chat_util
from chat_util import ASK, TOOLS, assert_tool_call_route, chat_tool_call_round, force_generation, waste_chat_session
from serve_util import ThreadServer
from test_oracle_gpt_oss import gpt_oss_model

import waste
from waste.convert.convert import convert
from waste.convert.synthetic import write_tokenizer
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
    return chat_util.ids_of(tok, text, MARKERS)


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
    history, text = chat_tool_call_round(oss, monkeypatch, ids_of(tok, CALL))
    # the call, its reasoning (as the template's `thinking`) and the result go back in harmony
    # (the template takes reasoning or content beside a call, not both: the preamble is left out)
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
    client, m = assert_tool_call_route(server.url, "oss", "The user wants the weather.", "Checking.",
                                       {"city": "Paris", "days": 3}, reasoning_effort="low")
    follow = [*ASK, m.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": '{"temp": 21}'}]
    force_generation(monkeypatch, ids_of(oss.tokenizer, ANSWER))
    r = client.chat.completions.create(model="oss", messages=follow, tools=TOOLS, max_tokens=64)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.reasoning_content == "Fine."


def test_waste_chat_session(oss, tmp_path, monkeypatch):
    """`waste chat --tools FILE`, in process (the Session the command runs): reasoning, the tool call as the screen
    shows it, then `/result` answers it and the model replies."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    s, shown = waste_chat_session(
        oss, monkeypatch, ["chat", "oss", "-n", "200", "--reasoning-effort", "low", "--tools", str(tools)],
        ["Weather in Paris?", '/result {"temp": 21}'], [ids_of(oss.tokenizer, CALL), ids_of(oss.tokenizer, ANSWER)])
    assert shown.startswith("The user wants the weather.\n\nChecking.[tool call get_weather("), shown
    assert shown.rstrip().endswith("Fine.\n\nIt is sunny."), shown
    assert [m["role"] for m in s.history] == ["user", "assistant", "tool", "assistant"]
    assert s.history[3]["content"] == "It is sunny."


def test_parser_for_the_template():
    assert isinstance(parser_for(TEMPLATE.read_text()), HarmonyParser)


O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"   # what tiktoken expects


def o200k_base_from_quicktok() -> bytes | None:
    """The genuine o200k_base.tiktoken, rebuilt from the copy quicktok-v1 0.4.0 (the test extra) ships as
    `quicktok/data/o200k.vocab` (u32 count, then per token: u16 length, its bytes, u32 rank): one line
    "base64(bytes) rank" per rank. None without quicktok; a test failure if the result is not the file tiktoken
    pins by sha256."""
    import base64
    import hashlib
    import importlib.util
    import struct

    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        return None
    raw = (Path(spec.submodule_search_locations[0]) / "data" / "o200k.vocab").read_bytes()
    (n,), off, ranks = struct.unpack_from("<I", raw), 4, []
    for _ in range(n):
        (size,) = struct.unpack_from("<H", raw, off)
        tok = raw[off + 2 : off + 2 + size]
        (rank,) = struct.unpack_from("<I", raw, off + 2 + size)
        ranks.append((rank, tok))
        off += 6 + size
    text = "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in sorted(ranks)).encode()
    assert off == len(raw) and hashlib.sha256(text).hexdigest() == O200K_SHA256
    return text


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """OpenAI's own harmony encoding, or a skip saying why. It reads o200k_base.tiktoken from
    TIKTOKEN_ENCODINGS_BASE (it would download it otherwise; tests download nothing): a folder the caller names,
    else one holding the copy rebuilt from quicktok-v1."""
    h = pytest.importorskip("openai_harmony")
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
            text = o200k_base_from_quicktok()
            if text is None:
                pytest.skip("openai-harmony needs o200k_base.tiktoken: install the test extra (quicktok-v1 ships it)"
                            " or set TIKTOKEN_ENCODINGS_BASE to a folder holding it")
            folder = tmp_path_factory.mktemp("tiktoken")
            (folder / "o200k_base.tiktoken").write_bytes(text)
            mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))
        try:
            return h, h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as e:         # the Rust side raises its own error types
            pytest.skip(f"openai-harmony cannot load its encoding here: {e}")


@pytest.mark.parametrize("reply", [CALL, ANSWER, CALL.replace("commentary to=functions.get_weather <|constrain|>json",
                                                              "commentary to=functions.get_weather json")])
def test_parser_agrees_with_openai_harmony(harmony, reply):
    """The same reply through OpenAI's parser (its tokens, end id included) and ours (its text, end id excluded, as
    the engine hands it over): the same reasoning, content and calls."""
    h, enc = harmony
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
