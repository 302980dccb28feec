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
    from conftest import SPECS

    from moegen.bench import weight_bytes
    from moegen.plan import make_plan
    from moegen.spec import load_spec

    sizes = {p.stem: weight_bytes(make_plan(load_spec(p, check_generated=False))) for p in SPECS}
    assert sizes["qwen3-30b-a3b"] == 2 * (128 * 3 * 768 * 2048 + 128 * 2048)
    assert sizes["qwen3-30b-a3b-mxfp4"] < sizes["qwen3-30b-a3b-fp8"] < sizes["qwen3-30b-a3b"]


def test_bench_vs_times_both_specs_in_one_run(monkeypatch, tmp_path, capsys):
    """moegen bench --vs: the second spec is timed in the same run at the same token counts, and
    the time ratio per count is printed and kept in the JSON. The device, the layers and the
    clock are stand-ins here (what the numbers are is the GPU's business)."""
    import json
    import types

    import cuda.core

    from moegen import bench

    class FakeLayer:
        def __init__(self, plan):
            self.plan = plan

        def routing(self, n):
            return np.arange(n * self.plan.top_k).reshape(n, -1) % self.plan.experts, None

        def load_weights_from(self, other):  # the bench's later layers copy the first one's weights
            assert other.plan is self.plan

        def close(self):
            pass

    fake_device = types.SimpleNamespace(set_current=lambda: None, properties=types.SimpleNamespace(multiprocessor_count=132),
                                        name="fake", device_id=0)
    monkeypatch.setattr(cuda.core, "Device", lambda: fake_device)
    monkeypatch.setattr(bench, "_Timer", lambda device: None)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda timer, device: 4e12)
    monkeypatch.setattr(bench, "_layer_count", lambda plan, layers, device: 2)
    monkeypatch.setattr(bench, "_random_weights", lambda plan, rng: {})
    monkeypatch.setattr(bench, "_random_x", lambda plan, n, rng: n)
    plans = {}

    def fake_load(gen, w=None, device=None):
        plan = plans.setdefault(gen.name, bench.tuned_plan(bench.load_spec(f"specs/{gen.name}.yaml"), "generated"))
        return FakeLayer(plan)

    monkeypatch.setattr(bench, "load", fake_load)
    times = {"qwen3-30b-a3b-fp8": 27.0, "qwen3-30b-a3b": 36.0}
    monkeypatch.setattr(bench, "time_stack", lambda timer, stack, xs: times[next(k for k in plans if stack[0].plan is plans[k])])
    out = tmp_path / "b.json"
    assert bench.run_bench("specs/qwen3-30b-a3b-fp8.yaml", tokens=[1, 8], json_path=str(out),
                           vs="specs/qwen3-30b-a3b.yaml") == 0
    printed = capsys.readouterr().out
    assert "time qwen3-30b-a3b-fp8 / qwen3-30b-a3b: N=1 0.75, N=8 0.75" in printed
    got = json.loads(out.read_text())
    assert got["spec"] == "qwen3-30b-a3b-fp8" and got["vs"]["spec"] == "qwen3-30b-a3b"
    assert got["vs"]["time_ratio"] == {"1": 0.75, "8": 0.75} and [r["tokens"] for r in got["vs"]["rows"]] == [1, 8]
