"""Quantizing many tensors in parallel, in bounded memory.

The converter reads tensors in file order and hands each to `run(job, nbytes)`; a pool of worker threads
packs and writes them (torch and numba release the GIL), each torch op single-threaded so that the workers
do not fight over the cores. At most `max_bytes` of source tensors are in flight: `run` blocks until enough
of them are written. The first error stops the conversion and is raised in the caller.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

DEFAULT_INFLIGHT = 1 << 30


class ParallelQuantizer:
    def __init__(self, workers: int | None = None, max_bytes: int = DEFAULT_INFLIGHT):
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.max_bytes = max_bytes
        self._cv = threading.Condition()
        self._inflight = 0
        self._error: BaseException | None = None
        self._threads = torch.get_num_threads()
        if self.workers > 1:
            torch.set_num_threads(1)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="waste-quant")

    def run(self, job, nbytes: int) -> None:
        """Call job() on a worker once at most max_bytes (or one job, whatever its size) are in flight."""
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or self._inflight == 0
                              or self._inflight + nbytes <= self.max_bytes)
            self._raise()
            self._inflight += nbytes
        self._pool.submit(self._do, job, nbytes)

    def _do(self, job, nbytes) -> None:
        try:
            if self._error is None:
                job()
        except BaseException as e:   # handed to the converter's thread
            with self._cv:
                self._error = self._error or e
        finally:
            with self._cv:
                self._inflight -= nbytes
                self._cv.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self, raise_error: bool = True) -> None:
        """Wait for every job (a second call is a no-op); raise the first error unless told not to."""
        if self._pool is not None:
            with self._cv:
                self._error = self._error if raise_error else (self._error or _Stopped())
            self._pool.shutdown(wait=True)
            self._pool = None
            torch.set_num_threads(self._threads)
        if raise_error and not isinstance(self._error, _Stopped):
            self._raise()


class _Stopped(Exception):
    """Set when the converter gives up: jobs not yet started are skipped."""
