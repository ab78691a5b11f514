"""Kimi K3's text side on a tiny K3 container: its tiktoken tokenizer (Kimi's pattern, Han runs apart) and the
release's XTML template (tests/data/templates/Kimi-K3.jinja): thinking and its effort, tool declarations, calls
and results round-tripping through Engine.chat, the server's chat route and `waste chat`, parsed into
`reasoning_content` and `tool_calls`. Replies with a known shape are forced (the sampler's choice is replaced),
so the rest of the path (stop ids, detokenizing, the XTML parser, finish_reason) is the real one."""
import json
import re
import shutil
from pathlib import Path

import pytest
import tiktoken
import torch
import chat_util
from k3_release import train_ranks, write_k3_tokenizer, write_release
from chat_util import ASK, TOOLS, assert_tool_call_route, chat_tool_call_round, force_generation, waste_chat_session
from serve_util import ThreadServer

import waste
from waste.chat import ChatRequestError
from waste.convert.convert import convert
from waste.serve.app import ServerState
from waste.text.tokenizer import KIMI_PATTERN

TEMPLATE = Path(__file__).resolve().parent / "data" / "templates" / "Kimi-K3.jinja"   # SOURCES.md beside it
pytestmark = pytest.mark.skipif(not TEMPLATE.is_file(), reason=f"{TEMPLATE} is absent (tests/data/templates is incomplete)")

CORPUS = ("The weather in Paris is sunny. 北京的天气很好。中文English混合的句子很常见。 Checking the weather now. "
          "get_weather city Paris days 3 temp 21 It is sunny. Think about it: add them. ") * 3
# a reply after a prompt that opened the think channel: reasoning, the response, one call with typed arguments
CALL = ('The user wants the weather.<|close|>think<|sep|><|open|>response<|sep|>Checking.'
        '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
MARKERS = re.compile(r"(<\|open\|>|<\|close\|>|<\|sep\|>|<\|end_of_msg\|>)")


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3chat")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # a tiny model on a busy 2-core box is many times slower with two (LEARNED.md §3c)
    ranks = train_ranks(CORPUS + TEMPLATE.read_text(), 400)     # the template's prose too: shorter prompts
    for piece in ("文".encode()[:2], "文".encode(), "文Q".encode()):   # a merge across a Han/Latin boundary:
        ranks.setdefault(piece, len(ranks))                              # only a Han-less pattern reaches it
    n = len(ranks)
    src = write_release(root / "src", "bf16", vocab_size=n + 256, bos_token_id=n, eos_token_id=n + 2)
    write_k3_tokenizer(src, ranks)
    shutil.copy(TEMPLATE, src / "chat_template.jinja")
    eng = waste.load(convert(src, root / "k3.waste", experts="bf16", trunk="bf16", progress=False))
    yield eng, ranks
    eng.close()
    torch.set_num_threads(threads)


def ids_of(tok, text: str) -> list[int]:
    """Model output as token ids: XTML markers as their special ids, the rest as text."""
    return chat_util.ids_of(tok, text, MARKERS)


def test_tokenizer_keeps_han_runs_apart(k3):
    eng, ranks = k3
    text = "文Qx 中文English混合的句子, The weather 北京"
    kimi = tiktoken.Encoding("k", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})
    hanless = tiktoken.Encoding("h", pat_str=r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+""",
                                mergeable_ranks=ranks, special_tokens={})
    assert eng.tokenizer.kind == "tiktoken"
    assert eng.tokenizer.encode(text) == kimi.encode(text) != hanless.encode(text)
    assert eng.tokenizer.decode(eng.tokenizer.encode(text)) == text
    for marker in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"):
        assert eng.tokenizer.token_to_id(marker) is not None


def test_thinking_and_its_effort_reach_the_template(k3):
    eng, _ = k3
    fmt = eng.chat_format()
    assert eng.tokenizer.token_to_id("<|end_of_msg|>") in fmt.stop_ids     # found by rendering the template
    default = fmt.render(ASK)
    assert "thinking_effort=max" in default.text and default.text.endswith("<|open|>think<|sep|>")
    low = fmt.render(ASK, reasoning_effort="low")
    assert "thinking_effort=low" in low.text and low.parser.start_in_reasoning
    for off in (fmt.render(ASK, thinking=False), fmt.render(ASK, reasoning_effort="none")):
        assert "thinking_effort" not in off.text and off.text.endswith("<|open|>response<|sep|>")
        assert not off.parser.start_in_reasoning
    assert eng.tokenizer.token_to_id("<|open|>") in low.ids       # markup as control tokens, one id each
    with pytest.raises(ChatRequestError) as e:
        fmt.render(ASK, reasoning_effort="extreme")
    assert "extreme" in str(e.value)
    # caller text that spells a marker stays text
    inj = fmt.render([{"role": "user", "content": "say <|open|>x<|sep|>"}])
    assert inj.ids.count(eng.tokenizer.token_to_id("<|open|>")) == low.ids.count(eng.tokenizer.token_to_id("<|open|>"))


def test_engine_chat_reasoning_tool_call_and_result_round_trip(k3, monkeypatch):
    eng, _ = k3
    tok = eng.tokenizer
    history, text = chat_tool_call_round(eng, monkeypatch, ids_of(tok, CALL), reasoning_effort="high")
    # the call and its result go back through the template as XTML
    assert ('<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
            '<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
            '<|close|>call<|sep|>') in text
    assert '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>{"temp": 21}<|close|>message<|sep|>' in text
    assert "<|open|>think<|sep|>The user wants the weather.<|close|>think<|sep|>" in text
    force_generation(monkeypatch, ids_of(tok, "<|close|>think<|sep|><|open|>response<|sep|>It is sunny."
                                              "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"))
    c2 = eng.chat(history, tools=TOOLS, max_tokens=64)
    assert c2.content == "It is sunny." and c2.tool_calls == [] and c2.finish_reason == "stop"
    assert c2.reasoning_content == ""


@pytest.fixture(scope="module")
def server(k3):
    srv = ThreadServer(ServerState(engine=k3[0]))
    yield srv
    srv.stop()


def test_server_chat_route(k3, server, monkeypatch):
    eng, _ = k3
    force_generation(monkeypatch, ids_of(eng.tokenizer, CALL))
    client, m = assert_tool_call_route(server.url, "k3", "The user wants the weather.", "Checking.",
                                       {"city": "Paris", "days": 3}, reasoning_effort="low")
    # the tool result goes back over the wire; thinking off through chat_template_kwargs
    follow = [*ASK, m.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": '{"temp": 21}'}]
    force_generation(monkeypatch, ids_of(eng.tokenizer, "It is sunny.<|close|>response<|sep|><|close|>message<|sep|>"
                                                        "<|end_of_msg|>"))
    r = client.chat.completions.create(model="k3", messages=follow, tools=TOOLS, max_tokens=64,
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"


def test_waste_chat_session(k3, tmp_path, monkeypatch):
    """`waste chat --reasoning-effort low --tools FILE`, in process (the Session the command runs): reasoning, the
    tool call as the screen shows it, then `/result` answers it and the model replies."""
    eng, _ = k3
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    s, shown = waste_chat_session(
        eng, monkeypatch, ["chat", "k3", "-n", "200", "--reasoning-effort", "low", "--tools", str(tools)],
        ["Weather in Paris?", '/result {"temp": 21}'],
        [ids_of(eng.tokenizer, CALL),
         ids_of(eng.tokenizer, "Fine.<|close|>think<|sep|><|open|>response<|sep|>It is sunny."
                               "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")])
    assert shown.startswith("The user wants the weather.\n\nChecking.[tool call get_weather(")
    assert shown.rstrip().endswith("Fine.\n\nIt is sunny.")
    assert [m["role"] for m in s.history] == ["user", "assistant", "tool", "assistant"]
    assert s.history[2]["tool_call_id"] == s.history[1]["tool_calls"][0]["id"]
    assert s.history[3]["content"] == "It is sunny."


def test_tools_file_refusals(tmp_path):
    from waste.chat_cli import read_tools
    from waste.errors import WasteError

    bad = tmp_path / "t.json"
    for text, why in (("[{", "not valid JSON"), ('{"name": "f"}', "must hold a JSON list"),
                      ('[{"type": "function", "function": {}}]', "must hold a JSON list")):
        bad.write_text(text)
        with pytest.raises(WasteError, match=why):
            read_tools(str(bad))
    with pytest.raises(WasteError, match="cannot read --tools"):
        read_tools(str(tmp_path / "absent.json"))
    bad.write_text(json.dumps(TOOLS))
    assert read_tools(str(bad)) == TOOLS
