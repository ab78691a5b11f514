"""`waste verify`: every checksum of a container, naming each damaged part rather than stopping at the first."""
from __future__ import annotations

import zlib
from pathlib import Path

import torch

from ..errors import DamagedContainer, WasteError
from .bank import BankFile
from .manifest import check_files, read_manifest


def verify(path, progress: bool = True, notes: list | None = None) -> list[str]:
    """Every problem found, in words (empty: the container is whole). `notes` gets what could not be checked."""
    from tqdm import tqdm

    root = Path(path).expanduser()
    if not root.is_dir():
        raise WasteError(f"no such container directory: {root}")
    try:
        m = read_manifest(root)
    except DamagedContainer as e:
        return [str(e)]
    problems = check_files(root, m)
    if "files" not in m and notes is not None:
        notes.append(f"{root} is container format v{m['format_version']}, which has no checksums for its text files "
                     "(tokenizer, chat template...): re-convert it to check them")
    for part in ("trunk", "vision"):     # the vision tower's file, when there is one, is checked the same way
        if part not in m:
            continue
        try:
            from safetensors.torch import load_file

            tensors = load_file(str(root / m[part]["file"]))
            for name, crc in m[part]["crc32"].items():
                t = tensors.get(name)
                if t is None:
                    problems.append(f"{part} tensor {name} is missing")
                elif zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()) != crc:
                    problems.append(f"{part} tensor {name} fails its checksum")
        except Exception as e:   # a truncated or garbled safetensors file
            problems.append(f"{part} {m[part]['file']} cannot be read: {e}")
    layers = m["experts"]["layers"]
    for key, info in tqdm(sorted(layers.items(), key=lambda kv: int(kv[0])), desc="verifying banks",
                          disable=not progress, unit="bank"):
        try:
            bank = BankFile(str(root / info["file"]))
        except DamagedContainer as e:
            problems.append(str(e))
            continue
        bad = bank.bad_records()
        bank.close()
        if bad:
            shown = ", ".join(map(str, bad[:20])) + (" ..." if len(bad) > 20 else "")
            problems.append(f"{info['file']} (layer {key}): expert record(s) {shown} fail their checksum")
    return problems
