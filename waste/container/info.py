"""What `waste info` reports about a container, as a plain dict."""
from __future__ import annotations

from collections import Counter

from . import Container
from .features import features


def describe(c: Container, family_features: list[str] = ()) -> dict:
    """`family_features`: the family record's lines (models/family.py `features_of`), given by the caller."""
    m, cfg = c.manifest, c.config
    attn = Counter(l["attn"] for l in cfg["layers"])
    mlp = Counter(l["mlp"] for l in cfg["layers"])
    moe = cfg.get("moe") or {}
    shared = moe.get("num_shared_experts") or 0
    experts = (f"{moe['num_experts']} routed per MoE layer, top-{moe['top_k']} ({moe['scoring']} router"
               f"{', correction bias' if moe.get('correction_bias') else ''}), {shared} shared"
               if moe.get("num_experts") else "none")
    text = m["text"]
    return {
        "family": m["family"],
        "layers": cfg["layers"],
        "layers_summary": f"{cfg['num_layers']}: " + ", ".join(f"{n} {k}" for k, n in attn.items()) + "; "
                          + ", ".join(f"{n} {k}" for k, n in mlp.items()),
        "experts_summary": experts,
        "features": features(m, family_features),
        "moe_layers": len(m["experts"]["layers"]),
        "params": m["params"],
        "trunk_bytes": m["trunk"]["bytes"], "trunk_format": m["trunk"]["format"],
        "bank_bytes": m["experts"]["bytes"], "expert_format": m["experts"]["format"],
        "record_bytes": m["experts"]["record_bytes"],
        "tokenizer": text.get("tokenizer") and "tokenizer.json" or text.get("tiktoken") and "tiktoken.model",
        "chat": "chat_template.jinja" if text.get("chat_template") else "chat.json" if text.get("chat") else None,
        "vision": ({"file": m["vision"]["file"], "params": m["vision"]["params"], "bytes": m["vision"]["bytes"],
                    "format": m["vision"]["format"]} if m.get("vision") else None),
        "provenance": f"{m['provenance'].get('date')} by {m['provenance'].get('converter')} from {m['provenance'].get('source')}",
    }
