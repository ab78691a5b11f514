"""GLM-5.3-Flash (`glm5_next`) against transformers 5.24.0 (`Glm5NextForConditionalGeneration`) on a tiny random
checkpoint written by its own save_pretrained, in float32.

Dense regime (index_topk >= every length used): logits, routing, prefill + decode, greedy text.
Sparse regime (the same weights with index_topk lowered to 2 pools; in the container it is the manifest knob):
the indexer's pool scores against the oracle's, the selected pools as sets allowing exact ties, and the attention
given the oracle's own selection (architectures.md §3.5: a logit diff cannot tell a ranking error from a tie).
"""
import json
import shutil
import sys

sys.modules.setdefault("fla", None)

import pytest
import torch
import torch.nn.functional as F
from fixtures import (_randomise, assert_same_routes, greedy_pair, hooked_logits, prompt, rel_l2, routed_forward,
                      save_release, split_and_whole)

import waste
from waste.convert.convert import convert
from waste.layers.dsa import DSACache, IndexerCache, dsa_forward, extend_index, index_scores, indexer_keys, \
    keep_from_indices, select

KPOOL, TOPK_DENSE, TOPK_SPARSE = 4, 128, 8
LAYER_TYPES = ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention", "indexed_attention"]
DSA_LAYERS = [1, 3, 4]          # 4 shares layer 3's selection
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
              projection_intermediate_size=64)


def text_config(**over):
    kw = dict(vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
              v_head_dim=16, qk_rope_head_dim=0, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
              index_topk=TOPK_DENSE, index_head_dim=16, index_n_heads=4, index_kpool=KPOOL,
              layer_types=LAYER_TYPES, indexer_types=["full"] * 4 + ["shared"],
              mlp_layer_types=["dense"] + ["sparse"] * 4, hc_mult=4, hc_sinkhorn_iters=20,
              swiglu_limit=1.5,          # low enough that the clamp bites on these random activations
              rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=[0, 1, 2], bos_token_id=None)
    kw.update(over)
    return kw


def glm5_model(seed=0, **over):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config=text_config(**over), vision_config=VISION)
    m = Glm5NextForConditionalGeneration._from_config(cfg, attn_implementation="eager",
                                                      experts_implementation="eager").float().eval()
    _randomise(m, seed)
    return m


def with_topk(container, dst, topk):
    """A copy of a container with the manifest's index_topk knob changed (what a person may edit)."""
    shutil.copytree(container, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["config"]["dsa"]["index_topk"] = topk
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5")
    hf = glm5_model()
    src = save_release(hf, root / "src")
    dense = convert(src, root / "glm5.waste", experts="bf16", trunk="bf16", progress=False)
    sparse = with_topk(dense, root / "glm5-sparse.waste", TOPK_SPARSE)
    hf_sparse = glm5_model(index_topk=TOPK_SPARSE)
    return {"hf": hf, "hf_sparse": hf_sparse, "src": src, "dense": dense, "sparse": sparse,
            "eng": waste.load(dense, dtype="float32"), "eng_sparse": waste.load(sparse, dtype="float32")}


def hf_layers(model):
    return model.model.language_model.layers


def hf_forward(model, ids):
    """Logits, per MoE layer the routed experts, per DSA layer its input / output / indexer selection."""
    routes, seen, hooks = {}, {}, []
    for i, layer in enumerate(hf_layers(model)):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, i=i: routes.__setitem__(i, out[2].clone())))
        if i in DSA_LAYERS:
            def pre(mod, args, kwargs, i=i):
                seen.setdefault(i, {})["x"] = kwargs["hidden_states"][0].clone()

            def post(mod, args, kwargs, out, i=i):
                seen[i]["out"] = out[0][0].clone()
            hooks.append(layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(layer.self_attn.register_forward_hook(post, with_kwargs=True))
            if layer.self_attn.indexer is not None:
                def ipre(mod, args, kwargs, i=i):
                    seen[i]["q_resid"] = kwargs["q_resid"][0].clone()

                def ipost(mod, args, kwargs, out, i=i):
                    seen[i]["topk"] = out[0].clone()
                hooks.append(layer.self_attn.indexer.register_forward_pre_hook(ipre, with_kwargs=True))
                hooks.append(layer.self_attn.indexer.register_forward_hook(ipost, with_kwargs=True))
    return hooked_logits(model, ids, hooks), routes, seen


def hf_index_scores(indexer, x, q_resid):
    """transformers' own indexer math up to its top-k (no cache): [T, pools] scores of the complete pools."""
    x, q_resid = x[None], q_resid[None]
    T = x.shape[1]
    with torch.no_grad():
        q = indexer.wq_b(q_resid).view(1, T, -1, indexer.head_dim)
        k = indexer.k_norm(indexer.wk(x))
        gate = F.linear(x, indexer.index_kpool_compress_gate)
        packed = torch.cat([k, gate, torch.ones(1, T, 1)], dim=-1)
        pool_keys, _, _ = indexer.get_pooled_states(packed_states=packed)
        s = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
        w = indexer.weights_proj(x).float() * indexer.n_heads ** -0.5
        return torch.matmul(w.unsqueeze(-2), s).squeeze(-2)[0]


# -- dense regime ---------------------------------------------------------------------------------------------

def test_dense_logits_and_routing_match_transformers(glm):
    ids = prompt(80)                       # crosses KDA's 64-token chunk; 80 <= index_topk: the dense path
    ref, ref_routes, _ = hf_forward(glm["hf"], ids)
    logits, ours = routed_forward(glm["eng"].model, ids)
    err = rel_l2(logits, ref)
    print(f"glm5_next dense logits rel L2 {err:.2e}")
    assert err < 2e-5                     # measured 2.2e-6
    assert sorted(ours) == [1, 2, 3, 4]
    assert_same_routes(ours, ref_routes)


@pytest.mark.parametrize("which", ["eng", "eng_sparse"])
def test_prefill_then_decode_equals_one_forward(glm, which):
    m = glm[which].model
    # sparse container: queries past 12 tokens select 2 of up to 9 pools
    split, full = split_and_whole(m, prompt(40, seed=2), 8)
    print(f"glm {which} split {rel_l2(split, full):.2e}")
    assert rel_l2(split, full) < 1e-5            # measured 2.7e-6 (dense), 1.9e-6 (sparse)
    assert torch.equal(split.argmax(-1), full.argmax(-1))


def test_greedy_continuation_matches_transformers(glm):
    ref, got = greedy_pair(glm["hf"], glm["eng"], prompt(8, seed=3))
    assert got == ref and len(ref) == 32


# -- sparse regime --------------------------------------------------------------------------------------------

def _pool_sets(idx_row, n_vis):
    toks = {int(t) for t in idx_row.tolist() if t >= 0}
    return {t // KPOOL for t in toks if t < n_vis * KPOOL}, {t for t in toks if t >= n_vis * KPOOL}


def test_sparse_indexer_scores_and_selection_match_transformers(glm):
    ids = prompt(40, seed=4)
    _, _, seen = hf_forward(glm["hf_sparse"], ids)
    m = glm["eng_sparse"].model
    cfg, budget = m.dsa_cfg, TOPK_SPARSE // KPOOL
    assert cfg.topk == TOPK_SPARSE
    sparse_queries = ties = 0
    for layer in (1, 3):
        s = seen[layer]
        x, q_resid, w = s["x"], s["q_resid"], m.attn_w[layer]
        ref = hf_index_scores(hf_layers(glm["hf_sparse"])[layer].self_attn.indexer, x, q_resid)
        k, g = indexer_keys(x, w, cfg)
        cache = extend_index(IndexerCache.empty(cfg), k, g, w["indexer.index_kpool_compress_ape"], KPOOL)
        ours = index_scores(x, q_resid, cache.pools, w, cfg)
        assert ours.shape == ref.shape == (40, 10)
        err = rel_l2(ours, ref)
        print(f"layer {layer}: index scores rel L2 {err:.2e}, max abs {(ours - ref).abs().max().item():.1e}")
        assert err < 1e-6                 # measured 0
        sel = select(ours, 0, len(ids), cfg)
        for t in range(len(ids)):
            n_vis = (t + 1) // KPOOL
            hf_pools, hf_tail = _pool_sets(s["topk"][t], n_vis)
            assert hf_tail == set(range(n_vis * KPOOL, t + 1)), (layer, t)     # the tail is always attended
            if n_vis <= budget:
                assert sel.pools[t] is None and hf_pools == set(range(n_vis)), (layer, t)
                continue
            sparse_queries += 1
            mine = set(sel.pools[t])
            assert len(mine) == len(hf_pools) == budget
            if mine != hf_pools:            # only an exact tie at the cut may be decided differently
                cut = ref[t, :n_vis].sort(descending=True).values[budget - 1]
                for p in mine ^ hf_pools:
                    assert abs(ref[t, p] - cut) <= 1e-6 * ref[t, :n_vis].abs().max(), (layer, t, p)
                ties += 1
    print(f"{sparse_queries} sparse selections, {ties} decided differently on an exact tie")
    assert sparse_queries >= 50


def test_sparse_attention_given_the_oracle_selection(glm):
    ids = prompt(40, seed=5)
    _, _, seen = hf_forward(glm["hf_sparse"], ids)
    m = glm["eng_sparse"].model
    for layer in DSA_LAYERS:
        s = seen[layer]
        topk = seen[layer if layer != 4 else 3]["topk"]         # layer 4 reuses layer 3's selection
        keep = keep_from_indices(topk, len(ids))
        assert not bool(keep.tril().eq(keep).logical_not().any())   # the oracle never selects the future
        for absorb in (False, True):
            st = DSACache.empty(m.mla_cfg, m.dsa_cfg, layer != 4)
            out, _, _ = dsa_forward(s["x"], m.attn_w[layer], m.mla_cfg, m.dsa_cfg, st, keep=keep, absorb=absorb)
            err = rel_l2(out, s["out"])
            print(f"layer {layer} absorb={absorb}: attention given the oracle's keys, rel L2 {err:.2e}")
            assert err < 2e-6             # measured 0 (naive), 2.3e-7 (absorbed)


def test_sparse_branch_is_reached_and_agrees_end_to_end(glm):
    """The whole sparse model against the oracle: every selection equal as a set (an exact tie may be decided the
    other way; from that position on the two models' inputs differ, so only earlier positions are compared), the
    logits as close as in the dense regime, and different from the dense model's: the sparse branch is reached."""
    ids = prompt(40, seed=7)
    ref, _, seen = hf_forward(glm["hf_sparse"], ids)
    m = glm["eng_sparse"].model
    m.dsa_trace = []
    try:
        logits = m.forward(ids, m.new_state(), 0)
        trace = {layer: sel for layer, _, sel in m.dsa_trace}
    finally:
        m.dsa_trace = None
    budget, upto, compared = TOPK_SPARSE // KPOOL, len(ids), 0
    for layer in (1, 3):
        sel = trace[layer]
        theirs = hf_index_scores(hf_layers(glm["hf_sparse"])[layer].self_attn.indexer, seen[layer]["x"],
                                 seen[layer]["q_resid"])        # the oracle's scores on the oracle's inputs
        for t in range(upto):
            n_vis = (t + 1) // KPOOL
            if sel.pools[t] is None:
                continue
            hf_pools, _ = _pool_sets(seen[layer]["topk"][t], n_vis)
            if set(sel.pools[t]) != hf_pools:
                cut = theirs[t, :n_vis].sort(descending=True).values[budget - 1]
                assert all(abs(theirs[t, p] - cut) <= 1e-6 * theirs[t, :n_vis].abs().max()
                           for p in set(sel.pools[t]) ^ hf_pools), (layer, t)
                upto = t
                break
            compared += 1
    err = rel_l2(logits[:upto], ref[:upto])
    print(f"sparse end to end: {compared} sparse selections equal, logits rel L2 {err:.2e} over {upto} positions")
    assert compared >= 40 and upto >= 30 and err < 2e-5      # measured 1.7e-6
    dense = glm["eng"].model.forward(ids, glm["eng"].model.new_state(), 0)
    assert rel_l2(logits, dense) > 1e-2          # the sparse branch really changes the answer


def test_dsa_dump_prints_winning_pools(glm, capfd, monkeypatch):
    monkeypatch.setenv("WASTE_DUMP_DSA", "1")
    eng = waste.load(glm["sparse"], dtype="float32")
    try:
        eng.generate(prompt(20, seed=7).tolist(), max_tokens=2)
    finally:
        eng.close()
    err = capfd.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("dsa layer")]
    assert any(l.startswith("dsa layer 1 pos 19: 2 of 5 pools [") and "best loser" in l for l in lines), lines[:3]
    assert any(l.startswith("dsa layer 3 pos 20: 2 of 5 pools [") for l in lines)     # the first decode step
    assert any(l.startswith("dsa layer 1 pos 3: dense: all 1 pools") for l in lines)
    assert not any(l.startswith("dsa layer 4 ") for l in lines)                       # shared: layer 3's lines
