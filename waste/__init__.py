"""waste: run Mixture-of-Experts language models larger than memory."""
from . import kernel_cache
from .version import __version__  # noqa: F401  (waste.__version__)

kernel_cache.setup()                # before any module defines a cached numba kernel


def load(path=None, **kwargs):
    """Open a .waste container (or the default model when path is None) and return an Engine."""
    from .engine import Engine

    return Engine.load(path, **kwargs)
