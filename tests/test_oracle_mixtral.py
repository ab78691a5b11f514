"""Mixtral (`mixtral`) against transformers 5.24.0 (`MixtralForCausalLM`) on a tiny random checkpoint written by its
own save_pretrained (the release's layout: `block_sparse_moe.experts.N.w1|w2|w3`), in float32: logits, routing,
prefill + decode, greedy text; then chat through the release's template (tests/data/templates, SOURCES.md) on the
engine, the server and `waste chat`."""
import json
import sys
from pathlib import Path

sys.modules.setdefault("fla", None)

import openai
import pytest
from chat_util import force_sampler, waste_chat_session
from fixtures import chat_release, check_greedy, check_logits_and_routes, check_split, converted, oracle_model, prompt
from serve_util import ThreadServer

from waste.errors import WasteError

TEMPLATE = Path(__file__).resolve().parent / "data" / "templates" / "mistralai-Mixtral-8x7B-Instruct-v0.1.jinja"
N_LAYERS = 3


BOS, EOS = 1, 0           # <s> and </s> as write_tokenizer numbers them below (checked there)


def mixtral_model(seed=0, **over):
    from transformers import MixtralConfig

    kw = dict(vocab_size=384, hidden_size=64, intermediate_size=48, num_hidden_layers=N_LAYERS,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=512,
              rms_norm_eps=1e-5, sliding_window=None, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None,
              tie_word_embeddings=False)
    kw.update(over)
    m = oracle_model(MixtralConfig(**kw), seed)
    return m


def mixtral_release(dst: Path, seed=0, **over) -> tuple:
    """(transformers model, release dir): the weights and config by save_pretrained, a byte-level tokenizer with
    Mixtral's <s> / </s>, and the release's chat template."""
    m = mixtral_model(seed, **over)
    assert chat_release(dst, m, ["</s>", "<s>"], TEMPLATE, bos_token="<s>") == {"<s>": BOS, "</s>": EOS}
    return m, dst


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    d = converted(root, *mixtral_release(root / "src"), "mx")
    yield d
    d["eng"].close()


def test_release_layout_converts_as_mixtral(mx):
    m = json.loads((mx["out"] / "manifest.json").read_text())
    cfg = m["config"]
    assert m["family"] == "mixtral" and cfg["gqa"]["qk_norm"] is False and cfg["gqa"]["rope_theta"] == 1e6
    assert [l["mlp"] for l in cfg["layers"]] == ["moe"] * N_LAYERS and cfg["moe"]["num_experts"] == 8
    assert cfg["moe"]["scoring"] == "softmax" and cfg["moe"]["norm_topk_prob"] is True
    assert "layers.0.mlp.gate.weight" in m["trunk"]["f32_tensors"]


def test_logits_and_routing_match_transformers(mx):
    check_logits_and_routes(mx["hf"], mx["eng"].model, prompt(40), 7e-6, range(N_LAYERS),
                            "mixtral")       # measured 6.4e-7


def test_prefill_then_decode_equals_one_forward(mx):
    check_split(mx["eng"].model, prompt(30, seed=2), 6, 3e-6, "mixtral")       # measured 2.6e-7


def test_greedy_continuation_matches_transformers(mx):
    check_greedy(mx["hf"], mx["eng"], prompt(8, seed=3))


@pytest.mark.parametrize("over,match", [
    ({"sliding_window": 128}, "sliding_window=128 is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope scaling"),
])
def test_what_waste_does_not_run_is_refused_by_name(tmp_path, over, match):
    from waste.convert.adapters import adapter_for

    hf = json.loads((mixtral_release(tmp_path / "r")[1] / "config.json").read_text())
    with pytest.raises(WasteError, match=match):
        adapter_for({**hf, **over})


# -- chat: the release's template ------------------------------------------------------------------------------
needs_template = pytest.mark.skipif(not TEMPLATE.is_file(), reason=f"{TEMPLATE} is absent")
CASES = [[{"role": "user", "content": "Hello there"}],
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Fibonacci in Python?"}]]


@needs_template
@pytest.mark.parametrize("case", range(len(CASES)))
def test_template_renders_as_transformers_does(mx, case):
    from transformers import AutoTokenizer

    from waste.chat import load_chat_format

    eng = mx["eng"]
    ours = load_chat_format(eng.container, eng.tokenizer).render(CASES[case])
    hf = AutoTokenizer.from_pretrained(str(mx["src"]))
    want = hf.apply_chat_template(CASES[case], add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ours.text == hf.apply_chat_template(CASES[case], add_generation_prompt=True, tokenize=False)
    assert ours.ids == list(want) and ours.ids[0] == eng.tokenizer.token_to_id("<s>")


@needs_template
def test_chat_stops_at_eos_on_engine_server_and_waste_chat(mx, monkeypatch):
    from waste.serve.app import ServerState

    eng = mx["eng"]
    tok, eos = eng.tokenizer, eng.tokenizer.token_to_id("</s>")
    reply = tok.encode("It is 4.")
    force_sampler(monkeypatch, reply + [eos] + tok.encode(" junk"))
    c = eng.chat([{"role": "user", "content": "2+2?"}])
    assert c.content == "It is 4." and c.finish_reason == "stop" and c.usage["completion_tokens"] == len(reply) + 1

    srv = ThreadServer(ServerState(engine=eng))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        force_sampler(monkeypatch, reply + [eos])
        r = client.chat.completions.create(model="mx", messages=CASES[1], max_tokens=20)
        assert r.choices[0].message.content == "It is 4." and r.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="tools"):     # Mixtral's template declares no tools
            client.chat.completions.create(model="mx", messages=CASES[0], max_tokens=4, tools=[{
                "type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    finally:
        srv.stop()

    force_sampler(monkeypatch, reply + [eos])
    s, shown = waste_chat_session(eng, monkeypatch, ["chat", "m", "-n", "20"], ["2+2?"])
    assert shown.strip() == "It is 4." and s.history[-1] == {"role": "assistant", "content": "It is 4."}


def test_waste_info_names_the_family(mx, capsys):
    from waste.cli import main

    assert main(["info", str(mx["out"])]) in (0, None)
    info = capsys.readouterr().out
    assert "mixtral" in info and "3: 3 gqa; 3 moe" in info and "8 routed per MoE layer, top-2 (softmax router)" in info
