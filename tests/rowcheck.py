"""Per-row checks of a layer's outputs against the reference (DESIGN.md's numerics), used by the
GPU tiers; plain NumPy, so their own tests run on the CPU (tests/test_rowcheck.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from moegen import reference
from moegen.spec import Spec

ROW_TOL = 1e-2  # DESIGN.md: per-row ||out - ref|| / ||ref|| for bf16 outputs
# DESIGN.md: per row where activations are quantized to FP8 and the reference emulates it (a
# bf16 rounding of an activation that differs moves its block's scale and so its neighbours' codes)
ROW_TOL_FP8_ACT = 2e-2


def row_tol(spec: Any) -> float:
    """The per-row tolerance of a spec's outputs: ROW_TOL_FP8_ACT where its GEMMs quantize their
    inputs to FP8 (FP8 activations of block weights, FP8 per-tensor's static input scales)."""
    fmts = {spec.experts.format.value, *((spec.shared_expert.format.value,) if spec.shared_expert else ())}
    return ROW_TOL_FP8_ACT if spec.experts.fp8_activations or "fp8_tensor" in fmts else ROW_TOL


# FP8 activations: per (token, choice) ||h - h_ref|| / ||h_ref|| of the activations a kernel hands
# its down projection (the FP8 GEMMs' QGMMA sums are less precise than fp32 products)
ACT_TOL = 1e-2


def _check_rows(got: np.ndarray, ref: np.ndarray, what: str, tol: float = ROW_TOL) -> float:
    assert not np.isnan(got).any(), f"{what}: NaN in the output (an element was not written?)"
    assert np.isfinite(got).all(), f"{what}: Inf in the output"
    err = np.linalg.norm(got - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
    worst = int(np.argmax(err))
    assert err[worst] <= tol, f"{what}: row {worst} relative error {err[worst]:.3e} > {tol}"
    return float(err.max())


def check_rows_fp8_act(got: np.ndarray, ref: np.ndarray, what: str, tol: float, spec: Spec, host: Any,
                       x: np.ndarray, ids: np.ndarray, acts: tuple[np.ndarray, np.ndarray | None] | None) -> None:
    """_check_rows, with the near-ties of FP8 activations resolved toward the kernel, as the routing
    check does for near-tied scores: a row over tol whose activations (acts, as the kernel handed
    them to its down projections) are each within ACT_TOL of the reference's is checked against the
    reference's down projections of those activations instead. (Where the FP8 GEMMs' activations
    round to bf16 one step away from the reference's on a block's largest, that block's scale and
    codes change, 1-3% of the row.) Every other row is checked as _check_rows does."""
    err = np.linalg.norm(got - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
    bad = np.nonzero(err > tol)[0]
    if acts is None or bad.size == 0 or spec.pre_expert_norm is not None:
        _check_rows(got, ref, what, tol)
        return
    h, hs = acts
    xb = np.asarray(x, np.float64)[bad]

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    for r, t in enumerate(bad):
        for j, e in enumerate(ids[t]):
            if e < spec.experts.count:
                d = rel(h[t, j], reference.expert_activation(spec, host, int(e), xb[r:r + 1])[0])
                assert d <= ACT_TOL, f"{what}: row {t}, choice {j} (expert {e}): activations off by {d:.3e} > {ACT_TOL}"
        if hs is not None:
            d = rel(hs[t], reference.shared_activation(spec, xb[r:r + 1], host)[0])
            assert d <= ACT_TOL, f"{what}: row {t}: the shared expert's activations off by {d:.3e} > {ACT_TOL}"
    again = reference.moe_forward_from_activations(spec, xb, host, ids[bad], h[bad], None if hs is None else hs[bad])
    _check_rows(got[bad], again, f"{what} (rows {bad.tolist()[:8]}, from the kernel's activations)", tol)
    _check_rows(np.delete(got, bad, axis=0), np.delete(ref, bad, axis=0), what, tol)
