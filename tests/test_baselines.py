"""The PyTorch baselines of `moegen bench --compare` compute the same layer as the reference."""

import ml_dtypes
import numpy as np
import pytest

from moegen import baselines, reference
from moegen.plan import make_plan
from moegen.spec import parse_spec
from moegen.weights import expected

torch = pytest.importorskip("torch", reason="the baselines are PyTorch code")


@pytest.mark.parametrize("shared", [False, True])
def test_baselines_match_reference(shared):
    d = {"name": "t", "model": "t", "hidden_size": 128, "experts": {"count": 8, "top_k": 2, "intermediate_size": 32},
         "routing": {"renormalize": True}}
    if shared:
        d["shared_expert"] = {"intermediate_size": 32, "gate": "sigmoid"}
    spec = parse_spec(d)
    plan = make_plan(spec)
    w = {k: (torch.randn(s) / s[-1] ** 0.5).to(torch.bfloat16) for k, s in expected(plan).items()}
    x = torch.randn(5, 128).to(torch.bfloat16)
    bits = {k: v.view(torch.int16).numpy().view(ml_dtypes.bfloat16) for k, v in w.items()}
    ref = reference.moe_forward(spec, x.view(torch.int16).numpy().view(ml_dtypes.bfloat16), bits)
    loop = baselines.loop_over_experts(spec, x.float(), {k: v.float() for k, v in w.items()}, torch)
    err = np.abs(loop.double().numpy() - ref).max() / np.abs(ref).max()
    assert err < 1e-5, f"loop over experts: relative error {err:.2e}"
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this PyTorch")
    grouped = baselines.grouped_mm(spec, x, baselines.prepare(w, torch), torch)
    err = np.abs(grouped.double().numpy() - ref).max() / np.abs(ref).max()
    assert err < 2e-2, f"grouped GEMM (bf16): relative error {err:.2e}"


def test_bench_sizes_every_catalog_layer():
    """moegen bench fits its layers per replay to the device from these sizes: every dtype a layer
    takes has one (FP4 codes and scales included), and the BF16 Qwen3-30B-A3B layer is its known size."""
    from conftest import PENDING, SPECS

    from moegen.bench import weight_bytes
    from moegen.plan import make_plan
    from moegen.spec import load_spec

    sizes = {p.stem: weight_bytes(make_plan(load_spec(p, check_generated=False))) for p in SPECS + PENDING}
    assert sizes["qwen3-30b-a3b"] == 2 * (128 * 3 * 768 * 2048 + 128 * 2048)
    assert sizes["qwen3-30b-a3b-mxfp4"] < sizes["qwen3-30b-a3b-fp8"] < sizes["qwen3-30b-a3b"]
