"""Routing rules, activations and 4-bit weight formats beyond the softmax/sigmoid BF16 catalog
(their GPU check is tests/test_gpu_features.py): the spec accepts each as written, each compiles
for sm_90a without spills or a stack frame, and asks for the weights it reads. Expert parallelism compiles too but
is still refused by the spec until it runs across GPUs."""

from __future__ import annotations

import pytest

from moegen.build import render_all
from moegen.nvrtc import compile_cuda, compile_parts
from moegen.plan import make_plan
from moegen.spec import SpecError, not_generated, parse_spec
from moegen.weights import tensors

BASE = {"name": "f", "model": "f", "hidden_size": 1024}
CASES = {
    # LongCat: softmax over routed + zero experts, correction bias, no renormalization, x6
    "zero_experts": {"experts": {"count": 64, "zero_experts": 32, "top_k": 12, "intermediate_size": 512},
                     "routing": {"correction_bias": True, "routed_scaling_factor": 6.0}},
    # Llama-4: top-1 on raw logits, sigmoid of it scales the expert input, shared expert always added
    "weight_on_input": {"experts": {"count": 16, "top_k": 1, "intermediate_size": 1024},
                        "shared_expert": {"intermediate_size": 1024},
                        "routing": {"score": "sigmoid", "select": "logits", "weight_on_input": True}},
    # GPT-OSS: router bias, top-k on logits then softmax, clamped SwiGLU, expert biases
    "gpt_oss": {"experts": {"count": 32, "top_k": 4, "intermediate_size": 1024, "bias": True,
                            "activation": {"kind": "swiglu_clamped", "alpha": 1.702, "limit": 7.0}},
                "router": {"bias": True}, "routing": {"select": "logits"}},
    # DeepSeek-V4 scored layers: sqrt-softplus + correction bias, SiLU clamped at 10, clamped shared expert
    "sqrt_softplus": {"experts": {"count": 64, "top_k": 6, "intermediate_size": 512,
                                  "activation": {"limit": 10.0}},
                      "shared_expert": {"intermediate_size": 512, "clamp": True},
                      "routing": {"score": "sqrt_softplus", "correction_bias": True, "renormalize": True,
                                  "routed_scaling_factor": 1.5}},
    # DeepSeek-V4 hash layers: the token id's row of a static table picks the experts
    "hash": {"experts": {"count": 64, "top_k": 6, "intermediate_size": 512},
             "routing": {"score": "sqrt_softplus", "hash_vocab_size": 1000, "renormalize": True,
                         "routed_scaling_factor": 1.5}},
    # Phi-3.5-MoE SparseMixer
    "sparsemixer": {"experts": {"count": 16, "top_k": 2, "intermediate_size": 512},
                    "routing": {"score": "sparsemixer", "select": "logits"}},
    # RMSNorm before the router and before the experts
    "rmsnorm": {"experts": {"count": 16, "top_k": 2, "intermediate_size": 512},
                "router": {"norm": {"eps": 1e-6}}, "pre_expert_norm": {"eps": 1e-5}},
    "gelu": {"experts": {"count": 16, "top_k": 2, "intermediate_size": 512, "activation": {"kind": "gelu_gated"}}},
    # GPT-OSS / OCP MX: e2m1 codes with an E8M0 scale per row and 32 along K, routed and shared
    "mxfp4": {"experts": {"count": 32, "top_k": 4, "intermediate_size": 512, "format": "mxfp4"},
              "shared_expert": {"intermediate_size": 512, "format": "mxfp4"}},
    # ModelOpt NVFP4: e2m1 codes, an e4m3 scale per row and 16 along K, an fp32 scale_2 per matrix
    "nvfp4": {"experts": {"count": 32, "top_k": 4, "intermediate_size": 512, "format": "nvfp4"},
              "shared_expert": {"intermediate_size": 512, "format": "nvfp4"}},
}
# Generated and compiled, but refused by the spec until they have passed the GPU tier
# (tests/test_gpu_features.py runs them too).
CASES |= {
    # ModelOpt FP8 per-tensor (format d): e4m3 codes, a weight scale and a static input scale per matrix
    "fp8_tensor": {"experts": {"count": 32, "top_k": 4, "intermediate_size": 512, "format": "fp8_tensor"},
                   "shared_expert": {"intermediate_size": 384, "format": "fp8_tensor"}},
    # DeepSeek's FP8: 128x128 block weights and activations quantized per token and 128 channels
    "fp8_activations": {"experts": {"count": 32, "top_k": 4, "intermediate_size": 512, "format": "fp8_block",
                                    "fp8_activations": True},
                        "shared_expert": {"intermediate_size": 384, "format": "fp8_block"}},
}


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MOEGEN_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.mark.parametrize("case", sorted(CASES))
def test_feature_is_accepted_by_the_spec(case):
    spec = parse_spec({**BASE, **CASES[case]})  # check_generated=True: no refusal
    assert not_generated(spec) == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_feature_compiles_clean(case):
    spec = parse_spec({**BASE, **CASES[case]}, check_generated=False)
    plan = make_plan(spec)
    src = render_all(spec, plan)["layer.cu"]
    res = compile_cuda(src, plan.arch, use_cache=False).resources
    assert set(res) == {k.name for k in plan.kernels}
    bad = {n: r for n, r in res.items() if r.spill_stores or r.spill_loads or r.stack_bytes}
    assert not bad, f"{case}: spills or stack: {bad}"


def test_feature_weights_are_asked_for():
    gpt = make_plan(parse_spec({**BASE, **CASES["gpt_oss"]}))
    names = tensors(gpt)
    assert names["gate.bias"] == ((32,), "float32")
    assert names["experts.gate_proj_bias"] == ((32, 1024), "float32")
    assert names["experts.down_proj_bias"] == ((32, 1024), "float32")
    lc = make_plan(parse_spec({**BASE, **CASES["zero_experts"]}))
    assert tensors(lc)["gate.weight"][0] == (96, 1024)  # the router scores routed + zero experts
    assert tensors(lc)["gate.e_score_correction_bias"][0] == (96,)
    hashed = make_plan(parse_spec({**BASE, **CASES["hash"]}))
    assert tensors(hashed)["tid2eid"] == ((1000, 6), "int32")
    mx = tensors(make_plan(parse_spec({**BASE, **CASES["mxfp4"]})))
    assert mx["experts.gate_proj"] == ((32, 512, 512), "uint8")  # [E, I, H/2]: two codes a byte
    assert mx["experts.gate_proj_scale"] == ((32, 512, 32), "uint8")  # [E, I, H/32] E8M0
    assert mx["experts.down_proj"] == ((32, 1024, 256), "uint8")
    assert mx["shared_expert.down_proj_scale"] == ((1024, 16), "uint8")
    nv = tensors(make_plan(parse_spec({**BASE, **CASES["nvfp4"]})))
    assert nv["experts.up_proj"] == ((32, 512, 512), "uint8")
    assert nv["experts.up_proj_scale"] == ((32, 512, 64), "float8_e4m3fn")  # [E, I, H/16]
    assert nv["experts.up_proj_scale_2"] == ((32,), "float32")  # one per expert matrix
    assert nv["shared_expert.down_proj_scale_2"] == ((), "float32")
    f8 = tensors(make_plan(parse_spec({**BASE, **CASES["fp8_tensor"]})))
    assert f8["experts.gate_proj"] == ((32, 512, 1024), "float8_e4m3fn")
    assert f8["experts.gate_proj_scale"] == ((32,), "float32")  # one weight scale per expert matrix
    assert f8["experts.down_proj_input_scale"] == ((32,), "float32")  # and one static input scale
    assert f8["shared_expert.up_proj_input_scale"] == ((), "float32")


def test_fp8_per_tensor_gemv_reads_rows_quantized_once():
    """FP8 per-tensor weights on the GEMV path: a moe_tensor_quant launch between the routing and
    gate/up in every GEMV bucket but the one-token kernel's (which quantizes x itself), its grid a warp per 256 columns of each row it may write (a row
    per routed pair, and per token for a shared expert in that format); its rows in workspace xt
    (pairs) and xt_s (tokens), sized by the largest GEMV bucket; gate/up gets them and down's
    scales (it quantizes the activations); a layer without the format gets none of it. Compiles
    without spills."""
    from moegen.families import Layer, tensor_quant_blocks
    from moegen.plan import TARGETS

    spec = parse_spec({**BASE, **CASES["fp8_tensor"], "max_tokens": 1024}, check_generated=False)
    plan = make_plan(spec)  # (a shared expert beside FP8 per-tensor experts: no prefill buckets)
    c = Layer.of(spec, TARGETS[spec.arch])
    ks = {k.name: k for k in plan.kernels}
    (tq,) = [k for k in plan.kernels if k.family == "tensor_quant"]
    assert tq.targs == ("1024", "true", "true") and tq.arg_keys[-3:] == ("ws.xt", "ws.xt_s", "n")
    assert not plan.prefill_from
    for b in plan.buckets:
        fams = [ks[x.kernel].family for x in b.launches]
        if b.max_tokens == 1:  # the one-token kernel quantizes x itself
            assert fams == ["single"] and ks[b.launches[0].kernel].name.endswith("_fp8_tensor_sm_90a"), fams
            continue
        at = fams.index("tensor_quant")
        assert fams[at + 1] == "gate_up" and fams[at - 1] in ("router", "route"), fams
        rows = b.max_tokens * (4 + 1)  # top-4 pairs and the shared expert's row, per token: 4 warps each
        assert b.launches[at].grid == (tensor_quant_blocks(c, b.max_tokens), 1) == (min(-(-rows * 4 // 8), 4 * 132), 1)
        gu = ks[b.launches[at + 1].kernel]
        assert gu.arg_keys[-4:] == ("ws.xt", "ws.xt_s", "w.s2", "w.ss2")
    ws = {x.name: x.shape for x in plan.workspace}
    assert ws["xt"] == (1024 * 4, 1024) and ws["xt_s"] == (1024, 1024)
    routed = make_plan(parse_spec({**BASE, "experts": CASES["fp8_tensor"]["experts"], "max_tokens": 1024},
                                  check_generated=False))
    ks = {k.name: k for k in routed.kernels}
    assert [k.targs for k in routed.kernels if k.family == "tensor_quant"] == [("1024", "true", "false")]
    assert routed.prefill_from, "FP8 per-tensor routed experts alone: prefill buckets"
    for b in routed.buckets:
        assert ("tensor_quant" in [ks[x.kernel].family for x in b.launches]) == (1 < b.max_tokens < routed.prefill_from)
    ws = {x.name: x.shape for x in routed.workspace}
    assert ws["xt"] == (routed.prefill_from // 2 * 4, 1024) and ws["xt_s"] == (1,)
    bf16 = make_plan(parse_spec({**BASE, "experts": {"count": 32, "top_k": 4, "intermediate_size": 512}},
                                check_generated=False))
    assert not [k for k in bf16.kernels if k.family == "tensor_quant"]
    assert {x.name: x.shape for x in bf16.workspace}["xt"] == (1,)
    res = compile_parts(render_all(spec, plan)["layer.cu"], plan.arch, plan.parts).resources
    assert all(r.spill_stores == r.spill_loads == r.stack_bytes == 0 for r in res.values())


def test_expert_parallel_partition():
    """Each rank holds a contiguous share; together they hold every expert once; rank 0 alone
    keeps the shared expert; the kernels compile clean."""
    from moegen.families import partition

    for e, ep in ((256, 8), (60, 8), (8, 3), (5, 5)):
        spans = [partition(e, ep, r) for r in range(ep)]
        assert sum(n for _, n in spans) == e
        assert all(lo == plo + pn for (lo, _), (plo, pn) in zip(spans[1:], spans))
        assert max(n for _, n in spans) - min(n for _, n in spans) <= 1
    d = {**BASE, "experts": {"count": 60, "top_k": 4, "intermediate_size": 512},
         "shared_expert": {"intermediate_size": 512, "gate": "sigmoid"}}
    with pytest.raises(SpecError, match=r"parallel\.ep_size=8 is not generated yet"):
        parse_spec({**d, "parallel": {"ep_size": 8, "ep_rank": 0}})  # until it has run across GPUs
    specs = [parse_spec({**d, "parallel": {"ep_size": 8, "ep_rank": r}}, check_generated=False) for r in range(8)]
    plans = [make_plan(s) for s in specs]
    assert [p.local_experts for p in plans] == [8, 8, 8, 8, 7, 7, 7, 7]
    assert [p.expert_offset for p in plans] == [0, 8, 16, 24, 32, 39, 46, 53]
    assert plans[0].shared_inter == 512 and all(p.shared_inter == 0 for p in plans[1:])
    assert tensors(plans[5])["experts.gate_proj"][0] == (7, 512, 1024)
    res = compile_cuda(render_all(specs[5], plans[5])["layer.cu"], "sm_90a", use_cache=False).resources
    assert not any(r.spill_stores or r.stack_bytes for r in res.values())
    with pytest.raises(Exception, match="more ranks than"):
        make_plan(parse_spec({**d, "parallel": {"ep_size": 61, "ep_rank": 0}}, check_generated=False))
