"""POST /v1/messages (Anthropic's Messages API) through the real `anthropic` client on the Qwen3 chat fixture: create
and stream agree, a tool round trip (forced tool_use with a schema-valid input, then the tool_result answered),
thinking blocks, stop sequences, both ways of sending the key, and refusals by name in Anthropic's error shape."""

import anthropic
import httpx
import pytest
from chat_util import force_generation
from serve_util import QWEN3, ThreadServer, qwen3_container

import waste
from waste.serve.app import ServerState

pytestmark = pytest.mark.skipif(not QWEN3.is_file(), reason=f"{QWEN3} is absent (tests/data/templates is incomplete)")
KEY = "sk-ant-test"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = [{"name": "get_weather", "description": "Weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
    "additionalProperties": False}}]


@pytest.fixture(scope="module")
def served(releases, tmp_path_factory):
    eng = waste.load(qwen3_container(releases, tmp_path_factory.mktemp("anthropic")))
    srv = ThreadServer(ServerState(engine=eng, api_key=KEY))
    yield srv, eng
    srv.stop()
    eng.close()


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[0].url, api_key=KEY, max_retries=0, timeout=120)


def test_create_and_stream_agree(client):
    kw = dict(model="q", max_tokens=16, messages=[{"role": "user", "content": "Hello"}],
              extra_body={"temperature": 0}, system="You are terse.")
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens") and 1 <= m.usage.output_tokens <= 16
    assert m.usage.input_tokens > 5
    text = "".join(b.text for b in m.content if b.type == "text")
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
        assert "".join(s.text_stream) == ""          # get_final_message drained it
    assert "".join(b.text for b in streamed.content if b.type == "text") == text
    assert streamed.stop_reason == m.stop_reason and streamed.usage.output_tokens == m.usage.output_tokens
    n = client.messages.count_tokens(model="q", messages=kw["messages"], system=kw["system"])
    assert n.input_tokens == m.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(client, stream):
    kw = dict(model="q", max_tokens=200, messages=ASK, tools=WEATHER, tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    assert uses[0].id.startswith("toolu_")
    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                   "content": "18 C, sunny"}]}]
    reply = client.messages.create(model="q", max_tokens=8, messages=history, tools=WEATHER,
                                   tool_choice={"type": "none"})
    assert reply.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in reply.content)
    # the tool result reached the prompt, rendered by the model's own template
    n = client.messages.count_tokens(model="q", messages=history, tools=WEATHER, tool_choice={"type": "none"})
    assert n.input_tokens == reply.usage.input_tokens


def test_thinking_and_stop_sequences(client, served, monkeypatch):
    tok = served[1].tokenizer
    force_generation(monkeypatch, tok.encode("<think>\nhmm\n</think>\n\nAnswer: 42 STOP more", allow_special=True))
    kw = dict(model="q", max_tokens=40, messages=[{"role": "user", "content": "Q?"}], stop_sequences=["STOP"],
              thinking={"type": "enabled", "budget_tokens": 16})
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "hmm" and m.content[1].text == "Answer: 42 "
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP"
    with client.messages.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Answer: 42 "
    assert final.stop_sequence == "STOP"


def test_both_key_headers_and_refusals(served, client):
    url = served[0].url
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)      # Authorization: Bearer
    assert bearer.messages.create(model="q", max_tokens=2, messages=ASK).type == "message"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(model="q", max_tokens=2,
                                                                                           messages=ASK)
    bad = [({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
           ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
           ({"thinking": {"type": "enabled", "budget_tokens": 99}}, "budget_tokens"),
           ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": WEATHER}, "nope"),
           ({"metadata": {"other": 1}}, "metadata")]
    for extra, word in bad:
        body = {"model": "q", "max_tokens": 4, "messages": ASK, **extra}
        r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert word in err["error"]["message"], err
    r = httpx.post(url + "/v1/messages", json={"model": "q", "messages": ASK}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="q", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
