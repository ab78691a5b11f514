"""Writing the trunk as one safetensors file in bounded memory.

The header is known before any data (names, dtypes and shapes come from the release's headers), so the
file is laid out first and each tensor is written at its offset as the converter meets it.
"""
from __future__ import annotations

import json
import os
import struct
import zlib

import torch

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32"}   # the integer ones: quantized parts


class TrunkWriter:
    def __init__(self, path: str, specs: dict[str, tuple[torch.dtype, list[int]]], metadata: dict[str, str]):
        self.specs = specs
        header, off = {"__metadata__": metadata}, 0
        self.offsets = {}
        for name in sorted(specs):
            dt, shape = specs[name]
            n = torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
            header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [off, off + n]}
            self.offsets[name] = off
            off += n
        hj = json.dumps(header, separators=(",", ":")).encode()
        hj += b" " * (-len(hj) % 8)
        self.data_start = 8 + len(hj)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.data_start + off)
        os.pwrite(self.fd, struct.pack("<Q", len(hj)) + hj, 0)
        self.crc32: dict[str, int] = {}
        self.bytes = self.data_start + off

    def write(self, name: str, t: torch.Tensor) -> None:
        dt, shape = self.specs[name]
        t = t.to(dt).contiguous()
        assert list(t.shape) == list(shape), (name, t.shape, shape)
        raw = t.view(-1).view(torch.uint8).numpy()
        self.crc32[name] = zlib.crc32(raw)
        os.pwrite(self.fd, raw.tobytes(), self.data_start + self.offsets[name])

    def close(self) -> None:
        missing = sorted(set(self.specs) - set(self.crc32))
        if missing:
            raise ValueError(f"trunk tensors never written: {missing[:5]}")
        os.fsync(self.fd)
        os.close(self.fd)
