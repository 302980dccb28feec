"""moegen: compiles a model's Mixture-of-Experts layer spec into specialized CUDA and a launcher."""

from typing import Any

__version__ = "0.1.0"


def load(path: Any, weights: Any = None, device: Any = None) -> Any:
    """The layer of a generated directory (e.g. "generated/qwen3-30b-a3b"), compiled for this GPU;
    weights (Hugging Face names, see Layer.load_weights) may be given now or later."""
    from .runtime import load as _load

    return _load(path, weights=weights, device=device)
