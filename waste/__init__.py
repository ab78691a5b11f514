"""waste: run Mixture-of-Experts language models larger than memory."""
import os

# MKL's float32 GEMM (torch's on x86) split some row counts over its threads on an AMD Zen 5 host, so a row's bits
# moved with the thread count (5-11 rows of a 64-wide product), against the rule that they never do; its strict
# reproducible mode keeps them fixed, at no cost measured (docs/LEARNED.md §3l). MKL reads it at its first call.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from . import kernel_cache  # noqa: E402
from .version import __version__  # noqa: F401  (waste.__version__)

kernel_cache.setup()                # before any module defines a cached numba kernel


def load(path=None, **kwargs):
    """Open a .waste container (or the default model when path is None) and return an Engine."""
    from .engine import Engine

    return Engine.load(path, **kwargs)
