"""The PyTorch baselines of `moegen bench --compare` compute the same layer as the reference."""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from moegen import baselines, reference
from moegen.plan import make_plan
from moegen.spec import load_spec, parse_spec
from moegen.weights import expected

ROOT = Path(__file__).resolve().parent.parent

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
    monkeypatch.setattr(bench, "time_stack",
                        lambda timer, stack, xs, ids=None: times[next(k for k in plans if stack[0].plan is plans[k])])
    out = tmp_path / "b.json"
    assert bench.run_bench("specs/qwen3-30b-a3b-fp8.yaml", tokens=[1, 8], json_path=str(out),
                           vs="specs/qwen3-30b-a3b.yaml") == 0
    printed = capsys.readouterr().out
    assert "time qwen3-30b-a3b-fp8 / qwen3-30b-a3b: N=1 0.75, N=8 0.75" in printed
    got = json.loads(out.read_text())
    assert got["spec"] == "qwen3-30b-a3b-fp8" and got["vs"]["spec"] == "qwen3-30b-a3b"
    assert got["vs"]["time_ratio"] == {"1": 0.75, "8": 0.75} and [r["tokens"] for r in got["vs"]["rows"]] == [1, 8]


# DeepSeek-V3's rules at a small size: FP8 block experts and shared expert, sigmoid scores with the
# correction bias, 4 groups of 4 experts of which 2 are kept, renormalized, times 2.5.
DSV3_SMALL = {"name": "t", "model": "t", "hidden_size": 256,
              "experts": {"count": 16, "top_k": 4, "intermediate_size": 128, "format": "fp8_block"},
              "shared_expert": {"intermediate_size": 256, "format": "fp8_block"},
              "routing": {"score": "sigmoid", "renormalize": True, "routed_scaling_factor": 2.5,
                          "correction_bias": True, "n_group": 4, "topk_group": 2}}
N = 64
TIE = 1e-4  # tokens whose routing is this close to flipping (fp32 against float64) are not compared


@pytest.fixture
def dsv3(monkeypatch):
    """The spec, moegen bench's own random weights and inputs (made on the CPU here: torch.randn's
    device dropped) in the forms bench hands the baselines: e4m3 codes and their scales as NumPy
    arrays, the router and x as torch BF16; and the reference's weights, the codes dequantized by
    moegen.formats in float64. The correction bias is made 10x bench's, so that it moves choices."""
    from moegen import bench
    from moegen.formats import FP8BlockWeight

    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **k: randn(*a, **k))
    spec = parse_spec(DSV3_SMALL)
    plan = make_plan(spec)
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    w = bench._random_weights(plan, rng)
    w["gate.e_score_correction_bias"] = w["gate.e_score_correction_bias"] * 10
    x = bench._random_x(plan, N, rng)
    assert isinstance(w["experts.gate_proj"], np.ndarray) and w["experts.gate_proj"].dtype.name == "float8_e4m3fn"
    ref_w = {}
    for name, a in w.items():
        if name.endswith("_scale_inv"):
            continue
        if f"{name}_scale_inv" in w:
            ref_w[name] = FP8BlockWeight(a, w[f"{name}_scale_inv"]).dequantize()
        elif isinstance(a, torch.Tensor):
            ref_w[name] = a.float().double().numpy()
        else:
            ref_w[name] = np.asarray(a, np.float64)
    x_np = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return spec, w, x, ref_w, x_np


def _away_from_ties(r: reference.Routing) -> np.ndarray:
    keep = r.margin > TIE
    assert keep.sum() >= N - 8, f"only {keep.sum()} of {N} tokens away from routing near-ties"
    return keep


def test_deepseek_v3_routing_matches_reference(dsv3):
    """The torch routing (fp32) picks the reference's experts (float64) with its weights: unbiased
    sigmoid scores of the chosen, renormalized, times 2.5."""
    spec, w, x, ref_w, x_np = dsv3
    ref = reference.route(spec, x_np, ref_w)
    ids, rw = baselines._route(spec, x, baselines.prepare(w, torch), torch)
    ids, rw = ids.numpy(), rw.double().numpy()
    keep = _away_from_ties(ref)
    for t in np.nonzero(keep)[0]:
        assert sorted(ids[t]) == sorted(ref.ids[t]), f"token {t}: torch {sorted(ids[t])}, reference {sorted(ref.ids[t])}"
        np.testing.assert_allclose(rw[t][np.argsort(ids[t])], ref.weights[t][np.argsort(ref.ids[t])], rtol=1e-5)
    # the data exercise the rule: the bias and the groups each change some token's experts
    logits = x_np.astype(np.float64) @ ref_w["gate.weight"].T
    sig = 1 / (1 + np.exp(-logits))
    plain = np.sort(np.argsort(-sig, axis=1)[:, :4], axis=1)
    biased = np.sort(np.argsort(-(sig + ref_w["gate.e_score_correction_bias"]), axis=1)[:, :4], axis=1)
    chosen = np.sort(ref.ids, axis=1)
    assert (plain != chosen).any(axis=1)[keep].any(), "the correction bias changed no token's experts"
    assert (biased != chosen).any(axis=1)[keep].any(), "the groups changed no token's experts"


def test_deepseek_v3_fp8_loop_matches_reference(dsv3):
    """The loop over experts on the dequantized FP8 weights (routed and shared) is the reference's
    layer: to fp32 rounding with float32 dequantization, to bf16 rounding with the BF16 weights
    `moegen bench --compare` times."""
    spec, w, x, ref_w, x_np = dsv3
    ref = reference.moe_forward(spec, x_np, ref_w)
    keep = _away_from_ties(reference.route(spec, x_np, ref_w))
    scale = np.abs(ref[keep]).max()
    exact = baselines.loop_over_experts(spec, x.float(), baselines.prepare(w, torch, torch.float32), torch)
    err = np.abs(exact.double().numpy() - ref)[keep].max() / scale
    assert err < 1e-5, f"loop over experts (fp32 dequantization): relative error {err:.2e}"
    prepared = baselines.prepare(w, torch)
    assert prepared["experts.down_proj"].dtype == torch.bfloat16 and prepared["shared_expert.up_proj"].dtype == torch.bfloat16
    loop = baselines.loop_over_experts(spec, x, prepared, torch)
    assert loop.dtype == torch.bfloat16
    err = np.abs(loop.double().numpy() - ref)[keep].max() / scale
    assert err < 2e-2, f"loop over experts (bf16): relative error {err:.2e}"


def test_deepseek_v3_fp8_grouped_mm_matches_loop(dsv3):
    """torch._grouped_mm over the dequantized experts' transposed views computes the loop's layer."""
    spec, w, x = dsv3[:3]
    prepared = baselines.prepare(w, torch)
    loop = baselines.loop_over_experts(spec, x, prepared, torch).double().numpy()
    try:
        grouped = baselines.grouped_mm(spec, x, prepared, torch)
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._grouped_mm does not run on the CPU here: {type(exc).__name__}: {exc}")
    err = np.abs(grouped.double().numpy() - loop).max() / np.abs(loop).max()
    assert err < 2e-2, f"grouped GEMM against the loop (bf16): relative error {err:.2e}"


@pytest.mark.parametrize("name, why", [("deepseek-v4-flash-hash", "hash routing"),
                                       ("longcat-flash", "zero experts"),
                                       ("qwen3-30b-a3b-mxfp4", "experts.format=mxfp4"),
                                       ("gpt-oss-20b", "router.bias")])
def test_compare_refuses_what_the_baselines_cannot_run(name, why, capsys):
    from moegen.bench import _can_compare

    assert not _can_compare(load_spec(ROOT / "specs" / f"{name}.yaml", check_generated=False))
    out = capsys.readouterr().out
    assert "skipped" in out and why in out, out


@pytest.mark.parametrize("name", ["deepseek-v3-fp8", "deepseek-v3-fp8-a8", "qwen3-30b-a3b-fp8", "qwen3-30b-a3b"])
def test_compare_runs_fp8_block_and_deepseek_routing(name, capsys):
    """FP8 block layers and DeepSeek-V3's routing are compared; the FP8 ones say their weights are
    dequantized to BF16, the FP8-activation ones that the baselines take BF16 activations."""
    from moegen.bench import _can_compare

    spec = load_spec(ROOT / "specs" / f"{name}.yaml", check_generated=False)
    assert _can_compare(spec) and capsys.readouterr().out == ""
    note = baselines.describe(spec)
    assert ("dequantized to BF16" in note) == ("fp8" in name)
    assert ("BF16 activations" in note) == name.endswith("-a8")
