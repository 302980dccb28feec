"""Shared test fixtures: the spec catalog, and whether a CUDA device (with PyTorch) is here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moegen.check import gpu_unavailable_reason  # one answer for the tests and `moegen check`

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
if os.environ.get("MOEGEN_TIER_SPECS"):  # e.g. "qwen3-30b-a3b,mixtral-8x7b": a part of the catalog
    _keep = set(os.environ["MOEGEN_TIER_SPECS"].split(","))
    SPECS = [p for p in SPECS if p.stem in _keep]
elif os.environ.get("MOEGEN_TIER_PART"):  # "i" of two halves, or "i/k": every k-th spec from the i-th
    _i, _, _k = os.environ["MOEGEN_TIER_PART"].partition("/")
    SPECS = SPECS[int(_i) - 1::int(_k or 2)]


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("gpu"):
            reason = reason or gpu_unavailable_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU tier: {reason}"))
