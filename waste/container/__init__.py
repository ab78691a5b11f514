"""The .waste container: a directory with a manifest, a trunk, expert banks and text files."""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import DamagedContainer, WasteError
from .bank import BankFile
from .manifest import TRUNK_FILE, read_manifest


@dataclass
class Container:
    root: Path
    manifest: dict
    banks: dict[int, BankFile] = field(default_factory=dict)   # MoE layer index -> bank

    @property
    def family(self) -> str:
        return self.manifest["family"]

    @property
    def config(self) -> dict:
        return self.manifest["config"]

    @property
    def trunk_path(self) -> Path:
        return self.root / self.manifest["trunk"]["file"]

    def text_file(self, key: str) -> Path | None:
        name = self.manifest["text"].get(key)
        return self.root / name if name else None

    def load_trunk(self, verify: bool = True) -> dict:
        """All trunk tensors, each checked against the CRC32 the converter recorded."""
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(self.trunk_path))
        except Exception as e:   # safetensors raises its own error types for a damaged file
            raise DamagedContainer(f"trunk {self.trunk_path.name} cannot be read ({e}): re-convert the model") from None
        crcs = self.manifest["trunk"]["crc32"]
        if set(crcs) != set(tensors):
            raise DamagedContainer(f"trunk {self.trunk_path.name} does not hold the tensors the manifest lists")
        if verify:
            for name, t in tensors.items():
                if zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()) != crcs[name]:
                    raise DamagedContainer(f"trunk tensor {name} fails its checksum: the container is damaged; "
                                           "run `waste verify` and re-convert")
        # safetensors hands back views of its mapping of the file: copied into memory of our own, one at a time, so
        # the mapping is let go once loaded. Kept, the trunk sat in memory twice (the file's pages beside the copies
        # the model makes of unaligned or converted tensors): 0.5 GB over the plan on a 26-layer 30B shape
        return {name: tensors.pop(name).clone() for name in list(tensors)}

    def load_vision(self, verify: bool = True) -> dict:
        """The vision tower's tensors (manifest `vision`), each checked against its CRC32; WasteError without one."""
        from safetensors.torch import load_file

        v = self.manifest.get("vision")
        if not v:
            raise WasteError("this model has no vision tower: it takes text only")
        path = self.root / v["file"]
        try:
            tensors = load_file(str(path))
        except Exception as e:
            raise DamagedContainer(f"vision {v['file']} cannot be read ({e}): re-convert the model") from None
        if set(v["crc32"]) != set(tensors):
            raise DamagedContainer(f"vision {v['file']} does not hold the tensors the manifest lists")
        if verify:
            for name, t in tensors.items():
                if zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy()) != v["crc32"][name]:
                    raise DamagedContainer(f"vision tensor {name} fails its checksum: the container is damaged; "
                                           "run `waste verify` and re-convert")
        return tensors

    def close(self) -> None:
        for b in self.banks.values():
            b.close()
        self.banks.clear()


def open_container(path: str | os.PathLike) -> Container:
    root = Path(path).expanduser()
    if not root.exists():
        raise WasteError(f"no such model: {root} (give a .waste directory made by `waste convert`)")
    if not root.is_dir():
        raise WasteError(f"{root} is a file, not a .waste container directory")
    manifest = read_manifest(root)
    c = Container(root, manifest)     # which families run is the models layer's to say (models.check_family)
    if not c.trunk_path.is_file():
        raise DamagedContainer(f"{root} is missing its trunk file {TRUNK_FILE}: re-convert the model")
    ex = manifest["experts"]
    try:
        for key, info in ex["layers"].items():
            bank = BankFile(str(root / info["file"]))
            c.banks[int(key)] = bank
            if bank.num_experts != info["num_experts"] or bank.record_bytes != ex["record_bytes"] or bank.layer != int(key):
                raise DamagedContainer(f"expert bank {info['file']} does not match the manifest: re-convert the model")
    except BaseException:
        c.close()
        raise
    return c
