"""GPU check of the routing rules, activations and weight formats beyond the BF16 softmax catalog
(tests/test_features.py): each against the float64 reference at N = 1, 7 and 64. A new rule or
format passes here on the GPU before its refusal in moegen/spec.py is lifted."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_features import BASE, CASES
from test_gpu import TIE_TOL, _check_rows, _host, check_rows_fp8_act, kernel_activations, row_tol

from moegen import reference
from moegen.build import render_all, write_dir
from moegen.families import Tuning
from moegen.plan import TARGETS, make_plan
from moegen.runtime import load
from moegen.samples import random_weights
from moegen.spec import load_spec, parse_spec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", sorted(CASES))
def test_feature_matches_reference(case, tmp_path):
    import torch

    spec = parse_spec({**BASE, **CASES[case]}, check_generated=False)
    plan = make_plan(spec)
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_counts(case, spec, plan, layer, host, torch)
    finally:
        layer.close()


def _check_counts(case, spec, plan, layer, host, torch, counts=(1, 7, 64)) -> None:
    hashed = spec.routing.hash_vocab_size is not None
    for n in counts:
        x = torch.randn(n, plan.hidden, device="cuda", dtype=torch.bfloat16)
        tid = torch.randint(0, spec.routing.hash_vocab_size or 1, (n,), device="cuda", dtype=torch.int32)
        out = torch.full_like(x, float("nan"))
        layer(x, out=out, stream=torch.cuda.current_stream(), token_ids=tid if hashed else None)
        acts = kernel_activations(layer, spec, n, torch)
        ids, w = layer.routing(n)
        xh, tids = _host(x), tid.cpu().numpy() if hashed else None
        r = reference.route(spec, xh, host, token_ids=tids)
        slack = _norm_rounding_slack(spec, xh, host)  # [N] bound on a logit's move from norm rounding
        away = r.margin >= TIE_TOL + 2 * slack
        same = (np.sort(r.ids, axis=1) == np.sort(ids, axis=1)).all(axis=1)
        assert (same | ~away).all(), f"{case} N={n}: experts differ from the reference away from ties"
        rw = reference.routing_weights_for(spec, xh, host, ids.astype(np.int64), token_ids=tids)
        tol = 1e-5 + (1e-4 + 2 * slack[:, None]) * np.abs(rw)
        assert (np.abs(w - rw) <= tol).all(), f"{case} N={n}: routing weights differ"
        ref = reference.moe_forward(spec, xh, host, token_ids=tids, ids=ids.astype(np.int64))
        check_rows_fp8_act(_host(out).astype(np.float64), ref, f"{case} N={n}", row_tol(spec), spec, host, xh,
                           ids.astype(np.int64), acts)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-next-80b-a3b", "gpt-oss-20b"])
def test_fused_tuning_matches_reference(name, tmp_path):
    """The fused small-batch expert kernel (a tuning; the analytic plan does not fuse) at every
    token count of its buckets, against the reference; two runs give the same bits. The three
    layers cover a shared expert with its gate and expert biases."""
    import torch

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    plan = make_plan(spec, tuning=Tuning(fused=4))
    nf = max(b.max_tokens for b in plan.buckets if plan.kernel(b.launches[1].kernel).family == "expert")
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_counts(name, spec, plan, layer, host, torch, counts=range(1, nf + 1))
        x = torch.randn(nf, plan.hidden, device="cuda", dtype=torch.bfloat16)
        a, b = (layer(x, out=torch.full_like(x, float("nan")), stream=torch.cuda.current_stream()) for _ in range(2))
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "two runs on the same input differ"
    finally:
        layer.close()


ONE_TOKEN_TUNINGS = {"barriers": Tuning(single_tags=False), "barriers-t1": Tuning(single_tags=False, down_tiles=1),
                     "t1": Tuning(down_tiles=1), "plain": Tuning(single_coop=False),
                     "route-block": Tuning(single_overlap=False), "rows": Tuning(single_cols=False),
                     "rows-t1": Tuning(single_cols=False, down_tiles=1),
                     "pieces": Tuning(single_cols=False, single_tmap=False),
                     "route-block-pieces": Tuning(single_overlap=False, single_tmap=False), "cols-rounds": Tuning(),
                     "late": Tuning(single_late_down=True), "late-barriers": Tuning(single_late_down=True, single_tags=False)}
# planned for twice the multiprocessors: down by columns in more unit groups than the grid's blocks
ONE_TOKEN_TARGETS = {"cols-rounds": replace(TARGETS["sm_90a"], sm_count=264)}
ONE_TOKEN_CASES = [(n, t) for n in ("qwen3-30b-a3b", "qwen3-next-80b-a3b") for t in ONE_TOKEN_TUNINGS] + [
    ("qwen3-30b-a3b-fp8", "fp8-route-block"), ("qwen3-30b-a3b-fp8", "fp8-t1"), ("qwen3-30b-a3b-fp8", "fp8-pieces"),
    ("qwen3-30b-a3b-fp8", "fp8-early"), ("qwen3-30b-a3b-nvfp4", "fp4-early"), ("qwen3-30b-a3b-mxfp4", "fp4-early"),
    ("qwen3-30b-a3b-mxfp4", "fp4-route-block"), ("qwen3-30b-a3b-nvfp4", "fp4-route-block")]
# the analytic plan's one-token kernel of the BF16 layers whose down rows do not fit a block's shared
# memory: down by columns, 4 to 14 units a group
COLS_SPECS = ("deepseek-v2-lite", "deepseek-v4-flash", "deepseek-v4-pro", "glm-4.5-air", "glm-4.5", "kimi-k2",
              "mixtral-8x7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "qwen3-235b-a22b",
              "qwen3-coder-480b-a35b")
ONE_TOKEN_CASES += [(n, "cols") for n in COLS_SPECS]
ONE_TOKEN_TUNINGS.update({"fp8-route-block": Tuning(single_overlap=False), "fp8-t1": Tuning(down_tiles=1),
                          "fp8-pieces": Tuning(single_tmap=False), "fp8-early": Tuning(single_late_down=False),
                          "fp4-route-block": Tuning(single_overlap=False), "fp4-early": Tuning(single_late_down=False),
                          "cols": Tuning()})


@pytest.mark.parametrize("name,variant", ONE_TOKEN_CASES, ids=[f"{n}-{t}" for n, t in ONE_TOKEN_CASES])
def test_one_token_kernel_tunings_match_reference(name, variant, tmp_path):
    """The one-token kernel's tunings (grid barriers instead of tagged words; one down tile per
    group, so one bulk copy per expert; a plain launch; the whole block routing before the first
    gate/up loads (route_block) rather than warp 0 while the other warps load; down by rows (each
    block's 16 output rows of every operand after the activations' exchange) instead of by
    columns, with one tile a group too; down by columns planned for twice the multiprocessors
    (more unit groups than blocks: the later groups in rounds); one bulk copy per
    piece of down rows instead of a tensor copy per operand; BF16 down rows asked for late (as
    warp 0 starts its last round of gate/up loads), with tagged words or grid barriers; FP8 block
    weights with the block's route, with one tile per group, with a bulk copy per 512-byte piece,
    and with its down rows asked for early; MXFP4 and NVFP4 weights with the block's route, and
    with their down rows asked for early; the analytic kernel of the BF16 layers whose down rows
    do not fit in shared memory, which go by columns) at
    N = 1 against the reference, three calls on fresh inputs (the tagged words' epoch advancing), and two runs on
    one input giving the same bits. The analytic plan's kernel is in the GPU tier."""
    import torch

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    plan = make_plan(spec, ONE_TOKEN_TARGETS.get(variant), tuning=ONE_TOKEN_TUNINGS[variant])
    kernel = plan.kernel(plan.buckets[0].launches[-1].kernel)
    assert kernel.family == "single"
    assert ("_cols" in kernel.name) == (variant in ("t1", "plain", "cols-rounds", "cols")), kernel.name
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_counts(name, spec, plan, layer, host, torch, counts=(1, 1, 1))
        x = torch.randn(1, plan.hidden, device="cuda", dtype=torch.bfloat16)
        a, b = (layer(x, out=torch.full_like(x, float("nan")), stream=torch.cuda.current_stream()) for _ in range(2))
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "two runs on the same input differ"
    finally:
        layer.close()


def _tied_layer(name: str, distinct: int, tuning: Tuning | None, tmp_path: Path, torch):
    """The spec's layer with its router rows repeated (expert e's row is expert e % distinct's):
    equal logits exactly, in the kernels as in the reference. Returns spec, plan, layer, host weights."""
    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    plan = make_plan(spec, tuning=tuning)
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    rows = torch.arange(plan.experts, device="cuda") % distinct
    dev_w["gate.weight"] = dev_w["gate.weight"][rows].contiguous()
    host["gate.weight"] = host["gate.weight"][rows.cpu().numpy()]
    return spec, plan, load(tmp_path / spec.name, dev_w), host


def _check_tied_call(name: str, spec, plan, layer, host, n: int, distinct: int, torch) -> None:
    """One call of n fresh tokens: every token's choices equal the reference's in order, the
    routing weights match, and the output matches the reference on those choices."""
    x = torch.randn(n, plan.hidden, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    layer(x, out=out, stream=torch.cuda.current_stream())
    ids, w = layer.routing(n)
    xh = _host(x)
    r = reference.route(spec, xh, host)
    bad = np.flatnonzero((ids != r.ids).any(1))
    assert not len(bad), f"{name} N={n}: token {bad[0]}'s choices {ids[bad[0]].tolist()}, the reference's {r.ids[bad[0]].tolist()}"
    rw = reference.routing_weights_for(spec, xh, host, ids.astype(np.int64))
    assert np.allclose(w, rw, rtol=1e-4, atol=1e-6), f"{name} N={n}: routing weights differ"
    _check_rows(_host(out).astype(np.float64), reference.moe_forward(spec, xh, host, ids=ids.astype(np.int64)),
                f"{name} N={n} ties of {distinct} rows")


ROUTES = {"warp": Tuning(single_block_route=False), "block": Tuning(single_block_route=True),
          "rows": Tuning(single_overlap=False)}


@pytest.mark.parametrize("name,distinct,route", [(n, d, r) for n in ("qwen3-30b-a3b", "qwen3-next-80b-a3b")
                                                  for d in (1, 5, 16) for r in ROUTES])
def test_one_token_kernel_breaks_exact_ties_as_the_reference(name, distinct, route, tmp_path):
    """Router rows repeated (expert e's row is expert e % distinct's): equal logits exactly, in the
    kernel as in the reference, so the choices are decided by ties alone (the lower expert first,
    the reference's rule): at N = 1 the one-token kernel's choices equal the reference's in
    order, and the output matches the reference on them, with warp 0's route (route_one: its
    bound, and past 32 candidates its rounds), the whole block's while down goes by columns
    (route_block; the analytic plan's for the layer without a shared expert), and the whole
    block's ahead of down by rows. With one distinct row every expert ties."""
    import torch

    spec, plan, layer, host = _tied_layer(name, distinct, ROUTES[route], tmp_path, torch)
    assert plan.kernel(plan.buckets[0].launches[-1].kernel).family == "single"
    try:
        for _ in range(3):
            _check_tied_call(name, spec, plan, layer, host, 1, distinct, torch)
    finally:
        layer.close()


@pytest.mark.parametrize("name,distinct,n", [(m, d, n) for m in ("qwen3-30b-a3b", "qwen3-next-80b-a3b")
                                              for d in (1, 5) for n in (2, 7, 64)])
def test_route_breaks_exact_ties_as_the_reference(name, distinct, n, tmp_path):
    """Router rows repeated as above, for the buckets past one token: the router's last block
    routing N <= 8 tokens and the route kernel past it (a warp a token, route_one's rules): every
    token's choices equal the reference's in order, and the output matches the reference on them."""
    import torch

    spec, plan, layer, host = _tied_layer(name, distinct, None, tmp_path, torch)
    try:
        _check_tied_call(name, spec, plan, layer, host, n, distinct, torch)
    finally:
        layer.close()


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "qwen1.5-moe-a2.7b"])
def test_prefill_with_a_shared_expert_matches_reference(name, tmp_path):
    """Prefill with a shared expert (one more GEMM pair over all tokens, its
    sigmoid gate in the combine) at both ends of the first prefill bucket, against the reference;
    the largest N of the bucket bitwise repeatable. The two layers cover an ungated and a gated
    shared expert."""
    import torch
    import yaml

    data = yaml.safe_load((Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml").read_text())
    spec = parse_spec({**data, "max_tokens": 1024}, check_generated=False)
    plan = make_plan(spec)
    below = max(b.max_tokens for b in plan.buckets if b.max_tokens < plan.prefill_from)
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_counts(name, spec, plan, layer, host, torch, counts=(below + 1, plan.prefill_from))
        x = torch.randn(plan.prefill_from, plan.hidden, device="cuda", dtype=torch.bfloat16)
        a, b = (layer(x, out=torch.full_like(x, float("nan")), stream=torch.cuda.current_stream()) for _ in range(2))
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "two runs on the same input differ"
    finally:
        layer.close()


def _scale_past_the_limit(spec, plan, dev_w, host, names, factor, at_least):
    """Gate and up weights (names) times factor on the device and in the reference's copy, so that
    the activation's limit binds: at least `at_least` of the first expert's gates (up: |up|) pass it
    on random inputs."""
    for name in names:
        dev_w[name].mul_(factor)
        host[name] = _host(dev_w[name])
    x = np.random.default_rng().standard_normal((64, plan.hidden))
    limit = spec.experts.activation.limit
    for m in ("experts.gate_proj", "experts.up_proj"):
        v = x @ np.asarray(host[m][0], np.float64).T
        assert np.mean(v > limit if m.endswith("gate_proj") else np.abs(v) > limit) > at_least, m


def _check_prefill_ends(label, spec, plan, layer, host, torch) -> None:
    """N = 7 (the GEMV path) and both ends of the first prefill bucket against the reference, and
    the largest N of the bucket bitwise repeatable."""
    below = max(b.max_tokens for b in plan.buckets if b.max_tokens < plan.prefill_from)
    _check_counts(label, spec, plan, layer, host, torch, counts=(7, below + 1, plan.prefill_from))
    x = torch.randn(plan.prefill_from, plan.hidden, device="cuda", dtype=torch.bfloat16)
    a, b = (layer(x, out=torch.full_like(x, float("nan")), stream=torch.cuda.current_stream()) for _ in range(2))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "two runs on the same input differ"


@pytest.mark.parametrize("shared_clamp", [True, False])
def test_clamped_silu_through_the_gemv_path_and_the_prefill_epilogue(shared_clamp, tmp_path):
    """DeepSeek-V4's SiLU clamped at 10 (gate from above, up both ways; the shared expert's as its
    spec option says) through the GEMV path (N = 7) and the prefill GEMMs' epilogue (both ends of
    the first prefill bucket), on gate and up weights scaled by 8, so that about a tenth of the
    gates and a fifth of the ups pass the limit, against the reference."""
    import torch

    case = CASES["sqrt_softplus"]
    spec = parse_spec({**BASE, **case, "shared_expert": {**case["shared_expert"], "clamp": shared_clamp},
                       "max_tokens": 1024}, check_generated=False)
    plan = make_plan(spec)
    assert plan.prefill_from, "the clamped SiLU layer has prefill buckets"
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    _scale_past_the_limit(spec, plan, dev_w, host, ("experts.gate_proj", "experts.up_proj", "shared_expert.gate_proj",
                                                    "shared_expert.up_proj"), 8.0, 0.05)  # about 11% and 21%
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_prefill_ends(f"clamp (shared {shared_clamp})", spec, plan, layer, host, torch)
    finally:
        layer.close()


def test_prefill_with_the_routing_weight_on_the_input_matches_reference(tmp_path):
    """Llama-4's rule (top-1 sigmoid of the logit, the weight scaling the expert's input, a shared
    expert always added) through the prefill kernels: the place kernel writes each row's weight,
    the routed gate/up GEMM scales gate and up by it before the activation, the combine adds Y
    unweighted; at N = 7 (the GEMV path) and both ends of the first prefill bucket, against the
    reference, and the largest N of the bucket bitwise repeatable."""
    import torch

    spec = parse_spec({**BASE, **CASES["weight_on_input"], "max_tokens": 1024}, check_generated=False)
    plan = make_plan(spec)
    assert plan.prefill_from, "the weight-on-input layer has prefill buckets"
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_prefill_ends("weight_on_input prefill", spec, plan, layer, host, torch)
    finally:
        layer.close()


@pytest.mark.parametrize("fmt,bm", [("bf16", 128), ("bf16", 64), ("mxfp4", 128)])
def test_prefill_with_expert_biases_and_clamped_swiglu_matches_reference(fmt, bm, tmp_path):
    """GPT-OSS's experts through the prefill kernels, in BF16 and in MXFP4 as released: its widths
    (2880: 180 16-row tiles, 90 row groups, whole blocks of neither 8 warps nor, for the down
    GEMM's row-group pairs, 4: the last row block overlapping the one before), with two consumer
    warpgroups (the plan's) and, in BF16, one (tuning prefill_bm=64); the biases added in the gate/up and
    down epilogues, the clamped SwiGLU (alpha 1.702, limit 7, up + 1) on gate and up weights
    scaled by 4 (MXFP4: by 8, each E8M0 scale plus 3) so that the limit binds for some; at N = 7 (the
    GEMV path) and both ends of the first prefill bucket, against the reference, and the largest N
    of the bucket bitwise repeatable."""
    import torch

    from moegen.formats import MXFP4Weight

    case = CASES["gpt_oss"]
    spec = parse_spec({**BASE, **case, "hidden_size": 2880, "max_tokens": 1024,
                       "experts": {**case["experts"], "intermediate_size": 2880, "format": fmt}}, check_generated=False)
    plan = make_plan(spec, tuning=Tuning(prefill_bm=bm) if bm != 128 else None)
    assert plan.prefill_from and plan.prefill_tiles[0] == bm, (plan.prefill_from, plan.prefill_tiles)
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    names = ("experts.gate_proj", "experts.up_proj")
    if fmt == "bf16":
        _scale_past_the_limit(spec, plan, dev_w, host, names, 4.0, 0.02)  # ~4%, 8%
    else:
        for name in names:
            s = np.asarray(dev_w[name + "_scale"]).astype(np.int64) + 3
            assert s.max() <= 254, "the scales stay finite"
            dev_w[name + "_scale"] = s.astype(np.uint8)
            host[name] = MXFP4Weight(np.asarray(dev_w[name]), dev_w[name + "_scale"], 2 * np.shape(dev_w[name])[-1]).dequantize()
        _scale_past_the_limit(spec, plan, dev_w, host, (), 1.0, 0.02)
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_prefill_ends(f"gpt_oss {fmt} bm {bm} prefill", spec, plan, layer, host, torch)
    finally:
        layer.close()


def test_prefill_with_an_fp8_shared_expert_beside_mxfp4_experts_matches_reference(tmp_path):
    """DeepSeek-V4-Flash-FP4's formats through the prefill kernels: MXFP4 routed experts on the
    128-token tile, the FP8 block shared expert on its own 64-token tile (template argument BNT, a
    tile table of its own); with DeepSeek-V4's rule (sqrt-softplus, SiLU clamped at 10, the shared
    expert clamped) at a reduced width; at N = 7 (the GEMV path) and both ends of the first prefill
    bucket, against the reference, and the largest N of the bucket bitwise repeatable."""
    import torch

    from moegen import prefill_plan
    case = CASES["sqrt_softplus"]
    spec = parse_spec({**BASE, **case, "hidden_size": 1024, "max_tokens": 1024,
                       "experts": {**case["experts"], "format": "mxfp4"},
                       "shared_expert": {**case["shared_expert"], "format": "fp8_block"}}, check_generated=False)
    plan = make_plan(spec)
    assert plan.prefill_from and prefill_plan.other_bn(plan.kernels, plan.prefill_tiles[1]) == 64, \
        (plan.prefill_from, plan.prefill_tiles)
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_prefill_ends("fp8 shared beside mxfp4 prefill", spec, plan, layer, host, torch)
    finally:
        layer.close()


def test_prefill_with_fp8_per_tensor_experts_matches_reference(tmp_path):
    """FP8 per-tensor experts (ModelOpt FP8, Qwen3-30B-A3B-FP8-tensor's format) through the prefill
    kernels: each routed row quantized by its expert's static input scale (gate's and up's
    equal, as the loader requires there), the codes' products summed over K and scaled once, H'
    quantized by the down projection's input scale; the scales leave some activations past +-448
    (saturation); at a reduced width, at N = 7 (the GEMV path) and both ends of the first prefill
    bucket, against the reference, and the largest N of the bucket bitwise repeatable."""
    import torch

    spec = parse_spec({**BASE, "hidden_size": 1024, "max_tokens": 1024,
                       "experts": {"count": 64, "top_k": 6, "intermediate_size": 512, "format": "fp8_tensor"}},
                      check_generated=False)
    plan = make_plan(spec)
    assert plan.prefill_from and plan.prefill_tiles[10] is True, (plan.prefill_from, plan.prefill_tiles)
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    assert np.array_equal(dev_w["experts.gate_proj_input_scale"], dev_w["experts.up_proj_input_scale"])
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_prefill_ends("fp8 per-tensor prefill", spec, plan, layer, host, torch)
    finally:
        layer.close()


# FP8 block prefill: Qwen3-30B-A3B-FP8 as released, and DeepSeek-V3-FP8's rules (sigmoid, groups, a
# shared FP8 expert) at a width small enough to pack its random weights in a few seconds; each with
# bf16 activations and with FP8 ones (the -a8 specs: codes by codes on the tensor cores)
_DSV3_SMALL = {"hidden_size": 1024, "experts": {"count": 64, "top_k": 6, "intermediate_size": 512, "format": "fp8_block"},
               "shared_expert": {"intermediate_size": 1024, "gate": "none", "format": "fp8_block"}}
FP8_PREFILL = {
    "qwen3-30b-a3b-fp8": {},
    "qwen3-30b-a3b-fp8-a8": {},
    "deepseek-v3-fp8": _DSV3_SMALL,
    "deepseek-v3-fp8-a8": {**_DSV3_SMALL, "experts": {**_DSV3_SMALL["experts"], "fp8_activations": True}},
}


@pytest.mark.parametrize("name", sorted(FP8_PREFILL))
def test_prefill_fp8_block_matches_reference(name, tmp_path):
    """Prefill with FP8 block weights (each K block's products scaled in fp32), with bf16 activations
    or FP8 ones (quantized per token and 128 channels as the reference emulates it), at both ends
    of the first prefill bucket, against the reference fed the same codes and scales; the largest N
    of the bucket bitwise repeatable."""
    import torch
    import yaml

    data = yaml.safe_load((Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml").read_text())
    spec = parse_spec({**data, **FP8_PREFILL[name], "max_tokens": 1024}, check_generated=False)
    plan = make_plan(spec)
    assert plan.prefill_from, f"{name}: no prefill bucket"
    below = max(b.max_tokens for b in plan.buckets if b.max_tokens < plan.prefill_from)
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_counts(name, spec, plan, layer, host, torch, counts=(below + 1, plan.prefill_from))
        x = torch.randn(plan.prefill_from, plan.hidden, device="cuda", dtype=torch.bfloat16)
        a, b = (layer(x, out=torch.full_like(x, float("nan")), stream=torch.cuda.current_stream()) for _ in range(2))
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "two runs on the same input differ"
    finally:
        layer.close()


def test_prefill_x_codes_a_row_per_choice_give_the_gathered_rows_bits(tmp_path):
    """FP8 activations in the buckets that quantize x into a row of codes per (token, choice) after
    the rows are placed (prefill_plan.a8_xrows, from x's codes half of L2; the routed gate/up GEMM
    reads them by tensor copies): the same output bits as the layer whose routed gate/up gathers
    each token's row (the tuning prefill_xrows false), at the first such bucket's smallest N and at
    an N inside it (DeepSeek-V3-FP8-a8's rules at the reduced width of FP8_PREFILL, H = 1024: from
    N = 32769)."""
    import torch
    import yaml

    from moegen.families import Layer as FLayer
    from moegen.prefill_plan import a8_xrows

    name = "deepseek-v3-fp8-a8"
    data = yaml.safe_load((Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml").read_text())
    spec = parse_spec({**data, **FP8_PREFILL[name], "max_tokens": 65536}, check_generated=False)
    rows, gather = make_plan(spec), make_plan(spec, tuning=Tuning(prefill_xrows=False))
    c = FLayer.of(spec, TARGETS[spec.arch], Tuning())
    first = next(b.max_tokens for b in rows.buckets if a8_xrows(c, b.max_tokens))
    lo = max(b.max_tokens for b in rows.buckets if b.max_tokens < first) + 1
    assert any("_xrows_" in k.name for k in rows.kernels) and not any("_xrows_" in k.name for k in gather.kernels)
    layers = []
    dev_w, _ = random_weights(rows)
    try:
        for i, plan in enumerate((rows, gather)):
            write_dir(tmp_path / f"{spec.name}-{i}", render_all(spec, plan))
            layers.append(load(tmp_path / f"{spec.name}-{i}", dev_w))
        for n in (lo, (lo + first) // 2):
            x = torch.randn(n, rows.hidden, device="cuda", dtype=torch.bfloat16)
            a, b = (layer(x, out=torch.full_like(x, float("nan")), stream=torch.cuda.current_stream()) for layer in layers)
            torch.cuda.synchronize()
            assert bool(torch.isfinite(a.float()).all()), (name, n)
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} N = {n}: x's rows differ from gathered"
    finally:
        for layer in layers:
            layer.close()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_prefill_fp4_scales_of_many_exponents_through_the_kernels(fmt, tmp_path):
    """FP4 weights in the prefill GEMMs (each code times its row scale a bf16 A fragment) and the
    GEMV path, on scales spread over many exponents: MXFP4 E8M0 bytes 2^-12 .. 2^+12 around the
    O(1) level and some of them 0 (2^-127, a bf16 subnormal in the fragments: negligible beside a
    row's other blocks, so checked only for not disturbing them); NVFP4 any positive finite e4m3
    scale (2^-9 to 448), with scale_2 keeping the rows O(1). A reduced layer with
    a shared expert in the same format (its GEMMs take every token), at both ends of the first
    prefill bucket and at N = 7, against the reference fed the same values."""
    import torch

    from moegen.formats import MXFP4Weight, NVFP4Weight

    spec = parse_spec({**BASE, "hidden_size": 1024, "max_tokens": 1024,
                       "experts": {"count": 64, "top_k": 6, "intermediate_size": 512, "format": fmt},
                       "shared_expert": {"intermediate_size": 512, "gate": "none", "format": fmt}},
                      check_generated=False)
    plan = make_plan(spec)
    assert plan.prefill_from and plan.prefill_tiles[9] == fmt, plan.prefill_tiles
    below = max(b.max_tokens for b in plan.buckets if b.max_tokens < plan.prefill_from)
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    rng = np.random.default_rng()
    for name in [n for n in dev_w if n + "_scale" in dev_w]:
        codes, k = np.asarray(dev_w[name]), 2 * np.shape(dev_w[name])[-1]
        if fmt == "mxfp4":
            s = np.asarray(dev_w[name + "_scale"]).astype(np.int64)
            s = np.clip(s + rng.integers(-12, 13, s.shape), 1, 254)
            s[rng.random(s.shape) < 0.02] = 0  # 2^-127
            dev_w[name + "_scale"] = s = s.astype(np.uint8)
            host[name] = MXFP4Weight(codes, s, k).dequantize()
        else:
            pool = np.arange(0x01, 0x7F, dtype=np.uint8)  # every positive finite e4m3 (0x01..0x07 subnormal)
            s = rng.choice(pool, np.shape(dev_w[name + "_scale"])).view(ml_dtypes.float8_e4m3fn)
            rms = np.sqrt(np.mean(np.square(s.astype(np.float64)), axis=(-1, -2)))  # per matrix
            s2 = (1.0 / (2.5 * np.sqrt(k) * rms)).astype(np.float32)
            dev_w[name + "_scale"], dev_w[name + "_scale_2"] = s, s2
            host[name] = NVFP4Weight(codes, s, s2[..., None], (codes.shape[-2],), k).dequantize()
    layer = load(tmp_path / spec.name, dev_w)
    try:
        _check_counts(f"{fmt} scales", spec, plan, layer, host, torch, counts=(7, below + 1, plan.prefill_from))
    finally:
        layer.close()


def _norm_rounding_slack(spec, xh, host) -> np.ndarray:
    """[N] the most a router logit can move because the router RMSNorm's bf16 output rounds the
    other way in the kernel (fp32) than in the reference (float64): only elements within 16 fp32
    ulps of a bf16 rounding midpoint can, each by one bf16 step, moving logit e by |W[e, i]| times
    that step. A softmax or sigmoid weight then moves by at most twice that, relatively."""
    if spec.router.norm is None:
        return np.zeros(len(xh))
    x = xh.astype(np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + spec.router.norm.eps)
    y = (y * np.asarray(host["router_norm.weight"], np.float64)).astype(np.float32)
    low = (y.view(np.uint32) & 0xFFFF).astype(np.int64)  # the bits below bf16's; 0x8000: the midpoint
    step = np.where(np.abs(low - 0x8000) <= 16, np.spacing(np.abs(y)) * 2.0**16, 0.0)  # one bf16 step
    return (step @ np.abs(np.asarray(host["gate.weight"], np.float64)).T).max(axis=1)


@pytest.mark.parametrize("codes", ["subnormal", "every"])
def test_fp8_codes_of_every_kind_through_the_kernels(codes, tmp_path):
    """FP8 block weights made only of planted codes, with unit block scales, against the
    reference fed the same values: the e4m3 subnormals alone (a kernel that lost them would
    give zeros), then every finite code. The kernels read the codes by integer operations and a
    bf16 multiply; this checks that path, subnormals included, on the device."""
    import torch

    from moegen.formats import FP8BlockWeight

    spec = parse_spec({**BASE, "hidden_size": 512, "experts": {"count": 8, "top_k": 2, "intermediate_size": 256,
                                                             "format": "fp8_block"},
                       "shared_expert": {"intermediate_size": 128, "format": "fp8_block"}}, check_generated=False)
    plan = make_plan(spec)
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    rng = np.random.default_rng()
    pool = (np.r_[0:8, 0x80:0x88] if codes == "subnormal"
            else np.array([c for c in range(256) if c & 0x7F != 0x7F])).astype(np.uint8)
    for name in [n for n in dev_w if n + "_scale_inv" in dev_w]:
        q = rng.choice(pool, np.shape(dev_w[name])).view(ml_dtypes.float8_e4m3fn)
        s = np.ones(np.shape(dev_w[name + "_scale_inv"]), np.float32)
        if codes == "every":  # keep the activations O(1): every code, scaled down by its block
            s /= 448.0 * np.sqrt(q.shape[-1])
        dev_w[name], dev_w[name + "_scale_inv"] = q, s
        host[name] = FP8BlockWeight(q, s).dequantize()
    layer = load(tmp_path / spec.name, dev_w)
    try:
        for n in (1, 7, 64):
            x = torch.randn(n, plan.hidden, device="cuda", dtype=torch.bfloat16)
            out = torch.full_like(x, float("nan"))
            layer(x, out=out, stream=torch.cuda.current_stream())
            ids, _ = layer.routing(n)
            ref = reference.moe_forward(spec, _host(x), host, ids=ids.astype(np.int64))
            assert np.abs(ref).max() > 0
            _check_rows(_host(out).astype(np.float64), ref, f"fp8 {codes} codes N={n}")
    finally:
        layer.close()
