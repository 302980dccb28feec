"""The GPU tiers' row checks themselves (tests/rowcheck.py), on the CPU: outputs made from the
reference with planted faults must fail them, and FP8-activation near-ties must pass only as
DESIGN.md's rule allows."""

from __future__ import annotations

import numpy as np
import pytest
from rowcheck import ACT_TOL, _check_rows, check_rows_fp8_act

from moegen import reference
from moegen.spec import parse_spec


def _layer(rng):
    spec = parse_spec({"name": "r", "model": "r", "hidden_size": 256,
                       "experts": {"count": 8, "top_k": 2, "intermediate_size": 256, "format": "fp8_block",
                                   "fp8_activations": True},
                       "shared_expert": {"intermediate_size": 128, "format": "fp8_block"}}, check_generated=False)
    H, E, I, S = 256, 8, 256, 128
    w = {"gate.weight": rng.standard_normal((E, H)) / 16,
         "experts.gate_proj": rng.standard_normal((E, I, H)) / 16, "experts.up_proj": rng.standard_normal((E, I, H)) / 16,
         "experts.down_proj": rng.standard_normal((E, H, I)) / 16,
         "shared_expert.gate_proj": rng.standard_normal((S, H)) / 16,
         "shared_expert.up_proj": rng.standard_normal((S, H)) / 16,
         "shared_expert.down_proj": rng.standard_normal((H, S)) / 16}
    x = rng.standard_normal((6, H))
    ids = reference.route(spec, x, w).ids
    h = np.stack([np.stack([reference.expert_activation(spec, w, int(e), x[t:t + 1])[0] for e in ids[t]])
                  for t in range(len(x))])
    return spec, w, x, ids, h, reference.shared_activation(spec, x, w)


def _tie(a: np.ndarray) -> np.ndarray:
    """a with its largest element moved by one bf16 step: what a kernel's rounding one step off on a
    128-block's largest activation hands its down projection."""
    b = a.copy()
    i = int(np.argmax(np.abs(b[:128])))
    b[i] += np.sign(b[i]) * 2.0 ** (np.floor(np.log2(abs(b[i]))) - 7)
    return b


def test_near_tied_fp8_activations_pass_from_the_kernels_activations():
    spec, w, x, ids, h, hs = _layer(np.random.default_rng(1))
    ref = reference.moe_forward(spec, x, w, ids=ids)
    h2 = h.copy()
    h2[2, 1] = _tie(h[2, 1])
    got = reference.moe_forward_from_activations(spec, x, w, ids, h2, hs)
    moved = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert moved[2] > 1e-6 and np.all(np.delete(moved, 2) < 1e-12)  # the row moved, the others did not
    tol = moved[2] / 2  # below the moved row: only the rule can pass it
    with pytest.raises(AssertionError):
        _check_rows(got, ref, "end to end", tol)
    check_rows_fp8_act(got, ref, "near-tie", tol, spec, w, x, ids, (h2, hs))


def test_fp8_activation_rule_still_fails_wrong_rows():
    spec, w, x, ids, h, hs = _layer(np.random.default_rng(2))
    ref = reference.moe_forward(spec, x, w, ids=ids)
    good = reference.moe_forward_from_activations(spec, x, w, ids, h, hs)
    # activations off by more than ACT_TOL: a gate/up fault, not a near-tie
    h2 = h.copy()
    h2[1, 0] *= 1 + 5 * ACT_TOL
    bad = reference.moe_forward_from_activations(spec, x, w, ids, h2, hs)
    with pytest.raises(AssertionError, match="activations off"):
        check_rows_fp8_act(bad, ref, "gate/up fault", 1e-6, spec, w, x, ids, (h2, hs))
    # the shared expert's activations off
    hs2 = hs.copy()
    hs2[4] *= 1 + 5 * ACT_TOL
    with pytest.raises(AssertionError, match="shared"):
        check_rows_fp8_act(reference.moe_forward_from_activations(spec, x, w, ids, h, hs2), ref, "shared fault", 1e-6,
                           spec, w, x, ids, (h, hs2))
    # right activations, a wrong down stage or sum: the row fails from the kernel's activations too
    out = good.copy()
    out[3] *= 1.05
    with pytest.raises(AssertionError, match="from the kernel's activations"):
        check_rows_fp8_act(out, ref, "down fault", 2e-2, spec, w, x, ids, (h, hs))
    # an unwritten row
    out = good.copy()
    out[5, 7] = np.nan
    with pytest.raises(AssertionError, match="NaN"):
        check_rows_fp8_act(out, ref, "unwritten", 2e-2, spec, w, x, ids, (h, hs))
    # without the kernel's activations (other layers), the plain check
    with pytest.raises(AssertionError):
        check_rows_fp8_act(bad, ref, "plain", 1e-6, spec, w, x, ids, None)
