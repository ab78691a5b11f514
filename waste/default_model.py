"""The default model: converted on first use into the user cache dir, then reused; rebuilt when it fails its
checks (a damaged file, a format this version no longer reads).

If the package bundles a trained model (waste/bundled/), that release is converted. Otherwise a small random
Qwen3-MoE is built deterministically: it exercises every code path but its text is noise.

The bundled model is stored in bf16, not `waste convert`'s q4 experts / q8 trunk: at 19.5 M parameters (39 MB) it is
resident either way, and bf16 keeps its text exactly the trained model's (q4 + q8: KL 9.0e-3, greedy text departing within
47 of 128 tokens; docs/LEARNED.md §5c).
"""
from __future__ import annotations

import hashlib
import os
import shutil
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


def default_container() -> Path:
    """Where the default model's container lives (or will, once built)."""
    if (BUNDLED / "config.json").is_file():
        return cache_dir() / f"{BUNDLED.name}-{_digest(BUNDLED)}-bf16.waste"
    return cache_dir() / f"{SYNTHETIC_RECIPE}.waste"


def rebuild_hint(path) -> str:
    """The exact way to rebuild the default model by hand."""
    return (f"it is the default model: the next `waste info` (or run, chat, serve) rebuilds it; or remove it by hand: "
            f"rm -rf {_quote(path)}")


def _quote(path) -> str:
    import shlex

    return shlex.quote(str(path))


def problems(out: Path) -> list[str]:
    """Why an existing default container cannot be used (every checksum: 40 ms for the bundled model)."""
    from .container.verify import verify
    from .errors import WasteError

    import json

    try:
        if "files" not in json.loads((out / "manifest.json").read_text()):
            return ["it predates file checksums (container format v1)"]
        return verify(out, progress=False)
    except (WasteError, ValueError) as e:
        return [str(e)]


def default_model_path(check: bool = True) -> Path:
    """The default model's container: built when absent, rebuilt when it fails its checks."""
    out = default_container()
    if (out / "manifest.json").is_file() and check:
        found = problems(out)
        if not found:
            return out
        print(f"waste: the default model in {out} fails its checks ({found[0]}{' ...' if len(found) > 1 else ''}); "
              "rebuilding it", file=sys.stderr)
        shutil.rmtree(out, ignore_errors=True)
    elif (out / "manifest.json").is_file():
        return out
    return build(out)


def build(out: Path) -> Path:
    from .convert.convert import convert

    if (BUNDLED / "config.json").is_file():
        print(f"waste: converting the bundled model into {out} (once)", file=sys.stderr)
        return convert(BUNDLED, out, experts="bf16", trunk="bf16", force=True)   # why bf16: the module's doc
    from .convert.synthetic import qwen3_moe_config, write_random_qwen3_moe

    print(f"waste: building the default model (random weights, no trained model is bundled) into {out}",
          file=sys.stderr)
    src = out.parent / f"{SYNTHETIC_RECIPE}-src"
    write_random_qwen3_moe(src, qwen3_moe_config(), seed=0)
    return convert(src, out, force=True)
