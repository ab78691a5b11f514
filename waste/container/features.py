"""The architecture features a container's config switches on, in words (`waste info`): each is behind a config
key that containers without the feature lack, so a person can see which code paths a model reaches."""
from __future__ import annotations


def features(manifest: dict, family_features: list[str] = ()) -> list[str]:
    """The lines every family's config may switch on, then `family_features` (the family record's, which this
    layer cannot read: models/family.py), the vision tower and the conversion's notes."""
    cfg = manifest["config"]
    out = []
    kinds = [l["attn"] for l in cfg["layers"]]
    d = cfg.get("dsa")
    if d and d.get("index_rope_dim") is not None:      # per-token DSA (DeepSeek-V3.2)
        out.append(f"DSA on {kinds.count('mla')} MLA layers: the index_topk {d['index_topk']} best visible tokens "
                   f"per query, {d['index_n_heads']} index heads x {d['index_head_dim']}, rotary on the first "
                   f"{d['index_rope_dim']} index channels (half-split), dense below index_topk")
    elif d:
        shared = sum(1 for t in d.get("indexer_types") or [] if t == "shared")
        out.append(f"DSA on {kinds.count('mla')} MLA layers: index_topk {d['index_topk']} = "
                   f"{d['index_topk'] // d['index_kpool']} pools of {d['index_kpool']} tokens (index_kpool), "
                   f"{d['index_n_heads']} index heads x {d['index_head_dim']}, incomplete tail always attended, "
                   f"dense below index_topk" + (f", {shared} layer(s) sharing a selection" if shared else ""))
    if cfg.get("swiglu_limit") is not None:
        out.append(f"clamped SwiGLU: silu(min(gate, {cfg['swiglu_limit']:g})) * clamp(up, +-{cfg['swiglu_limit']:g})")
    k = cfg.get("kda") or {}
    if "kda" in kinds and k.get("gate_lower_bound") is not None:
        out.append(f"KDA decay gate with lower bound {k['gate_lower_bound']:g}")
    if "kda" in kinds and k.get("full_rank_gate"):
        out.append("KDA full-rank output gate")
    if "mla" in kinds and (cfg.get("mla") or {}).get("output_gate"):
        out.append("MLA output gate")
    rope = (cfg.get("mla") or {}).get("rope") if "mla" in kinds else None
    if rope:
        r = f"MLA rotary: {rope['type']}, theta {rope['theta']:g}{', interleaved' if rope.get('interleave') else ''}"
        if rope["type"] == "yarn":
            r += f", factor {rope['factor']:g} over {rope['original_max_position_embeddings']} positions"
        out.append(r)
    elif "mla" in kinds:
        out.append("MLA without rotary")
    moe = cfg.get("moe") or {}
    if moe.get("latent"):
        out.append(f"latent MoE: routed experts read and write {moe['expert_hidden']} wide (hidden "
                   f"{cfg['hidden_size']}), projected down once and up once per layer"
                   + (", the weighted sum normed" if moe.get("latent_norm") else ""))
    if moe.get("expert_act") == "situ_glu":
        lb = moe.get("situ_linear_beta")
        out.append(f"SiTU-GLU: (b tanh(g/b) sigmoid(g)) * {f'lb tanh(u/lb)' if lb is not None else 'u'}, "
                   f"b {moe.get('situ_beta', 1.0):g}" + (f", lb {lb:g}" if lb is not None else ""))
    if (moe.get("n_group") or 1) > 1:
        out.append(f"grouped routing: top-{moe['topk_group']} of {moe['n_group']} expert groups")
    out += family_features
    v = manifest.get("vision")
    if v:
        out.append(f"vision tower: {v['tensors']} tensors, {v['params']:,} parameters in {v['file']} "
                   "(never read for text)")
    out += manifest.get("notes") or []
    return out
