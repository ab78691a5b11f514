"""Numba kernels that read torch tensors through their addresses.

`tensor.numpy()` dispatches three torch operators (detach, resolve_conj, resolve_neg: ~3 us), more than a decode
row's kernels spend on their arithmetic, so the per-call arguments of the CPU kernels (layers/cpu_kernels.py,
quant/q4_numba.py) are passed as `tensor.data_ptr()` (no dispatch) and viewed inside the kernel with
`at(address, shape, dtype)`. Only contiguous CPU tensors that outlive the call may be passed this way. Importing
this module imports numba: import it lazily.
"""
from __future__ import annotations

import contextlib
import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


@intrinsic
def _void_ptr(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.int64), codegen


@numba.njit(inline="always")
def at(addr, shape, dtype):
    """An array over the memory at addr (no copy), inside a numba kernel."""
    return numba.carray(_void_ptr(addr), shape, dtype)


_followed = threading.local()      # per thread, as numba's count is: the torch count last followed


def follow_torch_threads() -> None:
    """numba's pool follows torch's thread count (`--threads`), which callers may change between calls. numba's
    OpenMP layer shares torch's OpenMP runtime, and starting its pool (the first call) sets the runtime's count to
    every core: torch's own count is put back, or torch's reductions would change their bits. Nothing else sets
    numba's count, so while torch's stays what this thread last followed there is nothing to do (numba's own
    get_num_threads costs ~4 us, 0.18 ms a bundled decode step when asked every call)."""
    n = torch.get_num_threads()
    if getattr(_followed, "n", None) == n:
        return
    if numba.get_num_threads() != n:
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _followed.n = n


@intrinsic
def fetch_add(typingctx, addr, i, v):
    """Atomically add v to the int64 at addr + 8 i; the value before (a chunk queue shared by threads)."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        p = builder.gep(builder.inttoptr(args[0], i64.as_pointer()), [args[1]])
        return builder.atomic_rmw("add", p, args[2], "seq_cst")
    return types.int64(types.int64, types.int64, types.int64), codegen


_helper = threading.local()


@contextlib.contextmanager
def row_helper(pool):
    """Within it, on this thread, a shared-queue row kernel (BoundRow's `shared`) also hands its chunks to one
    thread of pool, idle then (a streamed CPU decode step's expert pool between a layer's last pair and its next
    reads: docs/LEARNED.md §3n). Whichever thread is running takes the next chunk, so a helper that wakes late
    costs nothing but its submit; a chunk's bits are one thread's whoever computes it."""
    prev = getattr(_helper, "pool", None)
    _helper.pool = pool
    try:
        yield
    finally:
        _helper.pool = prev


# below this many weights a matrix's row kernel runs on one thread: a parallel launch costs a few us
PARALLEL_MIN = 1 << 16


class BoundRow:
    """x [1, K] float32 @ W.T -> [1, N] float32 through a numba row kernel `fn(x_p, *args, y)`, its arguments bound
    once (the format's parts stay referenced: the kernel reads their memory); `parallel` (spread over torch's
    threads) from PARALLEL_MIN weights, `serial` below."""

    def __init__(self, parallel, serial, parts: dict, args: tuple, shape, shared=None):
        N, K = shape
        self.parts, self.N, self.args = parts, N, args
        self.fn, self.parallel = (parallel, True) if N * K >= PARALLEL_MIN else (serial, False)
        # shared(x_p, *args, y_p, queue_p, helper): the row chunks taken from a queue [next, done] (row_helper)
        self.shared = shared if self.parallel else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.is_contiguous() else x.contiguous()
        out = np.empty((1, self.N), np.float32)
        pool = getattr(_helper, "pool", None)
        if pool is not None and self.shared is not None:
            q = np.zeros(2, np.int64)       # a fresh queue a call: a helper that wakes after it finds it spent
            args = (x.data_ptr(), *self.args, out.ctypes.data, q.ctypes.data)
            pool.submit(self.shared, *args, True)._keep = (x, out, q)
            self.shared(*args, False)
            return torch.from_numpy(out)
        if self.parallel:
            follow_torch_threads()
        self.fn(x.data_ptr(), *self.args, out[0])
        return torch.from_numpy(out)
