"""waste: run Mixture-of-Experts language models larger than memory."""
__version__ = "0.1.0"


def load(path=None, **kwargs):
    """Open a .waste container (or the default model when path is None) and return an Engine."""
    from .engine import Engine

    return Engine.load(path, **kwargs)
