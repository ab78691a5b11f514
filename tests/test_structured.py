"""Constrained decoding (llguidance) and the rest of the sampling API: JSON schemas on the bundled model, the rule
that a grammar changes nothing where it allows the unconstrained choice, penalties against transformers' own
logits processors, and through the real openai client on the Qwen3 chat fixture: `parse` with a pydantic model,
forced tool calls (streamed and not), `n` > 1 sharing one prefill."""
import json
from typing import Annotated

import openai
import pydantic
import pytest
import torch
from serve_util import QWEN3, TOOLS

import waste
from waste.engine import Decoding
from waste.runtime.sampling import Sampler, SamplingParams

needs_qwen3 = pytest.mark.skipif(not QWEN3.is_file(), reason=f"{QWEN3} is absent (tests/data/templates is incomplete)")


class Person(pydantic.BaseModel):
    # bounded: a random-weight model inside a free string may never close it, nor stop inventing keys a schema
    # without additionalProperties: false allows (which of its trajectories ends in time is chance)
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    tags: list[Annotated[str, pydantic.StringConstraints(max_length=8)]] = pydantic.Field(max_length=3)


SCHEMA = Person.model_json_schema()


@pytest.fixture(scope="module")
def bundled():
    eng = waste.load()
    yield eng
    eng.close()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_on_the_bundled_model(bundled, temperature):
    """A code-completion model that never writes JSON by itself writes a Person, greedy and sampled."""
    free = bundled.generate("def f(x):", max_tokens=24, temperature=temperature, seed=3).text
    with pytest.raises(ValueError):
        json.loads(free)
    g = bundled.generate("def f(x):", max_tokens=200, temperature=temperature, seed=3, json_schema=SCHEMA)
    assert g.finish_reason == "stop", g.text
    Person.model_validate_json(g.text)
    assert g.text == json.dumps(json.loads(g.text))          # compact: json.dumps' separators, no other blanks
    any_obj = bundled.generate("def f(x):", max_tokens=200, temperature=temperature, seed=3, json_schema={})
    assert isinstance(json.loads(any_obj.text), dict)


def test_a_grammar_that_allows_everything_changes_nothing(bundled):
    """Sampled at temperature 1 with a seed: the same ids with and without a grammar that admits any text."""
    ids = bundled.encode("import os\n")
    free = bundled.generation(ids, 40, SamplingParams(1.0, seed=11), [])
    list(free)
    anything = bundled.generation(ids, 40, SamplingParams(1.0, seed=11), [], grammar='start: /(?s:.*)/')
    list(anything)
    assert anything.token_ids == free.token_ids and len(free.token_ids) == 40


def test_the_mask_keeps_the_unconstrained_choice_where_it_allows_it(bundled, monkeypatch):
    """At every step of a constrained, sampled generation: the token drawn without the grammar (the same logits,
    the same generator state) is the token emitted whenever the grammar allows it; otherwise an allowed one."""
    seen = {"kept": 0, "replaced": 0}
    real = Decoding.sample

    def sample(self, logits):
        c = self.constraint
        shadow = Sampler(self.sampler.p)
        shadow.gen.set_state(self.sampler.gen.get_state())
        free = shadow(self.sampler.adjust(logits, self.prompt_ids, self.token_ids))
        allowed = c.allowed()
        tok = real(self, logits)
        assert allowed[tok]
        if allowed[free]:
            assert tok == free
            seen["kept"] += 1
        else:
            seen["replaced"] += 1
        return tok

    monkeypatch.setattr(Decoding, "sample", sample)
    for seed in range(3):
        g = bundled.generate("x = ", max_tokens=120, temperature=0.8, seed=seed, json_schema=SCHEMA)
        Person.model_validate_json(g.text)
    assert seen["kept"] > 0 and seen["replaced"] > 0, seen


def test_penalties_match_transformers_logits_processors():
    """repetition_penalty against transformers' RepetitionPenaltyLogitsProcessor (prompt and output ids), the
    presence / frequency penalties against OpenAI's formula written out, logit_bias added."""
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 3
    prompt, output = [1, 2, 3, 3], [3, 7, 7, 9, 1]
    rep = Sampler(SamplingParams(repetition_penalty=1.7)).adjust(logits, prompt, output)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.equal(rep, ref)
    pf = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 2.0), (7, -1.0))))
    got = pf.adjust(logits, prompt, output)
    want = logits.clone()
    for t in set(output):
        want[t] -= 0.5 + 0.25 * output.count(t)
    want[4] += 2.0
    want[7] -= 1.0
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert Sampler(SamplingParams()).adjust(logits, prompt, output) is logits       # off: untouched


# -- the server, through the openai client --------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(qwen3):
    return openai.OpenAI(base_url=qwen3[0].url + "/v1", api_key="anything", max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "Who are you?"}]


@needs_qwen3
def test_parse_with_a_pydantic_model(client):
    for temperature in (0, 1.0):
        r = client.chat.completions.parse(model="q", messages=ASK, response_format=Person, max_tokens=300,
                                          temperature=temperature, seed=5)
        c = r.choices[0]
        assert c.finish_reason == "stop" and isinstance(c.message.parsed, Person), c.message.content
    with client.chat.completions.stream(model="q", messages=ASK, response_format=Person, max_tokens=300,
                                        temperature=0.7, seed=2) as s:
        final = s.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)
    r = client.chat.completions.create(model="q", messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=300, temperature=0)
    c = r.choices[0]
    # any JSON object: a random-weight model's greedy string may never close (whether it does is chance), so the
    # reply is held to be an object's start, and a whole object when it stops
    assert c.message.content.startswith("{"), c.message.content
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)


WEATHER = TOOLS + [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}]


@needs_qwen3
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_call(client, choice):
    kw = dict(model="q", messages=ASK, tools=WEATHER, tool_choice=choice, max_tokens=200, temperature=0.8, seed=1)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
    for call in c.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "add")
        if call.function.name == "add":
            assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
        else:
            assert isinstance(args["city"], str)
    if isinstance(choice, dict):
        assert [t.function.name for t in c.message.tool_calls] == ["add"]
    with client.chat.completions.stream(**kw) as s:
        streamed = s.get_final_completion().choices[0]
    assert [(t.function.name, t.function.arguments) for t in streamed.message.tool_calls] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


@needs_qwen3
def test_refusals_name_the_field(client):
    bad = [(dict(tool_choice={"type": "function", "function": {"name": "nope"}}, tools=TOOLS), "tool_choice"),
           (dict(tool_choice="required"), "tool_choice"),
           (dict(n=0), "n"), (dict(presence_penalty=3), "presence_penalty"),
           (dict(logit_bias={"999999": 1}), "logit_bias"), (dict(repetition_penalty=0), "repetition_penalty"),
           (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
            "response_format.json_schema.schema")]
    for extra, param in bad:
        body = {k: v for k, v in extra.items() if k not in ("repetition_penalty",)}
        if "repetition_penalty" in extra:
            body["extra_body"] = {"repetition_penalty": extra["repetition_penalty"]}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="q", messages=ASK, max_tokens=4, **body)
        assert e.value.body["param"] == param, (extra, e.value.body)


@needs_qwen3
def test_n_choices_share_the_prefill_and_match_single_requests(client, qwen3, monkeypatch):
    eng = qwen3[1]
    prefills = []
    real = type(eng.model).step

    def step(self, items, *a, **k):
        prefills.extend(len(it[0]) for it in items if it[2] == 0)
        return real(self, items, *a, **k)

    monkeypatch.setattr(type(eng.model), "step", step)
    kw = dict(model="q", messages=ASK, max_tokens=12, temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3)
    r = client.chat.completions.create(n=3, seed=40, **kw)
    assert len(prefills) == 1                   # one prefill served the three choices
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        alone = client.chat.completions.create(n=1, seed=40 + c.index, **kw).choices[0]
        assert alone.message.content == c.message.content
    assert len({c.message.content for c in r.choices}) > 1
    chunks = list(client.chat.completions.create(n=2, seed=40, stream=True, stream_options={"include_usage": True},
                                                  **kw))
    text = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
    assert [text[0], text[1]] == [c.message.content for c in r.choices[:2]]
    u = chunks[-1].usage
    assert u.prompt_tokens == r.usage.prompt_tokens and 2 <= u.completion_tokens <= 24


# -- the command line ------------------------------------------------------------------------------------------
def test_run_json_schema_and_penalty_flags(tmp_path):
    from test_cli import waste as run_cli

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    p = run_cli("run", "x = ", "--json-schema", schema, "-n", "200", "--repeat-penalty", "1.3",
                "--presence-penalty", "0.5", check=True)
    Person.model_validate_json(p.stdout.removeprefix("x = ").strip())
    for args, words in ((["--json-schema", tmp_path / "none.json"], "cannot read it"),
                        (["--repeat-penalty", "0"], "--repeat-penalty must be more than 0"),
                        (["--frequency-penalty", "3"], "--frequency-penalty must be in [-2, 2]")):
        p = run_cli("run", "x", *args)
        assert p.returncode == 1 and words in p.stderr and p.stderr.count("\n") == 1, p.stderr
    schema.write_text('{"type": "string", "pattern": "(("}')
    p = run_cli("run", "x", "--json-schema", schema)
    assert p.returncode == 1 and "the JSON schema cannot be used: regex parse error" in p.stderr


# -- a prompt that opened the reasoning ------------------------------------------------------------------------
@needs_qwen3
def test_reasoning_comes_first_when_the_prompt_opened_it(qwen3):
    """The grammar lets the reasoning run free up to its close marker (here text: this vocabulary has no </think>
    token), then holds the JSON: walked token by token along replies it must accept and ones it must refuse."""
    from waste.text.grammar import after_reasoning, json_grammar

    eng = qwen3[1]
    tok = eng.tokenizer
    grammar = after_reasoning(json_grammar(SCHEMA), "</think>", tok, "response_format")
    end = tok.token_to_id("<|im_end|>")

    def walk(text: str) -> bool:
        c = eng.constraint(grammar, {end})
        for t in tok.encode(text) + [end]:
            if not c.allows(t):
                return False
            c.advance(t)
        return True

    good = '{"name": "A", "age": 3, "tags": []}'
    assert walk('Let me think {"not": "json yet"} about it.</think>\n\n' + good)
    assert walk("</think>" + good)
    assert not walk("No close marker, then " + good)
    assert not walk("thinking</think>\n\nplain text")
    assert not walk('thinking</think>\n\n{"name": "A", "age": 300, "tags": []}')     # age past its maximum


@needs_qwen3
def test_completions_json_and_n(client):
    r = client.completions.create(model="q", prompt="x = ", max_tokens=200, n=2, seed=9, temperature=1.0,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "p", "schema": SCHEMA}}})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.finish_reason == "stop"
        Person.model_validate_json(c.text)
