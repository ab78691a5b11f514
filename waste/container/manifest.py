"""manifest.json: what a container holds and how the engine should read it (docs/FORMAT.md)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import DamagedContainer

FORMAT_NAME = "waste"
FORMAT_VERSION = 2          # v2 added `files`: every file's size, and a SHA-256 of those no other checksum covers
READABLE_VERSIONS = (1, 2)  # v1 containers open; `waste verify` says their text files cannot be checked
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
    if m["format_version"] not in READABLE_VERSIONS:
        raise DamagedContainer(f"{root} is container format v{m['format_version']}; this waste reads "
                               f"v{', v'.join(map(str, READABLE_VERSIONS))}: re-convert the model with this version")
    return m


def weight_files(m: dict) -> set[str]:
    """Files whose content their own checksums cover: the trunk and vision tensors' CRC-32s, the banks' header and
    record CRC-32s."""
    out = {m["trunk"]["file"]} | {info["file"] for info in m["experts"]["layers"].values()}
    if "vision" in m:
        out.add(m["vision"]["file"])
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_table(root: Path, m: dict) -> dict:
    """The manifest's `files`: every file but manifest.json, relative path -> bytes, plus sha256 unless its
    content has checksums of its own (weight_files)."""
    covered = weight_files(m)
    out = {}
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = p.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        out[rel] = {"bytes": p.stat().st_size, **({} if rel in covered else {"sha256": _sha256(p)})}
    return out


def check_files(root: Path, m: dict) -> list[str]:
    """Problems with the files `files` lists: missing, another size, another SHA-256."""
    problems = []
    for rel, want in (m.get("files") or {}).items():
        p = root / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
        elif p.stat().st_size != want["bytes"]:
            problems.append(f"{rel} is {p.stat().st_size} bytes, the manifest says {want['bytes']}")
        elif "sha256" in want and _sha256(p) != want["sha256"]:
            problems.append(f"{rel} fails its checksum (SHA-256)")
    return problems


def write_manifest(root: Path, manifest: dict) -> None:
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
