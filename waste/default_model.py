"""The default model: converted on first use into the user cache dir, then reused.

If the package bundles a trained model (waste/bundled/), that release is converted. Otherwise a small random
Qwen3-MoE is built deterministically: it exercises every code path but its text is noise.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

BUNDLED = Path(__file__).parent / "bundled" / "tiny-py-moe"
SYNTHETIC_RECIPE = "synthetic-qwen3-moe-v2"   # v2: converted with its ChatML chat.json (`waste chat`)


def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("WASTE_CACHE_DIR") or user_cache_dir("waste"))


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.is_file():
            h.update(p.name.encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:12]


def default_model_path() -> Path:
    from .convert.convert import convert

    root = cache_dir()
    if (BUNDLED / "config.json").is_file():
        out = root / f"{BUNDLED.name}-{_digest(BUNDLED)}-bf16.waste"
        if not (out / "manifest.json").is_file():
            print(f"waste: converting the bundled model into {out} (once)", file=sys.stderr)
            convert(BUNDLED, out, experts="bf16", trunk="bf16", force=True)   # small: exact beats compact
        return out
    out = root / f"{SYNTHETIC_RECIPE}.waste"
    if not (out / "manifest.json").is_file():
        from .convert.synthetic import qwen3_moe_config, write_random_qwen3_moe

        print(f"waste: building the default model (random weights, no trained model is bundled) into {out}",
              file=sys.stderr)
        src = root / f"{SYNTHETIC_RECIPE}-src"
        write_random_qwen3_moe(src, qwen3_moe_config(), seed=0)
        convert(src, out, force=True)
    return out
