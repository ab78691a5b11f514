"""Reading expert records from bank files: one aligned read per record, straight into a cache slot.

O_DIRECT where the filesystem allows it (no double caching: the slot is the only copy in memory); otherwise
buffered reads followed by POSIX_FADV_DONTNEED on the range, so the page cache does not keep a second copy.
"""
from __future__ import annotations

import mmap
import os
import time

import torch

from ..container.bank import ALIGN, BankFile
from ..errors import DamagedContainer


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Page-aligned anonymous memory (O_DIRECT needs aligned buffers), as a uint8 tensor over it."""
    mm = mmap.mmap(-1, max(nbytes, ALIGN))
    return mm, torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)


class BankReader:
    def __init__(self, bank: BankFile, direct: bool = True):
        self.bank = bank
        self.direct = False
        self.fd = bank.fd
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(bank.path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError:          # tmpfs and some network filesystems refuse O_DIRECT
                self.fd = bank.fd

    def read(self, expert: int, slot: torch.Tensor, verify: bool = True) -> float:
        """Fill `slot` (record_bytes, page-aligned) with the record; returns the seconds spent reading."""
        b = self.bank
        off = b.offset(expert)
        mv = memoryview(slot.numpy())
        t0 = time.perf_counter()
        try:
            n = os.preadv(self.fd, [mv], off)
        except OSError as e:
            if not self.direct:
                raise DamagedContainer(f"cannot read expert {expert} of layer {b.layer}: {e.strerror}") from None
            self.direct, self.fd = False, b.fd      # O_DIRECT refused at read time: fall back, once
            n = os.preadv(self.fd, [mv], off)
        if not self.direct:
            os.posix_fadvise(self.fd, off, b.record_bytes, os.POSIX_FADV_DONTNEED)
        dt = time.perf_counter() - t0
        if n != b.record_bytes:
            raise DamagedContainer(f"short read of expert {expert} in {os.path.basename(b.path)}: re-convert the model")
        if verify:
            b.check(expert, mv)
        return dt

    def close(self) -> None:
        if self.fd != self.bank.fd:
            os.close(self.fd)


def measure_direct_bandwidth(bank: BankFile, seconds: float = 1.0, chunk: int = 8 << 20) -> tuple[float, bool]:
    """Sequential O_DIRECT read bandwidth (bytes/s) on a bank file, and whether O_DIRECT was possible."""
    size = os.fstat(bank.fd).st_size // ALIGN * ALIGN
    chunk = min(chunk, max(size, ALIGN))
    try:
        fd = os.open(bank.path, os.O_RDONLY | os.O_DIRECT)
        direct = True
    except (OSError, AttributeError):
        fd, direct = os.dup(bank.fd), False
    mm = mmap.mmap(-1, chunk)      # page-aligned, as O_DIRECT requires
    mv = memoryview(mm)
    done, off, t0 = 0, 0, time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            if not direct:
                os.posix_fadvise(fd, off, chunk, os.POSIX_FADV_DONTNEED)
            n = os.preadv(fd, [mv[:chunk]], off)
            done += n
            off = off + chunk if off + 2 * chunk <= size else 0
            if n <= 0:
                break
    finally:
        os.close(fd)
        mv.release()
        mm.close()
    return done / (time.perf_counter() - t0), direct
