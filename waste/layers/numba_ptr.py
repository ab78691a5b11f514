"""Numba kernels that read torch tensors through their addresses.

`tensor.numpy()` dispatches three torch operators (detach, resolve_conj, resolve_neg: ~3 us), more than a decode
row's kernels spend on their arithmetic, so the per-call arguments of layers/attention_cpu.py and moe_cpu.py are
passed as `tensor.data_ptr()` (no dispatch) and viewed inside the kernel with `at(address, shape, dtype)`. Only
contiguous CPU tensors that outlive the call may be passed this way.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def at():
    """The njit function at(address, shape, dtype) -> an array over that memory (no copy)."""
    import numba
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def void_ptr(typingctx, addr):
        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], cgutils.voidptr_t)
        return types.voidptr(types.int64), codegen

    @numba.njit(inline="always")
    def _at(addr, shape, dtype):
        return numba.carray(void_ptr(addr), shape, dtype)

    return _at
