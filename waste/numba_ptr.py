"""Numba kernels that read torch tensors through their addresses.

`tensor.numpy()` dispatches three torch operators (detach, resolve_conj, resolve_neg: ~3 us), more than a decode
row's kernels spend on their arithmetic, so the per-call arguments of the CPU kernels (layers/cpu_kernels.py,
quant/q4_numba.py) are passed as `tensor.data_ptr()` (no dispatch) and viewed inside the kernel with
`at(address, shape, dtype)`. Only contiguous CPU tensors that outlive the call may be passed this way. Importing
this module imports numba: import it lazily.
"""
from __future__ import annotations

import threading

import numba
import numpy as np
import torch
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


# below this many weights a matrix's row kernel runs on one thread: a parallel launch costs a few us
PARALLEL_MIN = 1 << 16


class BoundRow:
    """x [1, K] float32 @ W.T -> [1, N] float32 through a numba row kernel `fn(x_p, *args, y)`, its arguments bound
    once (the format's parts stay referenced: the kernel reads their memory); `parallel` (spread over torch's
    threads) from PARALLEL_MIN weights, `serial` below."""

    def __init__(self, parallel, serial, parts: dict, args: tuple, shape):
        N, K = shape
        self.parts, self.N, self.args = parts, N, args
        self.fn, self.parallel = (parallel, True) if N * K >= PARALLEL_MIN else (serial, False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.is_contiguous() else x.contiguous()
        out = np.empty((1, self.N), np.float32)
        if self.parallel:
            follow_torch_threads()
        self.fn(x.data_ptr(), *self.args, out[0])
        return torch.from_numpy(out)
