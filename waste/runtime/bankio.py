"""Reading expert records from bank files: one aligned read per record, straight into a cache slot.

O_DIRECT where the filesystem allows it (no double caching: the slot is the only copy in memory); otherwise
buffered reads followed by POSIX_FADV_DONTNEED on the range, so the page cache does not keep a second copy.
DirectAio queues O_DIRECT reads through Linux AIO from the caller's own thread; where it is missing the cache reads
on its thread pool, the same bytes either way.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import platform
import threading
import time
import weakref

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
        self.landed(expert, mv, n, verify)
        return dt

    def landed(self, expert: int, record, n: int, verify: bool = True) -> None:
        """Check a read of n bytes into `record` (a memoryview of its slot): its length, then its CRC-32."""
        if n != self.bank.record_bytes:
            raise DamagedContainer(f"short read of expert {expert} in {os.path.basename(self.bank.path)}: "
                                   "re-convert the model")
        if verify:
            self.bank.check(expert, record)

    def request(self, expert: int, slot: torch.Tensor) -> tuple[int, int, int, int]:
        """The read of a record into `slot` as DirectAio.submit takes it: (fd, address, bytes, offset)."""
        return self.fd, slot.data_ptr(), self.bank.record_bytes, self.bank.offset(expert)

    def close(self) -> None:
        if self.fd != self.bank.fd:
            os.close(self.fd)


# Linux AIO's system calls (io_setup, io_destroy, io_submit, io_getevents) by number: glibc wraps none of them
_AIO_CALLS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4)}
_SETUP, _DESTROY, _SUBMIT, _GETEVENTS = _AIO_CALLS.get(platform.machine(), (None,) * 4)
_IOCB_CMD_PREAD = 0


class _Iocb(ctypes.Structure):      # struct iocb, little-endian field order
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):     # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


def _syscall():
    """libc's syscall(2) (ctypes releases the GIL around it), or None off Linux or on an unknown machine."""
    if platform.system() != "Linux" or _SETUP is None:
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    f.restype = ctypes.c_long
    return f


def _call(n: int, *args) -> int:
    r = _SYSCALL(ctypes.c_long(n), *args)
    return -ctypes.get_errno() if r < 0 else r


_SYSCALL = _syscall()


def _destroy(ctx: int) -> None:
    _call(_DESTROY, ctypes.c_ulong(ctx))


def _reap(ref, ctx: int, nr: int) -> None:
    """The reaper thread: waits in io_getevents holding only a weak reference, so a store dropped without close()
    is still collected (its finalizer destroys the context, which ends the wait with EINVAL)."""
    events = (_Event * nr)()
    while True:
        n = _call(_GETEVENTS, ctypes.c_ulong(ctx), ctypes.c_long(1), ctypes.c_long(nr), events, None)
        if n == -errno.EINTR:
            continue
        aio = ref()
        if aio is None or n < 0:
            return
        aio._complete([(events[i].data, events[i].res) for i in range(n)])
        del aio


class DirectAio:
    """Reads queued with io_submit from the caller's thread (no hand-off: a reader thread's wake-up, and the GIL it
    waits for, sat between a layer's routing and its first read); a reaper thread waits in io_getevents and runs each
    read's `done(result)` there: the bytes read, or -errno. At most `depth` reads are in flight, the rest wait in
    order and the reaper submits the next as one lands: with a layer's misses all in flight at once the disk served
    them side by side and they landed together at the end, leaving their pairs to compute after it (LEARNED §3p).
    Only for O_DIRECT descriptors: on a buffered one io_submit reads synchronously."""

    def __init__(self, depth: int = 2, events: int = 64):
        if _SYSCALL is None:
            raise OSError(errno.ENOSYS, "Linux AIO is not available here")
        ctx = ctypes.c_ulong(0)
        r = _call(_SETUP, ctypes.c_long(events), ctypes.byref(ctx))
        if r < 0:
            raise OSError(-r, os.strerror(-r))
        self.ctx, self.depth = ctx.value, max(1, min(depth, events))
        self._pending: dict[int, tuple[_Iocb, object]] = {}     # in flight: id -> (its iocb, kept alive; done)
        self._backlog: collections.deque = collections.deque()  # (fd, address, bytes, offset, done) not yet submitted
        self._next = 0
        self._cond = threading.Condition()
        self._finalizer = weakref.finalize(self, _destroy, self.ctx)
        self._reaper = threading.Thread(target=_reap, args=(weakref.ref(self), self.ctx, events), daemon=True,
                                        name="waste-aio")
        self._reaper.start()

    @classmethod
    def open(cls, depth: int = 2) -> "DirectAio | None":
        """A context, or None where the kernel or the platform gives none (the caller then reads on threads)."""
        try:
            return cls(depth)
        except OSError:
            return None

    def submit(self, reads: list[tuple[int, int, int, int, object]]) -> int:
        """Queue reads (fd, address, bytes, offset, done); returns how many it took, in order: the rest (the kernel
        refused the first submission) are the caller's to read another way, and their `done` is never called."""
        with self._cond:
            self._backlog.extend(reads)
            if self._pump() < 0 and not self._pending:    # nothing in flight whose landing would submit them later
                self._backlog.clear()     # (empty before: a backlog always has reads in flight ahead of it)
                return 0
        return len(reads)

    def _pump(self) -> int:
        """Submit from the backlog up to the depth (the lock held); io_submit's error, if it took none."""
        free = self.depth - len(self._pending)
        if free <= 0 or not self._backlog:
            return 0
        take = [self._backlog.popleft() for _ in range(min(free, len(self._backlog)))]
        ids = list(range(self._next, self._next + len(take)))
        self._next += len(take)
        cbs = [_Iocb(data=i, opcode=_IOCB_CMD_PREAD, fildes=fd, buf=addr, nbytes=nb, offset=off)
               for i, (fd, addr, nb, off, _) in zip(ids, take)]
        for i, cb, r in zip(ids, cbs, take):     # registered first: a read may land before io_submit returns
            self._pending[i] = (cb, r[4])
        ptrs = (ctypes.POINTER(_Iocb) * len(cbs))(*[ctypes.pointer(c) for c in cbs])
        n = _call(_SUBMIT, ctypes.c_ulong(self.ctx), ctypes.c_long(len(cbs)), ptrs)
        for i in ids[max(n, 0):]:
            del self._pending[i]
        self._backlog.extendleft(take[max(n, 0):][::-1])    # those not taken back at the front, in order
        return n

    def _complete(self, events: list[tuple[int, int]]) -> None:
        for i, res in events:
            with self._cond:
                _, done = self._pending.pop(i)
                failed = self._pump() < 0 and not self._pending
                orphans = [self._backlog.popleft() for _ in range(len(self._backlog))] if failed else []
            done(res)
            for r in orphans:       # nothing in flight and the kernel takes no more: each read fails over
                r[4](-errno.EAGAIN)
            with self._cond:
                if not self._pending and not self._backlog:
                    self._cond.notify_all()

    def close(self) -> None:
        """Wait for the reads in flight and queued to land, then end the context and its reaper."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending and not self._backlog)
        self._finalizer()
        if threading.current_thread() is not self._reaper:
            self._reaper.join()


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
