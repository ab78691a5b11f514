"""DeepSeek-V3.2 (`deepseek_v32`) against transformers 5.24.0 (`DeepseekV32ForCausalLM`) on a tiny random checkpoint
written by its own save_pretrained (plus the MTP layer the release carries, left out with a note), in float32: MLA
with YaRN rotary as DeepSeek-V3, and on every layer DSA's lightning indexer (per-token keys, half-split rotary on the
first qk_rope_head_dim index channels, ReLU scores weighted per head, the index_topk best visible tokens). index_topk
is 16 here, so prompts past 16 tokens take the sparse branch. Then chat through DeepSeek-V3.2's template
(tests/data/templates, SOURCES.md): rendering as transformers renders it, reasoning and the DSML tool calls parsed on
the engine, the server and `waste chat`."""
import json
import sys
from contextlib import contextmanager
from pathlib import Path

sys.modules.setdefault("fla", None)

import pytest
import torch
from chat_util import (ASK, TEMPLATE_CASES, TOOLS, assert_renders_as_transformers, assert_tool_call_route,
                       force_generation, force_sampler, waste_chat_session)
from fixtures import (chat_release, check_greedy, check_logits_and_routes, check_split, converted, mtp_layer,
                      oracle_model, prompt, rel_l2)
from serve_util import ThreadServer

from waste.errors import WasteError

TEMPLATE = Path(__file__).resolve().parent / "data" / "templates" / "DeepSeek-V3.2.jinja"
N_LAYERS, TOPK = 4, 16
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
# the release's special tokens (bos 0, eos 1 as its config says) and the two the template writes for reasoning
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]


def v32_model(seed=0, **over):
    from transformers import DeepseekV32Config

    kw = dict(vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
              n_group=4, topk_group=2, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
              q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              index_topk=TOPK, index_head_dim=16, index_n_heads=16, rope_parameters=dict(YARN),
              max_position_embeddings=2048, routed_scaling_factor=2.5, rms_norm_eps=1e-6, pad_token_id=0,
              bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    kw.update(over)
    m = oracle_model(DeepseekV32Config(**kw), seed)
    return m


def v32_release(dst: Path, seed=0, **over):
    m = v32_model(seed, **over)
    assert chat_release(dst, m, SPECIALS, TEMPLATE, bos_token=SPECIALS[0], eos_token=SPECIALS[1]) == \
        {t: i for i, t in enumerate(SPECIALS)}
    mtp_layer(dst, N_LAYERS, (("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                              ("shared_head.norm.weight", (64,)), ("shared_head.head.weight", (384, 64))),
              {"num_nextn_predict_layers": 1})
    return m, dst


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v32")
    hf, src = v32_release(root / "src")
    d = converted(root, hf, src, "v32")
    yield d
    d["eng"].close()


@contextmanager
def oracle_index(hf):
    """transformers' own index scores [S, S] (its Tensor.topk input, the causal mask folded in as -inf) and top-k
    indices per layer, caught while it runs."""
    scores, picked, hooks = [], {}, []
    real = torch.Tensor.topk

    def topk(t, *a, **kw):
        if t.ndim == 3 and t.shape[1] == t.shape[2] and t.shape[0] == 1:     # the indexer's [B, S, T], not a router
            scores.append(t[0].clone())
        return real(t, *a, **kw)

    for i, layer in enumerate(hf.model.layers):
        hooks.append(layer.self_attn.indexer.register_forward_hook(
            lambda mod, inp, out, i=i: picked.__setitem__(i, out[0].clone())))
    torch.Tensor.topk = topk
    try:
        yield scores, picked
    finally:
        torch.Tensor.topk = real
        for h in hooks:
            h.remove()


def test_release_converts_as_deepseek_v32_without_its_mtp_layer(v32):
    m = json.loads((v32["out"] / "manifest.json").read_text())
    cfg = m["config"]
    assert m["family"] == "deepseek_v32" and [l["attn"] for l in cfg["layers"]] == ["mla"] * N_LAYERS
    assert [l["mlp"] for l in cfg["layers"]] == ["dense"] + ["moe"] * (N_LAYERS - 1)
    assert cfg["dsa"] == {"index_topk": TOPK, "index_kpool": 1, "index_n_heads": 16, "index_head_dim": 16,
                          "index_rope_dim": 8, "indexer_types": ["full"] * N_LAYERS}
    assert cfg["mla"]["rope"]["interleave"] is True and cfg["mtp_layers"] == 1
    assert "layers.2.self_attn.indexer.weights_proj.weight" in m["trunk"]["f32_tensors"]
    assert "layers.2.self_attn.indexer.k_norm.bias" in m["trunk"]["crc32"]
    assert not any(k.startswith(f"layers.{N_LAYERS}.") for k in m["trunk"]["crc32"])
    assert any(f"multi-token-prediction layer {N_LAYERS}" in n for n in m["notes"]), m.get("notes")


def test_release_config_as_deepseek_writes_it():
    """DeepSeek-V3.2-Exp's own config.json spelling (rope_scaling + rope_theta, the MTP count, fp8 blocks)."""
    from waste.convert.adapters import adapter_for

    hf = dict(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], vocab_size=129280,
              hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
              q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
              num_experts_per_tok=8, n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
              norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=1,
              num_nextn_predict_layers=1, index_head_dim=128, index_n_heads=64, index_topk=2048,
              max_position_embeddings=163840, rope_theta=10000, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
              rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
              quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})
    a = adapter_for(hf)
    assert a.family == "deepseek_v32"
    cfg = a.config
    assert cfg["dsa"]["index_topk"] == 2048 and cfg["dsa"]["index_rope_dim"] == 64
    assert cfg["dsa"]["index_n_heads"] == 64 and cfg["dsa"]["index_head_dim"] == 128
    assert [l["mlp"] for l in cfg["layers"][:4]] == ["dense"] * 3 + ["moe"] and cfg["mtp_layers"] == 1
    assert cfg["mla"]["rope"]["type"] == "yarn" and cfg["mla"]["rope"]["interleave"] is True
    names = a.layer_names(5, cfg["layers"][5], "model.layers.5")
    assert "model.layers.5.self_attn.indexer.wq_b.weight" in names


@pytest.mark.parametrize("over,match", [
    ({"mlp_layer_types": ["sparse", "sparse", "sparse", "sparse"]}, "mlp_layer_types .* disagrees"),
    ({"layer_types": ["full_attention"] * N_LAYERS}, r"layer types \['full_attention'\] are not supported"),
    ({"index_head_dim": 4}, r"index_head_dim \(4\) is below qk_rope_head_dim \(8\)"),
    ({"q_lora_rank": None}, "needs q_lora_rank"),
])
def test_what_waste_does_not_run_is_refused_by_name(v32, over, match):
    from waste.convert.adapters import adapter_for

    hf = json.loads((v32["src"] / "config.json").read_text())
    with pytest.raises(WasteError, match=match):
        adapter_for({**hf, **over})


def test_indexer_rotary_matches_transformers(v32):
    """The indexer's rotary (half-split on the first 8 of 16 channels, YaRN with its attention factor) against
    transformers' apply_rotary_pos_emb on its own cos / sin, past YaRN's original 64 positions."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    hf, cfg = v32["hf"], v32["eng"].model.dsa_cfg
    pos = torch.arange(90, 130)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(40, 16, 8, generator=g), torch.randn(40, 8, generator=g)
    cos, sin = hf.model.rotary_emb(q, pos[None])
    want_q, want_k = apply_rotary_pos_emb(q[None], k[None, :, None], cos, sin, unsqueeze_dim=2)
    got_q, got_k = cfg.rope(q, k, pos)
    assert rel_l2(got_q, want_q[0]) < 1e-6 and rel_l2(got_k, want_k[0, :, 0]) < 1e-6
    assert rel_l2(got_q, q) > 0.1      # it does rotate


def test_index_scores_and_selection_match_transformers(v32):
    """Per layer, the index scores of every visible (query, key) pair equal transformers' own, and each sparse
    query keeps the same index_topk tokens (a tie at the cut may be decided differently: none in this fixture)."""
    m, ids = v32["eng"].model, prompt(48)
    with oracle_index(v32["hf"]) as (scores, picked), torch.no_grad():
        v32["hf"](ids[None])
    m.dsa_trace = []
    try:
        m.forward(ids, m.new_state(), 0)
        trace = {layer: sel for layer, _, sel in m.dsa_trace}
    finally:
        m.dsa_trace = None
    assert len(scores) == N_LAYERS and sorted(trace) == list(range(N_LAYERS))
    vis = torch.ones(48, 48, dtype=torch.bool).tril()
    sparse = 0
    for layer in range(N_LAYERS):
        ours, theirs = trace[layer].scores, scores[layer]
        err = rel_l2(ours[vis], theirs[vis])
        print(f"layer {layer}: index scores rel L2 {err:.2e}")
        assert err < 1e-5, (layer, err)
        assert bool((theirs[~vis] < -1e30).all())          # the causal mask, added as float32 min
        for t in range(48):
            mine = set(trace[layer].keep[t].nonzero().squeeze(1).tolist())
            want = {i for i in picked[layer][t].tolist() if i <= t}
            if t < TOPK:
                assert mine == want == set(range(t + 1)), (layer, t)     # dense: every visible token
                continue
            sparse += 1
            cut = theirs[t, : t + 1].sort(descending=True).values
            assert cut[TOPK - 1] != cut[TOPK], (layer, t)      # no tie at the cut: the sets must agree
            assert mine == want and len(mine) == TOPK, (layer, t)
    assert sparse == N_LAYERS * (48 - TOPK)


def test_logits_and_routing_match_transformers(v32):
    ids = prompt(48)
    check_logits_and_routes(v32["hf"], v32["eng"].model, ids, 1e-5, range(1, N_LAYERS), "deepseek_v32")
    # the sparse branch changes the answer: the same weights with index_topk past the prompt are a dense model
    dense = v32["eng"].model
    saved = dense.dsa_cfg
    try:
        dense.dsa_cfg = type(saved)(**{**saved.__dict__, "topk": 64})
        whole = dense.forward(ids, dense.new_state(), 0)
    finally:
        dense.dsa_cfg = saved
    sparse = dense.forward(ids, dense.new_state(), 0)
    assert rel_l2(sparse[:TOPK], whole[:TOPK]) < 1e-6 and rel_l2(sparse[TOPK:], whole[TOPK:]) > 1e-2


def test_prefill_then_decode_equals_one_forward(v32):
    check_split(v32["eng"].model, prompt(40, seed=2), 12, 5e-6, "deepseek_v32")   # 12 sparse absorbed decode steps


def test_greedy_continuation_matches_transformers(v32):
    check_greedy(v32["hf"], v32["eng"], prompt(8, seed=3))       # 8 + 32 tokens: decode runs past index_topk


def test_plan_counts_the_indexer_cache(v32):
    """`waste plan`'s state bytes: the MLA latent plus one index key per token per layer, which is what a sequence's
    state allocates."""
    from waste.runtime.plan import state_bytes

    m = v32["eng"].model
    cfg = v32["eng"].container.config
    st = m.new_state()
    held = sum(r._b.t.numel() * r._b.t.element_size() for s in st
               for r in (s.mla._c, s.mla._pe, s.index.pool_rows))
    assert state_bytes(cfg, m.capacity, torch.float32) == held
    no_index = state_bytes({**cfg, "dsa": None}, m.capacity, torch.float32)
    assert held - no_index == N_LAYERS * (m.capacity + 1) * 16 * 4


def test_waste_info_names_the_features(v32, capsys):
    from waste.cli import main

    assert main(["info", str(v32["out"])]) in (0, None)
    info = capsys.readouterr().out
    assert "deepseek_v32" in info and "DSA on 4 MLA layers: the index_topk 16 best visible tokens per query, 16 " \
        "index heads x 16, rotary on the first 8 index channels (half-split), dense below index_topk" in info


# -- chat: DeepSeek-V3.2's template -------------------------------------------------------------------------------
needs_template = pytest.mark.skipif(not TEMPLATE.is_file(), reason=f"{TEMPLATE} is absent")
# a reply as the template has V3.2 write one (the prompt opened <think>): reasoning, text, one DSML call, eos
REPLY = ('The user wants the weather.</think>Checking.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
         '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
         '</｜DSML｜function_calls>')


@needs_template
@pytest.mark.parametrize("name", TEMPLATE_CASES)
def test_template_renders_as_transformers_does(v32, name):
    ids = assert_renders_as_transformers(v32["eng"], v32["src"], name)
    assert ids[0] == 0          # the template writes the release's bos, id 0


@needs_template
def test_reasoning_and_dsml_tool_calls_on_engine_server_and_waste_chat(v32, monkeypatch, tmp_path):
    from waste.serve.app import ServerState

    eng = v32["eng"]
    tok = eng.tokenizer
    eos = tok.token_to_id(SPECIALS[1])
    reply = tok.encode(REPLY) + [eos]
    force_sampler(monkeypatch, reply)
    c = eng.chat(ASK, tools=TOOLS)
    assert c.reasoning_content == "The user wants the weather." and c.content == "Checking."
    assert c.finish_reason == "tool_calls" and c.tool_calls[0]["function"]["name"] == "get_weather"
    assert json.loads(c.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}

    srv = ThreadServer(ServerState(engine=eng))
    try:
        force_generation(monkeypatch, reply)       # per decoding: the plain request, then the streamed one
        client, m = assert_tool_call_route(srv.url, "v32", "The user wants the weather.", "Checking.",
                                           {"city": "Paris", "days": 3}, max_tokens=600)
        follow = [*ASK, m.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": '{"temp": 21}'}]
        force_generation(monkeypatch, tok.encode("Sunny.</think>It is sunny.") + [eos])
        r = client.chat.completions.create(model="v32", messages=follow, tools=TOOLS, max_tokens=64)
        assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.reasoning_content == "Sunny."
    finally:
        srv.stop()

    monkeypatch.undo()
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    s, shown = waste_chat_session(eng, monkeypatch, ["chat", "v32", "-n", "600", "--tools", str(tools)],
                                  ["Weather in Paris?", '/result {"temp": 21}'],
                                  [reply, tok.encode("Sunny.</think>It is sunny.") + [eos]])
    assert "[tool call get_weather(" in shown and shown.rstrip().endswith("It is sunny."), shown
    assert [m["role"] for m in s.history] == ["user", "assistant", "tool", "assistant"]
    assert s.history[3]["content"] == "It is sunny."
