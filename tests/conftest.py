"""Shared test fixtures: the spec catalog, and whether a CUDA device (with PyTorch) is here."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when the GPU tier can run; else why not (shown by pytest -rs)."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a dependency
        return f"cuda-bindings not importable: {exc}"
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - no driver library at all (e.g. CI) raises its own type
        return f"no CUDA driver here ({type(exc).__name__})"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"no CUDA driver/device here ({err.name})"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        return "no CUDA device here"
    try:
        import torch  # noqa: F401 - the GPU tier makes its test tensors with PyTorch
    except ImportError:
        return "the GPU tier makes its device tensors with PyTorch, which is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("gpu"):
            reason = reason or gpu_unavailable_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU tier: {reason}"))
