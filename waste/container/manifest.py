"""manifest.json: what a container holds and how the engine should read it (docs/FORMAT.md)."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import DamagedContainer

FORMAT_NAME = "waste"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRUNK_FILE = "trunk.safetensors"
REQUIRED_KEYS = ("format", "format_version", "family", "config", "trunk", "experts", "text", "params", "provenance")


def bank_file(layer: int) -> str:
    return f"experts/layer_{layer:03d}.bank"


def read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file():
        raise DamagedContainer(f"{root} has no {MANIFEST}: it is not a waste container "
                               "(convert a Hugging Face release with `waste convert SRC OUT.waste`)")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedContainer(f"{path} is not valid JSON ({e}): the container is damaged; re-convert") from None
    missing = [k for k in REQUIRED_KEYS if k not in m]
    if m.get("format") != FORMAT_NAME or missing:
        raise DamagedContainer(f"{path} is not a waste manifest (missing {', '.join(missing) or 'format tag'})")
    if m["format_version"] != FORMAT_VERSION:
        raise DamagedContainer(f"{root} is container format v{m['format_version']}; this waste reads "
                               f"v{FORMAT_VERSION}: re-convert the model with this version")
    return m


def write_manifest(root: Path, manifest: dict) -> None:
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
