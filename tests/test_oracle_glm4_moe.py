"""GLM-4.5 / 4.6 (`glm4_moe`) against transformers 5.24.0 (`Glm4MoeForCausalLM`) on a tiny random checkpoint written
by its own save_pretrained, in float32: partial rotary (half of each head), q/k/v biases, a dense first layer, the
sigmoid router with correction bias and routed scaling, a shared expert; the release also carries an MTP layer (left
out with a note). Then chat through GLM-4.6's template (tests/data/templates, SOURCES.md): rendering as transformers
renders it, reasoning and GLM's <arg_key> / <arg_value> tool calls parsed on the engine, the server and
`waste chat`."""
import json
import sys
from pathlib import Path

sys.modules.setdefault("fla", None)

import openai
import pytest
import torch
from chat_util import ASK, TEMPLATE_CASES, TOOLS, assert_renders_as_transformers, force_sampler, waste_chat_session
from fixtures import (chat_release, check_greedy, check_logits_and_routes, check_split, converted, mtp_layer,
                      oracle_model, prompt, rel_l2)
from serve_util import ThreadServer

import waste
from waste.convert.convert import convert
from waste.errors import WasteError

TEMPLATE = Path(__file__).resolve().parent / "data" / "templates" / "GLM-4.6.jinja"
N_LAYERS = 4
# GLM's control tokens (the release's added tokens the template writes); the first is the end of text
SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
EOS = [0, 4, 6]      # <|endoftext|>, <|user|>, <|observation|>: the release's eos_token_id list (checked below)


def glm4_moe_model(seed=0, **over):
    from transformers import Glm4MoeConfig

    kw = dict(vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
              n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True,
              use_qk_norm=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                  "partial_rotary_factor": 0.5},
              max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=EOS,
              pad_token_id=0, tie_word_embeddings=False)
    kw.update(over)
    m = oracle_model(Glm4MoeConfig(**kw), seed)
    return m


def glm4_release(dst: Path, seed=0, **over):
    m = glm4_moe_model(seed, **over)
    ids = chat_release(dst, m, SPECIALS, TEMPLATE)
    assert [ids[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")] == EOS
    mtp_layer(dst, N_LAYERS, (("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                              ("shared_head.norm.weight", (64,))))
    return m, dst


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4")
    d = converted(root, *glm4_release(root / "src"), "glm")
    yield d
    d["eng"].close()


def test_release_converts_as_glm4_moe_without_its_mtp_layer(glm):
    m = json.loads((glm["out"] / "manifest.json").read_text())
    cfg = m["config"]
    assert m["family"] == "glm4_moe" and cfg["gqa"]["rotary_dim"] == 8 and cfg["gqa"]["bias"] is True
    assert [l["mlp"] for l in cfg["layers"]] == ["dense"] + ["moe"] * (N_LAYERS - 1)
    assert cfg["moe"]["scoring"] == "sigmoid" and cfg["moe"]["routed_scaling_factor"] == 2.5
    assert cfg["moe"]["num_shared_experts"] == 1 and cfg["mtp_layers"] == 1
    assert not any(k.startswith(f"layers.{N_LAYERS}.") for k in m["trunk"]["crc32"])
    assert any(f"multi-token-prediction layer {N_LAYERS}" in n for n in m["notes"]), m.get("notes")


def test_partial_rotary_matches_transformers():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    from waste.layers.rope import RopeTable, apply_rope_table

    cfg = Glm4MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    pos = torch.arange(50)
    cos, sin = Glm4MoeRotaryEmbedding(cfg)(torch.zeros(1), pos[None])
    q, k = torch.randn(1, 4, 50, 16, generator=torch.Generator().manual_seed(0)).unbind(0)[0], torch.randn(4, 50, 16)
    want_q, want_k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    table = RopeTable(16, 1e6, 40, torch.float32, rotary_dim=8)       # 40: positions past the table are computed
    c, s = table.at(0, 50)
    got_q = apply_rope_table(q.transpose(0, 1), c, s, table.R).transpose(0, 1)
    got_k = apply_rope_table(k.transpose(0, 1), c, s, table.R).transpose(0, 1)
    assert rel_l2(got_q, want_q[0]) < 1e-6 and rel_l2(got_k, want_k[0]) < 1e-6
    assert torch.equal(got_q[..., 8:], q[..., 8:])                  # the pass-through half, bit for bit


def test_logits_and_routing_match_transformers(glm):
    check_logits_and_routes(glm["hf"], glm["eng"].model, prompt(48), 5e-6, range(1, N_LAYERS),
                            "glm4_moe")      # measured 4.4e-7


def test_prefill_then_decode_equals_one_forward(glm):
    check_split(glm["eng"].model, prompt(30, seed=2), 6, 3e-6, "glm4_moe")     # measured 2.3e-7


def test_greedy_continuation_matches_transformers(glm):
    check_greedy(glm["hf"], glm["eng"], prompt(8, seed=3))


def test_qk_norm_variant_matches_transformers(tmp_path):
    hf, src = glm4_release(tmp_path / "src", seed=1, use_qk_norm=True, n_group=2, topk_group=1)
    with waste.load(convert(src, tmp_path / "o.waste", experts="bf16", trunk="bf16", progress=False),
                    dtype="float32") as eng:
        ids = prompt(24, seed=5)
        check_logits_and_routes(hf, eng.model, ids, 6e-6, range(1, N_LAYERS),
                                "glm4_moe qk_norm + grouped routing")       # measured 6.0e-7


@pytest.mark.parametrize("over,match", [
    ({"partial_rotary_factor": 0.1, "rope_parameters": None}, "partial_rotary_factor 0.1 of head_dim 16 gives 1"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope scaling"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
])
def test_what_waste_does_not_run_is_refused_by_name(glm, over, match):
    from waste.convert.adapters import adapter_for

    hf = json.loads((glm["src"] / "config.json").read_text())
    with pytest.raises(WasteError, match=match):
        adapter_for({k: v for k, v in {**hf, **over}.items() if v is not None})


def test_waste_info_names_the_features(glm, capsys):
    from waste.cli import main

    assert main(["info", str(glm["out"])]) in (0, None)
    info = capsys.readouterr().out
    assert "glm4_moe" in info and "partial rotary: the first 8 of 16 dimensions of each head rotate" in info
    assert "q / k / v projection biases" in info and "(sigmoid router, correction bias), 1 shared" in info


# -- chat: GLM-4.6's template ----------------------------------------------------------------------------------
needs_template = pytest.mark.skipif(not TEMPLATE.is_file(), reason=f"{TEMPLATE} is absent")
# a reply as GLM-4.6 writes one: reasoning, text, one call with GLM's key / value pairs, then <|observation|>
REPLY = ("\n<think>The user wants the weather.</think>\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
         "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")


@needs_template
@pytest.mark.parametrize("name", TEMPLATE_CASES)
def test_template_renders_as_transformers_does(glm, name):
    assert_renders_as_transformers(glm["eng"], glm["src"], name)


@needs_template
def test_reasoning_and_tool_calls_on_engine_server_and_waste_chat(glm, monkeypatch, tmp_path):
    from waste.serve.app import ServerState

    eng = glm["eng"]
    tok = eng.tokenizer
    reply = tok.encode(REPLY) + [tok.token_to_id("<|observation|>")]
    force_sampler(monkeypatch, reply)
    c = eng.chat(ASK, tools=TOOLS)
    assert c.reasoning_content == "The user wants the weather." and c.content == "Checking.\n"
    assert c.finish_reason == "tool_calls" and c.tool_calls[0]["function"]["name"] == "get_weather"
    assert json.loads(c.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}

    srv = ThreadServer(ServerState(engine=eng))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        force_sampler(monkeypatch, reply)
        r = client.chat.completions.create(model="glm", messages=ASK, tools=TOOLS, max_tokens=200)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and m.reasoning_content == "The user wants the weather."
        assert m.tool_calls[0].function.name == "get_weather"
        assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
        follow = [*ASK, m.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": '{"temp": 21}'}]
        force_sampler(monkeypatch, tok.encode("\n<think></think>\nIt is sunny.") + [tok.token_to_id("<|user|>")])
        r = client.chat.completions.create(model="glm", messages=follow, tools=TOOLS, max_tokens=64)
        assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    finally:
        srv.stop()

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    monkeypatch.undo()
    s, shown = waste_chat_session(eng, monkeypatch, ["chat", "glm", "-n", "200", "--tools", str(tools)],
                                  ["Weather in Paris?", '/result {"temp": 21}'],
                                  [reply, tok.encode("\n<think>Sunny.</think>\nIt is sunny.")
                                   + [tok.token_to_id("<|user|>")]])
    assert "[tool call get_weather(" in shown and shown.rstrip().endswith("It is sunny.")
    assert [m["role"] for m in s.history] == ["user", "assistant", "tool", "assistant"]
    assert s.history[3]["content"] == "It is sunny."
