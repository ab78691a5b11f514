"""Chat tests' scaffolding shared by the families: forcing the model's output (the forward still runs; stopping,
detokenizing and parsing are real), a `waste chat` session driven in process, and one tool call checked over the
server's HTTP route, plain and streamed."""
from __future__ import annotations

import io
import json

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def force_generation(monkeypatch, ids):
    """Every decoding samples these ids in turn (then repeats the last) instead of the model's choice."""
    from waste.engine import Decoding

    real = Decoding.sample

    def sample(self, logits):
        real(self, logits)                      # the real bookkeeping (token_ids, logprobs), then overridden
        tok = ids[min(len(self.token_ids) - 1, len(ids) - 1)]
        self.token_ids[-1] = tok
        return tok

    monkeypatch.setattr(Decoding, "sample", sample)


def force_sampler(monkeypatch, ids):
    """The sampler picks these ids in turn and fails the test if asked for one more."""
    from waste.runtime.sampling import Sampler

    def pick(self, logits):
        n = getattr(self, "_forced", 0)
        self._forced = n + 1
        assert n < len(ids), "the engine asked for a token past the forced reply"
        return ids[n]

    monkeypatch.setattr(Sampler, "__call__", pick)


def ids_of(tok, text: str, markers) -> list[int]:
    """Model output as token ids: the parts `markers` (a compiled pattern with one group) matches as their special
    ids, the rest as text."""
    return [i for part in markers.split(text) if part
            for i in ([tok.token_to_id(part)] if markers.fullmatch(part) else tok.encode(part))]


def waste_chat_session(eng, monkeypatch, argv: list[str], lines: list[str], replies=None):
    """`waste chat` in process (the Session the command runs) on `eng`, reading `lines` then EOF; `replies`: one
    list of token ids per decoding, in turn, instead of the model's. Returns (session, stdout text)."""
    from waste.chat_cli import Session
    from waste.cli import build_parser
    from waste.engine import Decoding

    if replies is not None:
        replies, real = iter(replies), Decoding.sample

        def sample(self, logits):
            real(self, logits)
            if not hasattr(self, "forced"):     # one canned reply per decoding, in turn
                self.forced = next(replies)
            self.token_ids[-1] = self.forced[min(len(self.token_ids) - 1, len(self.forced) - 1)]
            return self.token_ids[-1]

        monkeypatch.setattr(Decoding, "sample", sample)
    pending = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    out, err = io.StringIO(), io.StringIO()
    s = Session(eng, build_parser().parse_args(argv), out=out, err=err)
    s.loop()
    return s, out.getvalue()


def assert_tool_call_route(url: str, model: str, reasoning: str, content: str, args: dict, max_tokens: int = 200,
                           **extra):
    """POST ASK with TOOLS to the server's chat route, plain (openai client) and streamed (SSE): both carry this
    reasoning, content and one get_weather call with these arguments. Returns the plain reply's message."""
    import httpx
    import openai
    from serve_util import sse_events

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=max_tokens,
                                       **extra)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == content
    assert m.reasoning_content == reasoning
    assert m.tool_calls[0].function.name == "get_weather"
    assert json.loads(m.tool_calls[0].function.arguments) == args
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": ASK, "tools": TOOLS, "max_tokens": max_tokens, "stream": True}) as s:
        events = sse_events(s.iter_lines())
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == args
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    return client, m


def chat_tool_call_round(eng, monkeypatch, ids, **kw):
    """Engine.chat on ASK with TOOLS, the model's output forced to `ids` (junk after them, which an end id must
    cut): the reasoning "The user wants the weather.", the content "Checking." and one get_weather call
    {"city": "Paris", "days": 3}. Returns the conversation with the call and a result after it, and that
    conversation as the engine's chat format renders it."""
    force_generation(monkeypatch, ids + eng.tokenizer.encode(" junk"))
    c = eng.chat(ASK, tools=TOOLS, max_tokens=200, **kw)
    assert c.reasoning_content == "The user wants the weather." and c.content == "Checking."
    assert c.finish_reason == "tool_calls" and len(c.tool_calls) == 1
    call = c.tool_calls[0]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    history = [*ASK, c.message(), {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}]
    return history, eng.chat_format().render(history, tools=TOOLS).text


CALLED = {"role": "assistant", "content": "Checking.", "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]}
# conversations a template with thinking and tools is checked on against transformers' rendering
TEMPLATE_CASES = {
    "one_turn": dict(messages=ASK),
    "multi_turn": dict(messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
                                 {"role": "user", "content": "2+2?"}]),
    "tools": dict(messages=ASK, tools=TOOLS),
    "tool_result": dict(messages=[*ASK, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
                        tools=TOOLS),
    "thinking_off": dict(messages=ASK, thinking=False),
}


def assert_renders_as_transformers(eng, src, name: str) -> list[int]:
    """TEMPLATE_CASES[name] through the engine's chat format and through transformers' apply_chat_template on the
    release at `src` (its own template and tokenizer): the same text and the same ids. Returns the ids."""
    import copy

    from transformers import AutoTokenizer

    from waste.chat import load_chat_format

    case = copy.deepcopy(TEMPLATE_CASES[name])
    ours = load_chat_format(eng.container, eng.tokenizer).render(copy.deepcopy(case["messages"]),
                                                                tools=case.get("tools"), thinking=case.get("thinking"))
    hf = AutoTokenizer.from_pretrained(str(src))
    extra = {"enable_thinking": case["thinking"]} if "thinking" in case else {}
    for m in case["messages"]:          # what transformers' callers hand it: dict arguments
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    kw = dict(tools=case.get("tools"), add_generation_prompt=True, **extra)
    want = hf.apply_chat_template(case["messages"], tokenize=True, **kw)
    assert ours.text == hf.apply_chat_template(case["messages"], tokenize=False, **kw)
    assert ours.ids == list(want["input_ids"] if hasattr(want, "keys") else want)
    return ours.ids
