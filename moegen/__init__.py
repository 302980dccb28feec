"""moegen: compiles a model's Mixture-of-Experts layer spec into specialized CUDA and a launcher."""

__version__ = "0.1.0"


def load(path, device=None):
    """Load a generated layer directory (e.g. "generated/qwen3-30b-a3b") and return its Layer class."""
    from .runtime import load as _load

    return _load(path, device=device)
