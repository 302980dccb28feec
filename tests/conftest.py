"""Shared test fixtures: the spec catalog, and whether a CUDA device (with PyTorch) is here."""

from __future__ import annotations

from pathlib import Path

import pytest

from moegen.check import gpu_unavailable_reason  # one answer for the tests and `moegen check`

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("gpu"):
            reason = reason or gpu_unavailable_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU tier: {reason}"))
