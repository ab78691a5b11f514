"""A triton kernel launched again without the JIT's per-call work (docs/LEARNED.md §10l).

`kernel[grid](...)` binds the arguments, specializes each one, builds its cache key (with str() of the options),
checks the kernel's globals, builds the launch's metadata and calls the (empty) launch hooks: host time a CUDA graph
never pays but an eager decode step (Kimi-Linear's MLA layers, GLM's DSA layers, a VRAM tier's layers, the head)
pays per launch, more than cuBLAS's whole gemv call. `Fast(kernel)` keeps each specialization's compiled kernel
under a key the caller derives from what selects it and hands the driver's launcher the arguments directly.

The key is the caller's promise: it must determine every argument's specialization (triton specializes a tensor on
its dtype and its address's 16-byte alignment, an integer on being 1, a multiple of 16 or past int32, a constexpr on
its value) and the options. CHECK (the GPU tests set it) asks the JIT, for every fast launch, which kernel it would
have run and fails on a different one. Under triton's interpreter there is no compiled kernel: every call goes
through the JIT.
"""
from __future__ import annotations

try:
    import torch
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    from triton.runtime.driver import driver
except ImportError:          # no triton: nothing calls Fast
    triton = None

CHECK = False
ENABLED = True               # benchmarks switch it off to time the JIT's own launch in the same process
PDL = True                   # programmatic dependent launch where the chip has it (benchmarks switch it off)
_SM90: dict = {}


def pdl(t) -> bool:
    """Launch a decode kernel on t's device dependent on the one before it (sm_90 and later): its programs start
    while the previous kernel's last ones run, read only weights until `pdl_wait`, and write nothing before it.
    Off under the interpreter (a CPU tensor)."""
    if not (PDL and triton is not None and t.is_cuda):
        return False
    i = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if i not in _SM90:
        _SM90[i] = torch.cuda.get_device_capability(i)[0] >= 9
    return _SM90[i]


if triton is not None:
    @triton.jit
    def pdl_begin(PDL: tl.constexpr):
        # the next kernel may launch once every program of this one has started (it waits in its pdl_wait)
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        # the kernel before this one finished and its writes are visible: what a program reads past here
        if PDL:
            gdc_wait()


class Fast:
    """kernel[grid](*args, **options) for args in the kernel's parameter order, constexprs included."""

    __slots__ = ("fn", "kernels")

    def __init__(self, fn):
        self.fn, self.kernels = fn, {}

    def __call__(self, key, grid: tuple, *args, **options) -> None:
        k = self.kernels.get(key) if ENABLED else None
        if k is None:
            k = self.fn[grid](*args, **options)          # compiles or finds it, and launches it
            if hasattr(k, "packed_metadata"):             # a compiled kernel (the interpreter returns none)
                self.kernels[key] = k
            return
        if CHECK:
            ran = self.fn.run(*args, grid=grid, warmup=True, **options)
            assert ran is k, f"{self.fn.__name__}: key {key!r} does not determine the kernel's specialization"
        rt = knobs.runtime
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        if enter.calls or leave.calls:            # a profiler's hooks: the metadata they read, as the JIT builds it
            k.run(*_grid3(grid), stream, k.function, k.packed_metadata, k.launch_metadata(grid, stream, *args),
                  enter, leave, *args)
        else:
            k.run(*_grid3(grid), stream, k.function, k.packed_metadata, None, None, None, *args)


def _grid3(grid: tuple) -> tuple:
    n = len(grid)
    return (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)


def spec_key(args: tuple, *extra) -> tuple:
    """A key naming every argument of a launch (in order: each tensor's dtype and alignment bit, every other
    argument's value), plus extra (the options): complete by construction, for launches with many integer
    arguments whose specializations a hand-made key could miss. ~3-5 us of host time for 30 arguments."""
    bits, vals = 0, []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            bits |= (a.data_ptr() % 16 == 0) << i
            vals.append(a.dtype)
        else:
            vals.append(a)
    return (bits, *vals, *extra)


def aligned(*tensors) -> int:
    """A bit per tensor: its address a multiple of 16 (what triton specializes a pointer on), for a key."""
    bits = 0
    for i, t in enumerate(tensors):
        bits |= (t.data_ptr() % 16 == 0) << i
    return bits
