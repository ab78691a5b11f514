"""Numba kernels that read torch tensors through their addresses.

`tensor.numpy()` dispatches three torch operators (detach, resolve_conj, resolve_neg: ~3 us), more than a decode
row's kernels spend on their arithmetic, so the per-call arguments of the CPU kernels (layers/cpu_kernels.py,
quant/q4_numba.py) are passed as `tensor.data_ptr()` (no dispatch) and viewed inside the kernel with
`at(address, shape, dtype)`. Only contiguous CPU tensors that outlive the call may be passed this way. Importing
this module imports numba: import it lazily.
"""
from __future__ import annotations

import numba
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


def follow_torch_threads() -> None:
    """numba's pool follows torch's thread count (`--threads`), which callers may change between calls (~1 us).
    numba's OpenMP layer shares torch's OpenMP runtime, and starting its pool (the first call) sets the runtime's
    count to every core: torch's own count is put back, or torch's reductions would change their bits."""
    n = torch.get_num_threads()
    if numba.get_num_threads() != n:
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def row_call(parallel_kernel, serial_kernel, parallel: bool, x: torch.Tensor, n_out: int, args: tuple) -> torch.Tensor:
    """One float32 decode row through a numba matvec kernel pair (kernel(x address, *args, out row)): the parallel one
    on torch's thread count where the matrix is worth a launch, else the serial one. -> [1, n_out] float32."""
    import numpy as np

    x = x if x.is_contiguous() else x.contiguous()
    out = np.empty((1, n_out), np.float32)
    if parallel:
        follow_torch_threads()
        parallel_kernel(x.data_ptr(), *args, out[0])
    else:
        serial_kernel(x.data_ptr(), *args, out[0])
    return torch.from_numpy(out)
