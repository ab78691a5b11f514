"""Server promises from README.md, on the fixture release alone (nothing from ../shared): the API key from
WASTE_API_KEY, sampling defaults from the release's generation_config.json, and logprobs equal to log_softmax of
transformers' logits on the same weights."""
import json
import shutil

import httpx
import openai
import pytest
import torch
from serve_util import ProcessServer, ThreadServer

import waste
from waste.convert.convert import convert
from waste.serve.app import ServerState

PROMPT = "def fibonacci(n):"


def test_api_key_from_the_environment(releases, monkeypatch):
    """`waste serve` with WASTE_API_KEY set and no --api-key: /v1/* needs the key, /health does not."""
    monkeypatch.setenv("WASTE_API_KEY", "sk-from-env")
    srv = ProcessServer(releases["qwen3_moe"][2])
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(srv.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-from-env", max_retries=0, timeout=120)
        model = c.models.list().data[0].id
        r = c.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
    finally:
        srv.stop()


def _container(releases, root, generation_config):
    src = root / "src"
    shutil.copytree(releases["qwen3_moe"][1], src)
    (src / "generation_config.json").unlink(missing_ok=True)
    if generation_config is not None:
        (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, **generation_config}))
    return convert(src, root / "m.waste", experts="bf16", trunk="bf16", progress=False)


def _texts(url, *bodies):
    out = []
    for body in bodies:
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, **body}, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


@pytest.mark.parametrize("config,explicit", [
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, {"temperature": 0}),     # do_sample false: greedy
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20}, {"temperature": 0.6, "top_p": 0.9, "top_k": 20}),
    (None, {"temperature": 1.0, "top_p": 1.0}),                                        # none: OpenAI's defaults
], ids=["greedy", "sampled", "openai"])
def test_sampling_defaults_come_from_generation_config(config, explicit, releases, tmp_path):
    """A request that names no sampling field gets the release's defaults: the same text as the request that names
    them, seed for seed; and the sampled defaults really sample (some seed's text differs from greedy)."""
    with waste.load(_container(releases, tmp_path, config)) as eng:
        srv = ThreadServer(ServerState(engine=eng))
        try:
            for seed in (1, 2, 3):
                default, named = _texts(srv.url, {"seed": seed}, {"seed": seed, **explicit})
                assert default == named, (seed, default, named)
            greedy = _texts(srv.url, {"temperature": 0})[0]
            defaults = _texts(srv.url, *({"seed": s} for s in range(4)))
            if explicit.get("temperature") == 0:
                assert set(defaults) == {greedy}
            else:
                assert any(t != greedy for t in defaults)
        finally:
            srv.stop()


def test_logprobs_are_log_softmax_of_transformers_logits(releases):
    """/v1/completions logprobs: each chosen token's logprob and the top-3 alternatives equal log_softmax of the
    oracle's float32 logits at that position (the engine agrees with it to 1e-7 in float32, docs/LEARNED.md §2e)."""
    hf, _, container = releases["qwen3_moe"]
    with waste.load(container, dtype="float32") as eng:
        srv = ThreadServer(ServerState(engine=eng))
        try:
            ids = eng.encode(PROMPT)
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                             "logprobs": 3}, timeout=120).json()
        finally:
            srv.stop()
        tok = eng.tokenizer
    lp = r["choices"][0]["logprobs"]
    n = len(lp["token_logprobs"])
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
        ref = torch.log_softmax(hf(torch.tensor([ids + out])).logits[0].double(), -1)
    assert n >= 4 and r["choices"][0]["text"] == tok.decode(out)
    for i in range(n):
        row = ref[len(ids) - 1 + i]
        top = row.topk(3)
        assert abs(lp["token_logprobs"][i] - row[out[i]].item()) < 1e-4, i
        # alternatives are keyed by their text (OpenAI's shape), so ids whose text is the same share one key
        want: dict[str, list[float]] = {}
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            want.setdefault(tok.decode([t]), []).append(v)
        got = lp["top_logprobs"][i]
        assert set(got) == set(want), i
        assert all(any(abs(v - w) < 1e-4 for w in want[k]) for k, v in got.items()), i
