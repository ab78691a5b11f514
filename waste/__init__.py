"""waste: run Mixture-of-Experts language models larger than memory."""
from .version import __version__  # noqa: F401  (waste.__version__)


def load(path=None, **kwargs):
    """Open a .waste container (or the default model when path is None) and return an Engine."""
    from .engine import Engine

    return Engine.load(path, **kwargs)
