"""The server in this process (a uvicorn thread on a loopback port), where a test can force the model's output:
tool calls and reasoning on the wire (blocking and streamed, through the openai client's own accumulator),
client disconnects, a container with no chat format (#34), 503 while loading, and 503 + Retry-After when the
queue is full. Where a test needs a generation that does not end by itself, it forces a token that is no end."""
import json
import threading
import time

import httpx
import openai
import pytest
from chat_util import force_generation
from serve_util import QWEN3, TOOLS, ThreadServer, sse_events

import waste
from waste.engine import Decoding
from waste.serve.app import ServerState

needs_qwen3 = pytest.mark.skipif(not QWEN3.is_file(), reason=f"{QWEN3} is absent (tests/data/templates is incomplete)")
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(qwen3):
    return openai.OpenAI(base_url=qwen3[0].url + "/v1", api_key="anything", max_retries=0, timeout=60)


def _tool_output(tok):
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    return tok.encode(text) + [tok.token_to_id("<|im_end|>")]


@needs_qwen3
def test_tool_call_blocking(qwen3, client, monkeypatch):
    force_generation(monkeypatch, _tool_output(qwen3[1].tokenizer))
    r = client.chat.completions.create(model="q", messages=ASK, tools=TOOLS, max_tokens=256)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check.\n"
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(call.function.arguments, str)
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    # a tool result goes back through the template, arguments as the JSON string the client holds
    force_generation(monkeypatch, qwen3[1].tokenizer.encode("It is sunny.") + [qwen3[1].tokenizer.token_to_id("<|im_end|>")])
    follow = [*ASK, c.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    r = client.chat.completions.create(model="q", messages=follow, tools=TOOLS, max_tokens=16)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"


@needs_qwen3
def test_tool_call_streaming(qwen3, client, monkeypatch):
    force_generation(monkeypatch, _tool_output(qwen3[1].tokenizer))
    with httpx.stream("POST", qwen3[0].url + "/v1/chat/completions", timeout=60, json={
            "model": "q", "messages": ASK, "tools": TOOLS, "max_tokens": 256, "stream": True}) as s:
        events = sse_events(s.iter_lines())
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls and all(isinstance(tc["index"], int) and tc["index"] == 0 for tc in calls)
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in tc and "name" not in tc["function"] for tc in calls[1:])
    args = "".join(tc["function"]["arguments"] for tc in calls)
    assert len(calls) > 2 and json.loads(args) == {"city": "Paris", "days": 3}   # streamed in pieces
    assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    # the openai client's own stream accumulator (indexes tool calls by `index`)
    with client.chat.completions.stream(model="q", messages=ASK, tools=TOOLS, max_tokens=256) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    assert final.choices[0].finish_reason == "tool_calls"


@needs_qwen3
def test_reasoning_comes_back_under_both_names(qwen3, client, monkeypatch):
    tok = qwen3[1].tokenizer
    force_generation(monkeypatch, tok.encode("<think>\nAdd them.\n</think>\n\nIt is 4.") + [tok.token_to_id("<|im_end|>")])
    msgs = [{"role": "user", "content": "2+2?"}]
    m = client.chat.completions.create(model="q", messages=msgs, max_tokens=256).choices[0].message
    assert m.content == "It is 4."
    assert m.reasoning_content == "Add them." and m.reasoning == "Add them."
    chunks = list(client.chat.completions.create(model="q", messages=msgs, max_tokens=256, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Add them."
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Add them."
    assert "".join(d.content or "" for d in deltas) == "It is 4."
    # chat_template_kwargs reach the template: thinking off renders a different prompt
    on = httpx.post(qwen3[0].url + "/tokenize", json={"messages": msgs}).json()["count"]
    off = httpx.post(qwen3[0].url + "/tokenize", json={"messages": msgs,
                                                       "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["count"] > on


@needs_qwen3
def test_stop_strings_and_max_completion_tokens(qwen3, client, monkeypatch):
    tok = qwen3[1].tokenizer
    force_generation(monkeypatch, tok.encode("alpha beta gamma delta epsilon") + [tok.token_to_id("<|im_end|>")])
    r = client.chat.completions.create(model="q", messages=ASK, max_tokens=256, stop=["gamma"])
    assert r.choices[0].message.content == "alpha beta " and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="q", messages=ASK, max_tokens=256, max_completion_tokens=2)
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length"


def test_no_chat_format_serves_everything_but_chat(releases):
    """seed 0.6.7 #34: the Kimi-Linear fixture's tokenizer has no Kimi markers, so no chat format installs."""
    eng = waste.load(releases["kimi_linear"][2])
    srv = ThreadServer(ServerState(engine=eng))
    try:
        base = srv.url
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == "kimi_linear"
        r = httpx.post(base + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unsupported_chat_format" and err["reasons"]
        assert any("chat.json" in reason for reason in err["reasons"])
        r = httpx.post(base + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.post(base + "/tokenize", json={"prompt": "hi"}).status_code == 200
        assert httpx.post(base + "/tokenize", json={"messages": ASK}).json()["error"]["code"] == "unsupported_chat_format"
    finally:
        srv.stop()
        eng.close()


def test_health_is_503_while_loading_then_200(releases):
    gate = threading.Event()

    def slow_load(path):
        gate.wait(30)
        return waste.load(path)

    state = ServerState(releases["qwen3_moe"][2], load=slow_load)
    srv = ThreadServer(state)
    try:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading" and r.headers["retry-after"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "retry-after" in r.headers
        gate.set()
        t0 = time.monotonic()
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "qwen3_moe"
    finally:
        srv.stop()
        state.close()


def _wait_cancelled(state, before: int, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while state.metrics.value("waste_requests_finished_total", reason="cancelled") <= before or state.scheduler.active:
        assert time.monotonic() - t0 < timeout, "the generation was not cancelled"
        time.sleep(0.01)


STEP = 0.2       # seconds a decode step is made to take in the disconnect test (slack for a loaded machine)


@pytest.fixture(scope="module")
def plain(releases):
    """The fixture container as converted (waste's ChatML chat.json): no file from ../shared needed."""
    eng = waste.load(releases["qwen3_moe"][2])
    srv = ThreadServer(ServerState(engine=eng))
    yield srv, eng
    srv.stop()
    eng.close()


def test_disconnect_stops_generation_within_one_step(plain, monkeypatch):
    """README: "A client that disconnects stops its generation within one decode step." Each step is slowed to STEP
    seconds (the sampler sleeps), far longer than the server takes to see a closed socket, so what is made after the
    close is the step in flight and, since the count is read just before closing, at most one more."""
    srv, eng = plain
    tok = eng.tokenizer.encode("a")[0]
    made = []
    real = Decoding.sample

    def sample(self, logits):
        real(self, logits)
        time.sleep(STEP)
        made.append(tok)
        self.token_ids[-1] = tok
        return tok

    monkeypatch.setattr(Decoding, "sample", sample)
    state = srv.state
    body = {"prompt": "def f(x):", "max_tokens": 1500, "temperature": 0}
    for stream in (True, False):
        before = state.metrics.value("waste_requests_finished_total", reason="cancelled")
        start = len(made)
        if stream:
            with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
                lines = s.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
                at_close = len(made)
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
            at_close = len(made)
        _wait_cancelled(state, before)
        print(f"stream={stream}: {at_close - start} tokens before the close, {len(made) - at_close} after")
        assert at_close > start and len(made) - at_close <= 2, (stream, at_close - start, len(made) - at_close)


def test_full_queue_answers_503_with_retry_after(releases, monkeypatch):
    """One running, one waiting: the third is refused at once, and the openai client sees a 503 it may retry."""
    eng = waste.load(releases["qwen3_moe"][2])
    force_generation(monkeypatch, [eng.tokenizer.encode("a")[0]])
    state = ServerState(engine=eng, max_batch=1, max_queue=1)
    srv = ThreadServer(state)
    waiting = []
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            with h.stream("POST", "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 1000,
                                                           "temperature": 0, "stream": True}) as a:
                lines = a.iter_lines()        # held: a dropped iterator closes the response (a disconnect)
                next(lines)                   # A runs
                b = threading.Thread(target=lambda: waiting.append(httpx.post(
                    srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)))
                b.start()
                t0 = time.monotonic()
                while state.scheduler.depth < 1:       # B waits for A
                    assert time.monotonic() - t0 < 30
                    time.sleep(0.01)
                r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
                c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.InternalServerError) as e:
                    c.completions.create(model="qwen3_moe", prompt="x", max_tokens=2)
                assert e.value.status_code == 503
            b.join(60)                          # A's client left: A is cancelled and B runs
            assert waiting and waiting[0].status_code == 200
    finally:
        srv.stop()
        eng.close()
