"""Which expert kernels a GPU has: layers/moe_triton.py's, registered in layers/moe.py's table on first ask."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cuda_kernels() -> bool:
    """Whether triton imports, so the kernels that read expert slots in place are registered for "cuda"."""
    try:
        from . import moe_triton  # noqa: F401
    except ImportError:
        return False
    return True
