"""Expert bank files: one per MoE layer, one fixed-size record per expert.

Layout (little-endian; docs/FORMAT.md is the specification):
    header  (HEADER_FIXED struct, layout JSON, CRC32 table of the records, zero padding to 4 KiB)
    record 0, record 1, ...   each `record_bytes` long (a multiple of 4 KiB), at
                              header_bytes + e * record_bytes, so one aligned read loads an expert.
A record holds the expert's parts (gate, up, down in their stored format) back to back at the
offsets the layout gives; the CRC32 covers the record's payload bytes.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch
# zlib's CRC-32 through ISA-L's carry-less-multiply code: the same values, 8x the speed of zlib.crc32 (LEARNED
# §3j: at the disk's rate, zlib's checks of every record read took half a core of a 2-core machine)
from isal.isal_zlib import crc32

from ..errors import DamagedContainer

MAGIC = b"WASTEBK1"
VERSION = 1
ALIGN = 4096
PART_ALIGN = 64
HEADER_FIXED = struct.Struct("<8sIIIIQQII")  # magic, version, header_bytes, layer, experts, record_bytes, payload_bytes, layout_len, header_crc

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32}


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@dataclass(frozen=True)
class Part:
    name: str          # e.g. "gate" or "gate.scale"
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RecordLayout:
    parts: tuple[Part, ...]
    payload_bytes: int
    record_bytes: int

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor]) -> "RecordLayout":
        parts, off = [], 0
        for name, t in tensors.items():
            off = align_up(off, PART_ALIGN)
            nbytes = t.numel() * t.element_size()
            parts.append(Part(name, dtype_name(t.dtype), tuple(t.shape), off, nbytes))
            off += nbytes
        return RecordLayout(tuple(parts), off, align_up(off))

    def to_json(self) -> dict:
        return {"payload_bytes": self.payload_bytes, "record_bytes": self.record_bytes,
                "parts": [{"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset,
                           "nbytes": p.nbytes} for p in self.parts]}

    @staticmethod
    def from_json(d: dict) -> "RecordLayout":
        parts = tuple(Part(p["name"], p["dtype"], tuple(p["shape"]), p["offset"], p["nbytes"]) for p in d["parts"])
        return RecordLayout(parts, d["payload_bytes"], d["record_bytes"])

    def pack(self, tensors: dict[str, torch.Tensor]) -> np.ndarray:
        buf = np.zeros(self.payload_bytes, dtype=np.uint8)
        for p in self.parts:
            t = tensors[p.name].contiguous()
            if tuple(t.shape) != p.shape or dtype_name(t.dtype) != p.dtype:
                raise ValueError(f"part {p.name}: got {tuple(t.shape)} {t.dtype}, layout says {p.shape} {p.dtype}")
            buf[p.offset:p.offset + p.nbytes] = t.view(torch.uint8).reshape(-1).numpy()
        return buf

    def views(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero-copy tensors over a uint8 record buffer."""
        out = {}
        for p in self.parts:
            out[p.name] = record[p.offset:p.offset + p.nbytes].view(_DTYPES[p.dtype]).view(p.shape)
        return out


def header_bytes_for(layout_json: bytes, num_experts: int) -> int:
    return align_up(HEADER_FIXED.size + len(layout_json) + 4 * num_experts)


class BankWriter:
    """Writes records in any order (the converter meets experts shard by shard), header last."""

    def __init__(self, path: str, layer: int, num_experts: int, layout: RecordLayout):
        self.path, self.layer, self.num_experts, self.layout = path, layer, num_experts, layout
        self._layout_json = json.dumps(layout.to_json(), separators=(",", ":")).encode()
        self.header_bytes = header_bytes_for(self._layout_json, num_experts)
        self._crcs = [None] * num_experts
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, self.header_bytes + num_experts * layout.record_bytes)

    def write(self, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        payload = self.layout.pack(tensors)
        self._crcs[expert] = crc32(payload)
        os.pwrite(self._fd, payload.tobytes(), self.header_bytes + expert * self.layout.record_bytes)

    def close(self) -> None:
        missing = [e for e, c in enumerate(self._crcs) if c is None]
        if missing:
            raise ValueError(f"bank for layer {self.layer}: experts {missing[:8]} were never written")
        header = self._header(0)
        crc = crc32(header)
        os.pwrite(self._fd, self._header(crc), 0)
        os.fsync(self._fd)
        os.close(self._fd)

    def _header(self, crc: int) -> bytes:
        fixed = HEADER_FIXED.pack(MAGIC, VERSION, self.header_bytes, self.layer, self.num_experts,
                                  self.layout.record_bytes, self.layout.payload_bytes, len(self._layout_json), crc)
        table = struct.pack(f"<{self.num_experts}I", *self._crcs)
        return (fixed + self._layout_json + table).ljust(self.header_bytes, b"\0")


class BankFile:
    """An open bank: parsed, checked header; records read by the caller into its own buffers."""

    def __init__(self, path: str):
        self.path = path
        name = os.path.basename(path)
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise DamagedContainer(f"cannot open expert bank {path}: {e.strerror}") from None
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, ALIGN, 0)
        if len(head) < HEADER_FIXED.size:
            raise DamagedContainer(f"expert bank {name} is truncated ({size} bytes): re-convert the model")
        magic, ver, hbytes, layer, n, rbytes, pbytes, jlen, hcrc = HEADER_FIXED.unpack_from(head)
        if magic != MAGIC:
            raise DamagedContainer(f"{name} is not a waste expert bank (bad magic): re-convert the model")
        if ver != VERSION:
            raise DamagedContainer(f"{name} is bank format v{ver}; this waste reads v{VERSION}: re-convert the model")
        head = os.pread(self.fd, hbytes, 0)
        zeroed = head[:HEADER_FIXED.size - 4] + b"\0\0\0\0" + head[HEADER_FIXED.size:]
        if len(head) != hbytes or crc32(zeroed) != hcrc:
            raise DamagedContainer(f"header of expert bank {name} is corrupted: re-convert the model")
        off = HEADER_FIXED.size
        self.layout = RecordLayout.from_json(json.loads(head[off:off + jlen]))
        self.crcs = struct.unpack_from(f"<{n}I", head, off + jlen)
        self.layer, self.num_experts, self.header_bytes = layer, n, hbytes
        self.record_bytes, self.payload_bytes = rbytes, pbytes
        expected = hbytes + n * rbytes
        if size != expected:
            raise DamagedContainer(f"expert bank {name} is {size} bytes, expected {expected}: "
                                   "the file is truncated or damaged; re-convert the model")

    def offset(self, expert: int) -> int:
        return self.header_bytes + expert * self.record_bytes

    def read_into(self, expert: int, buf: torch.Tensor, verify: bool = True) -> None:
        """Read one record into `buf` (uint8, at least record_bytes) and check its CRC."""
        mv = memoryview(buf.numpy())[:self.record_bytes]
        n = os.preadv(self.fd, [mv], self.offset(expert))
        if n != self.record_bytes:
            raise DamagedContainer(f"short read of expert {expert} in {os.path.basename(self.path)}")
        if verify:
            self.check(expert, mv)

    def check(self, expert: int, record) -> None:
        if crc32(record[:self.payload_bytes]) != self.crcs[expert]:
            raise DamagedContainer(
                f"expert {expert} of layer {self.layer} ({os.path.basename(self.path)}) fails its checksum: "
                "the container is damaged; run `waste verify` and re-convert")

    def bad_records(self) -> list[int]:
        buf = torch.empty(self.record_bytes, dtype=torch.uint8)
        bad = []
        for e in range(self.num_experts):
            self.read_into(e, buf, verify=False)
            if crc32(memoryview(buf.numpy())[:self.payload_bytes]) != self.crcs[e]:
                bad.append(e)
        return bad

    def close(self) -> None:
        os.close(self.fd)
