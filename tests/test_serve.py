"""`waste serve` as a user runs it (a subprocess on a loopback port, with an API key), through the real openai
client: blocking, async and streaming chat, completions, the wire shape of SSE, errors by name, auth, tokens,
metrics, and a bounded load test with the server's memory sampled."""
import asyncio
import re
import threading
import time

import httpx
import openai
import pytest
from serve_util import QWEN3, TOOLS, ProcessServer, metric, qwen3_container, rss_bytes, sse_events

KEY = "sk-test-waste"
pytestmark = pytest.mark.skipif(not QWEN3.is_file(), reason=f"{QWEN3} is absent (tests/data/templates is incomplete)")
HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(releases, tmp_path_factory):
    container = qwen3_container(releases, tmp_path_factory.mktemp("serve"))
    s = ProcessServer(container, "--api-key", KEY, "--max-batch", "8", "--max-queue", "64")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def test_health_models_and_auth(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}      # open without a key
    models = client.models.list()
    assert [m.id for m in models.data] == ["q"] and models.data[0].object == "model"
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_chat_blocking_and_streaming_agree(client, http):
    kw = dict(model="q", messages=HI, max_tokens=12, temperature=0)
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "q"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.completion_tokens <= 12

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    finish = chunks[-2].choices[0]
    assert finish.finish_reason == choice.finish_reason
    assert finish.delta.content is None and finish.delta.tool_calls is None
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks[:-1])
    assert text == (choice.message.content or "")
    assert reasoning == (getattr(choice.message, "reasoning_content", None) or "")

    # the raw stream: data events and [DONE]; usage null on every chunk but the last when include_usage is set
    with http.stream("POST", "/v1/chat/completions", json={**kw, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = sse_events(s.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert all(e["usage"] is None for e in events[:-2])
    assert events[-3]["choices"][0]["delta"] == {}
    # without include_usage there is no usage chunk
    with http.stream("POST", "/v1/chat/completions", json={**kw, "stream": True}) as s:
        events = sse_events(s.iter_lines())
    assert all(e == "[DONE]" or e["choices"] for e in events) and all("usage" not in e for e in events[:-1])


def test_async_client_concurrent_requests_match_sequential(server, client):
    """Four requests in flight at once (batched by the scheduler) give what each gives alone."""
    prompts = [f"Count to {i}" for i in range(4)]

    def ask(c, p, **kw):
        return c.chat.completions.create(model="q", messages=[{"role": "user", "content": p}], max_tokens=10,
                                         seed=5, temperature=0.8, **kw)

    alone = [ask(client, p).choices[0].message.content for p in prompts]

    async def together():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as ac:
            rs = await asyncio.gather(*[ask(ac, p) for p in prompts])
            stream = await ask(ac, prompts[0], stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return [r.choices[0].message.content for r in rs], streamed

    batched, streamed = asyncio.run(together())
    assert batched == alone and streamed == (alone[0] or "")


def test_completions_blocking_streaming_and_logprobs(client):
    r = client.completions.create(model="q", prompt="def fibonacci(n):", max_tokens=8, temperature=0, logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason in ("stop", "length")
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens - (
        c.finish_reason == "stop")
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    chunks = list(client.completions.create(model="q", prompt="def fibonacci(n):", max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert chunks[-1].choices[0].finish_reason == c.finish_reason
    ids = client.completions.create(model="q", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="q", messages=HI, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 6
    for t in content:
        assert t.logprob <= 0 and isinstance(t.bytes, list) and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.logprob - 1e-6   # greedy: the chosen token is the most likely


@pytest.mark.parametrize("body,status,param", [
    ({"n": 0}, 400, "n"),
    ({"n": 17}, 400, "n"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, 400,
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"tool_choice": "required"}, 400, "tool_choice"),                            # forcing a call needs tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, 400, "parallel_tool_calls"),
    ({"reasoning_effort": "high"}, 400, "reasoning_effort"),
    ({"chat_template_kwargs": {"no_such_flag": True}}, 400, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]}, 400,
     "messages"),
    ({"messages": []}, 400, "messages"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_completion_tokens": -1, "max_tokens": 5}, 400, "max_completion_tokens"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"stop": 5}, 400, "stop"),
    ({"model": "gpt-4o"}, 404, "model"),
])
def test_chat_errors_name_the_field(http, body, status, param):
    for stream in (False, True):       # refused before any 200, streaming or not
        r = http.post("/v1/chat/completions", json={"model": "q", "messages": HI, "max_tokens": 4, **body,
                                                    "stream": stream})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
        assert r.headers["content-type"].startswith("application/json")


def test_other_errors(http, client):
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/chat/completions", json={"model": "q"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = http.post("/v1/completions", json={"model": "q", "prompt": [5] * 2100, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/v1/completions", json={"model": "q", "prompt": [10 ** 6], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="q", messages=HI, n=0)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HI)


def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"prompt": "def f(x):"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "def f(x):"
    chat = http.post("/tokenize", json={"messages": HI}).json()
    assert chat["count"] > r["count"]
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400


def test_metrics(server, client, http):
    client.chat.completions.create(model="q", messages=HI, max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("waste_requests_total", "waste_prompt_tokens_total", "waste_generation_tokens_total",
                 "waste_generation_tokens_per_second", "waste_num_requests_waiting", "waste_num_requests_running",
                 "waste_expert_cache_hit_rate", "waste_expert_bytes_read_total", "waste_time_to_first_token_seconds"):
        assert f"# TYPE {name} " in text, name
    assert metric(text, "waste_requests_total", endpoint="/v1/chat/completions", status=200) >= 1
    assert metric(text, "waste_generation_tokens_total") >= 1
    assert 0 <= metric(text, "waste_expert_cache_hit_rate") <= 1
    # histograms (p50 / p99 through histogram_quantile): every finished request has a first token and a duration;
    # every token but a request's first has an inter-token latency
    for name in ("waste_time_to_first_token_seconds", "waste_inter_token_latency_seconds",
                 "waste_request_duration_seconds"):
        assert f"# TYPE {name} histogram" in text, name
        buckets = [float(v) for le, v in re.findall(rf'{name}_bucket{{le="([^"]+)",model="[^"]*"}} (\S+)', text)]
        assert buckets == sorted(buckets) and buckets[-1] == metric(text, name + "_count"), name
    firsts = metric(text, "waste_time_to_first_token_seconds_count")
    assert firsts >= 1 and metric(text, "waste_request_duration_seconds_count") >= firsts
    assert metric(text, "waste_inter_token_latency_seconds_count") == \
        metric(text, "waste_generation_tokens_total") - firsts
    assert metric(text, "waste_time_to_first_token_seconds_sum") > 0


def test_load_200_requests_8_concurrent_flat_memory(server):
    """200 requests, 8 at a time, chat and completions, streaming and not: no failure, and the server's RSS
    does not grow. Bound: 48 MiB over the post-warm-up level. The model and its expert cache are preallocated,
    a request's state is freed with it, and 8 requests' KV at this size is under 1 MiB; what moves RSS is the
    allocator settling, a few MiB. A leak of one request's prompt logits (1.5 KiB) would not show; one of its
    engine objects (a sampler generator, a KV cache, asyncio queues: tens of KiB) times 200 would."""
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(rss_bytes(server.pid))
            time.sleep(0.1)

    async def one(ac, i):
        msgs = [{"role": "user", "content": f"Request {i}: say something."}]
        if i % 4 == 0:
            r = await ac.completions.create(model="q", prompt=f"def f{i}(x):", max_tokens=4, temperature=0.7, seed=i)
            return r.choices[0].finish_reason
        if i % 4 == 1:
            s = await ac.chat.completions.create(model="q", messages=msgs, max_tokens=4, stream=True)
            return [c async for c in s][-1].choices[0].finish_reason
        r = await ac.chat.completions.create(model="q", messages=msgs, max_tokens=4, temperature=0.7, seed=i)
        return r.choices[0].finish_reason

    async def run(n, warm):
        sem = asyncio.Semaphore(8)
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as ac:
            async def bounded(i):
                async with sem:
                    return await one(ac, i)
            return await asyncio.gather(*[bounded(i + warm) for i in range(n)], return_exceptions=True)

    warm = asyncio.run(run(24, 0))
    assert all(r in ("stop", "length") for r in warm), warm
    base = rss_bytes(server.pid)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        results = asyncio.run(run(200, 24))
    finally:
        stop.set()
        t.join()
    failures = [r for r in results if r not in ("stop", "length")]
    assert failures == [], failures[:3]
    assert samples and max(samples) - base < 48 << 20, (base, max(samples))
    # the second half does not climb above the first half's peak by more than the allocator's slack
    half = len(samples) // 2
    assert max(samples[half:]) - max(samples[:half]) < 16 << 20
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "waste_num_requests_running") == 0 and metric(text, "waste_num_requests_waiting") == 0
