"""Self-checks of the float64 oracle (moegen/reference.py).

Each test compares the reference with a SEPARATE transcription of the published rule
(shared/MODELS.md), written here as a literal per-token Python loop, on fresh random inputs.
The transcriptions share no code with the module under test.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from moegen import reference as ref
from moegen.spec import parse_spec

NEG_INF = float("-inf")
TIGHT = {"rtol": 1e-9, "atol": 1e-12}


# ----------------------------------------------------------------------------- builders


def make_spec(hidden=128, count=16, top_k=2, inter=32, **sections):
    d = {
        "name": "t",
        "model": "test",
        "hidden_size": hidden,
        "experts": {"count": count, "top_k": top_k, "intermediate_size": inter},
    }
    for key, val in sections.items():
        if isinstance(val, dict) and isinstance(d.get(key), dict):
            d[key].update(val)
        else:
            d[key] = val
    return parse_spec(d, check_generated=False)


def bf16(a):
    return np.asarray(a).astype(ml_dtypes.bfloat16)


def f64(a):
    return np.asarray(a).astype(np.float64)


def make_weights(rng, spec, expert_scale=1.0, router_scale=1.0):
    """Random bf16 weights with the canonical names and shapes; never zeros."""
    H, E, I = spec.hidden_size, spec.experts.count, spec.experts.intermediate_size
    S = E + spec.experts.zero_experts
    n = rng.standard_normal
    w = {
        "gate.weight": router_scale * n((S, H)) / math.sqrt(H),
        "experts.gate_proj": expert_scale * n((E, I, H)) / math.sqrt(H),
        "experts.up_proj": expert_scale * n((E, I, H)) / math.sqrt(H),
        "experts.down_proj": n((E, H, I)) / math.sqrt(I),
    }
    if spec.router.bias:
        w["gate.bias"] = 0.5 * n(S)
    if spec.routing.correction_bias:
        w["gate.e_score_correction_bias"] = 0.05 * n(S)
    if spec.router.norm is not None:
        w["router_norm.weight"] = 1.0 + 0.2 * n(H)
    if spec.pre_expert_norm is not None:
        w["pre_expert_norm.weight"] = 1.0 + 0.2 * n(H)
    if spec.experts.bias:
        w["experts.gate_proj_bias"] = 0.5 * n((E, I))
        w["experts.up_proj_bias"] = 0.5 * n((E, I))
        w["experts.down_proj_bias"] = 0.5 * n((E, H))
    s = spec.shared_expert
    if s is not None:
        w["shared_expert.gate_proj"] = expert_scale * n((s.intermediate_size, H)) / math.sqrt(H)
        w["shared_expert.up_proj"] = expert_scale * n((s.intermediate_size, H)) / math.sqrt(H)
        w["shared_expert.down_proj"] = n((H, s.intermediate_size)) / math.sqrt(s.intermediate_size)
        if s.gate == "sigmoid":
            w["shared_expert_gate.weight"] = n((1, H)) / math.sqrt(H)
    return {k: bf16(v) for k, v in w.items()}


def make_x(rng, n, spec):
    return bf16(rng.standard_normal((n, spec.hidden_size)))


# ----------------------------------------------------------------------------- transcriptions


def sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z))


def silu_gated(g, u, limit=None):
    out = []
    for gi, ui in zip(g, u):
        if limit is not None:
            gi, ui = min(gi, limit), max(-limit, min(ui, limit))
        out.append(gi * sigmoid(gi) * ui)
    return np.array(out)


def gelu_gated(g, u):
    return np.array([0.5 * gi * (1 + math.erf(gi / math.sqrt(2))) * ui for gi, ui in zip(g, u)])


def mlp(xt, wg, wu, wd, act=silu_gated):
    return f64(wd) @ act(f64(wg) @ xt, f64(wu) @ xt)


def expert_out(w, e, xt, act=silu_gated):
    return mlp(xt, w["experts.gate_proj"][e], w["experts.up_proj"][e], w["experts.down_proj"][e], act)


def shared_out(w, xt, act=silu_gated, gated=False):
    y = mlp(xt, w["shared_expert.gate_proj"], w["shared_expert.up_proj"], w["shared_expert.down_proj"], act)
    if gated:
        y = y * sigmoid(float(f64(w["shared_expert_gate.weight"])[0] @ xt))
    return y


def token_logits(w, xt):
    logits = f64(w["gate.weight"]) @ xt
    if "gate.bias" in w:
        logits = logits + f64(w["gate.bias"])
    return [float(v) for v in logits]


def softmax_list(vals):
    m = max(vals)
    ex = [math.exp(v - m) for v in vals]
    return [v / sum(ex) for v in ex]


def pick_top(values, k):
    """Descending by value, equal values -> lower index first."""
    return sorted(range(len(values)), key=lambda e: (-values[e], e))[:k]


def kth_gap(values, k):
    s = sorted(values, reverse=True)
    return s[k - 1] - s[k] if len(s) > k else math.inf


def check_routing(r, ids, wts, n, k):
    assert r.ids.shape == (n, k) and r.ids.dtype == np.int64
    assert r.weights.shape == (n, k) and r.weights.dtype == np.float64
    assert r.margin.shape == (n,)
    np.testing.assert_array_equal(r.ids, np.array(ids))
    np.testing.assert_allclose(r.weights, np.array(wts), **TIGHT)


# ----------------------------------------------------------------------------- softmax family


@pytest.mark.parametrize("count,top_k", [(8, 2), (64, 8)])
def test_softmax_topk_renormalize(count, top_k):
    """Mixtral / Qwen3: softmax over all (fp32) -> top-k -> renormalize."""
    rng = np.random.default_rng()
    spec = make_spec(hidden=128, count=count, top_k=top_k, routing={"renormalize": True})
    w, x = make_weights(rng, spec), make_x(rng, 33, spec)
    ids, wts, gaps, outs = [], [], [], []
    for xt in f64(x):
        p = softmax_list(token_logits(w, xt))
        chosen = pick_top(p, top_k)
        tw = [p[e] / sum(p[c] for c in chosen) for e in chosen]
        ids.append(chosen)
        wts.append(tw)
        gaps.append(kth_gap(p, top_k))
        outs.append(sum(wi * expert_out(w, e, xt) for e, wi in zip(chosen, tw)))
    r = ref.route(spec, x, w)
    check_routing(r, ids, wts, 33, top_k)
    np.testing.assert_allclose(r.margin, gaps, **TIGHT)
    np.testing.assert_allclose(r.weights.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(ref.moe_forward(spec, x, w), np.array(outs), **TIGHT)
    np.testing.assert_allclose(ref.router_logits(spec, x, w), [token_logits(w, xt) for xt in f64(x)], **TIGHT)


@pytest.mark.parametrize("shared", [False, True])
def test_softmax_no_renorm_and_sigmoid_gated_shared(shared):
    """OLMoE (no shared) / Qwen1.5-MoE (shared MLP times sigmoid(gate . x)): no renormalization."""
    rng = np.random.default_rng()
    extra = {"shared_expert": {"intermediate_size": 64, "gate": "sigmoid"}} if shared else {}
    spec = make_spec(hidden=96, count=60, top_k=4, inter=24, **extra)
    w, x = make_weights(rng, spec), make_x(rng, 17, spec)
    wts, outs = [], []
    for xt in f64(x):
        p = softmax_list(token_logits(w, xt))
        chosen = pick_top(p, 4)
        wts.append([p[e] for e in chosen])
        y = sum(p[e] * expert_out(w, e, xt) for e in chosen)
        outs.append(y + shared_out(w, xt, gated=True) if shared else y)
    r = ref.route(spec, x, w)
    np.testing.assert_allclose(r.weights, wts, **TIGHT)
    assert np.all(r.weights.sum(axis=1) < 1.0)
    np.testing.assert_allclose(ref.moe_forward(spec, x, w), outs, **TIGHT)


def test_gpt_oss_topk_then_softmax_swiglu_clamped():
    """GPT-OSS: router WITH bias -> top-k on raw logits -> softmax over the k; clamped SwiGLU
    (note B) with expert biases. The checkpoint layout (gate/up interleaved) is built here and
    de-interleaved for the reference, as the loader does."""
    rng = np.random.default_rng()
    H, E, k, I, alpha, limit = 128, 32, 4, 32, 1.702, 7.0
    spec = make_spec(
        hidden=H,
        count=E,
        top_k=k,
        inter=I,
        router={"bias": True},
        routing={"select": "logits"},
        experts={"bias": True, "activation": {"kind": "swiglu_clamped", "alpha": alpha, "limit": limit}},
    )
    n = rng.standard_normal
    gate_up = bf16(4.0 * n((E, 2 * I, H)) / math.sqrt(H))  # large enough that the clamp bites
    gate_up_bias = bf16(n((E, 2 * I)))
    down, down_bias = bf16(n((E, H, I)) / math.sqrt(I)), bf16(n((E, H)))
    router_w, router_b = bf16(n((E, H)) / math.sqrt(H)), bf16(n(E))
    x = make_x(rng, 19, spec)
    clamped = 0
    outs, ids = [], []
    for xt in f64(x):
        logits = list(f64(router_w) @ xt + f64(router_b))
        chosen = pick_top(logits, k)
        scores = softmax_list([logits[e] for e in chosen])
        y = np.zeros(H)
        for e, s in zip(chosen, scores):
            gu = f64(gate_up[e]) @ xt + f64(gate_up_bias[e])
            gate, up = gu[::2], gu[1::2]
            clamped += int(np.sum(gate > limit) + np.sum(np.abs(up) > limit))
            gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
            glu = gate * (1 / (1 + np.exp(-gate * alpha)))
            y += s * (f64(down[e]) @ ((up + 1) * glu) + f64(down_bias[e]))
        outs.append(y)
        ids.append(chosen)
    assert clamped > 0
    w = {
        "gate.weight": router_w, "gate.bias": router_b,
        "experts.gate_proj": gate_up[:, ::2], "experts.up_proj": gate_up[:, 1::2],
        "experts.gate_proj_bias": gate_up_bias[:, ::2], "experts.up_proj_bias": gate_up_bias[:, 1::2],
        "experts.down_proj": down, "experts.down_proj_bias": down_bias,
    }  # fmt: skip
    r = ref.route(spec, x, w)
    np.testing.assert_array_equal(r.ids, ids)
    np.testing.assert_allclose(r.weights.sum(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(ref.moe_forward(spec, x, w), outs, **TIGHT)


# ----------------------------------------------------------------------------- DeepSeek-V3 groups


def deepseek_v3_token(w, xt, n_group, topk_group, k, scale):
    """Note A, literally: sigmoid; biased for selection; group = sum of top-2 biased; keep
    topk_group groups (lower group index on equal scores); top-k; unbiased weights renormalized."""
    scores = [sigmoid(v) for v in token_logits(w, xt)]
    bias = f64(w["gate.e_score_correction_bias"])
    biased = [s + b for s, b in zip(scores, bias)]
    size = len(scores) // n_group
    group_scores = [sum(sorted(biased[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
    kept = pick_top(group_scores, topk_group)
    masked = [v if e // size in kept else NEG_INF for e, v in enumerate(biased)]
    chosen = pick_top(masked, k)
    total = sum(scores[e] for e in chosen)
    return (
        chosen,
        [scores[e] / total * scale for e in chosen],
        min(kth_gap(group_scores, topk_group), kth_gap(masked, k)),
    )


@pytest.mark.parametrize("n_group,topk_group,bias_shift", [(8, 4, 0.0), (8, 4, -0.9), (8, 8, 0.0), (4, 1, 0.0)])
def test_deepseek_v3_grouped_topk(n_group, topk_group, bias_shift):
    """bias_shift=-0.9 makes most biased scores negative: a dropped group must stay out even
    then (masked to -inf, not to 0)."""
    rng = np.random.default_rng()
    spec = make_spec(
        hidden=128, count=64, top_k=8,
        routing={"score": "sigmoid", "correction_bias": True, "n_group": n_group, "topk_group": topk_group,
                 "renormalize": True, "routed_scaling_factor": 2.5},
        shared_expert={"intermediate_size": 32},
    )  # fmt: skip
    w, x = make_weights(rng, spec), make_x(rng, 29, spec)
    w["gate.e_score_correction_bias"] = f64(w["gate.e_score_correction_bias"]) + bias_shift
    got = [deepseek_v3_token(w, xt, n_group, topk_group, 8, 2.5) for xt in f64(x)]
    r = ref.route(spec, x, w)
    check_routing(r, [g[0] for g in got], [g[1] for g in got], 29, 8)
    np.testing.assert_allclose(r.margin, [g[2] for g in got], **TIGHT)
    np.testing.assert_allclose(r.weights.sum(axis=1), 2.5, rtol=1e-12)
    outs = [
        sum(wi * expert_out(w, e, xt) for e, wi in zip(ids, ws)) + shared_out(w, xt)
        for xt, (ids, ws, _) in zip(f64(x), got)
    ]
    np.testing.assert_allclose(ref.moe_forward(spec, x, w), outs, **TIGHT)
    if topk_group == n_group:  # every group kept: identical to plain top-k on biased scores
        flat = make_spec(
            hidden=128, count=64, top_k=8, routing={**spec.routing.model_dump(), "n_group": 1, "topk_group": 1}
        )
        np.testing.assert_array_equal(ref.route(flat, x, w).ids, r.ids)


def test_deepseek_v3_equal_group_scores_keep_lower_group():
    """Groups 1 and 3 get exactly equal group scores (zero router rows -> logit 0 exactly, same
    bias); with one slot left, group 1 must be kept and the margin must be exactly 0."""
    rng = np.random.default_rng()
    spec = make_spec(
        hidden=64, count=16, top_k=6,
        routing={"score": "sigmoid", "correction_bias": True, "n_group": 4, "topk_group": 2, "renormalize": True},
    )  # fmt: skip
    w = make_weights(rng, spec)
    gw, bias = f64(w["gate.weight"]), rng.uniform(0.0, 0.4, 16)
    gw[4:8] = gw[12:16] = 0.0
    bias[0:4] += 1.0  # group 0 always first
    bias[12:16] = bias[4:8]
    bias[8:12] -= 1.0  # group 2 always last
    w["gate.weight"], w["gate.e_score_correction_bias"] = bf16(gw), bias
    x = make_x(rng, 11, spec)
    r = ref.route(spec, x, w)
    assert np.all(r.ids < 8) and np.any(r.ids >= 4)
    np.testing.assert_array_equal(r.margin, 0.0)
    got = [deepseek_v3_token(w, xt, 4, 2, 6, 1.0) for xt in f64(x)]
    check_routing(r, [g[0] for g in got], [g[1] for g in got], 11, 6)


# ----------------------------------------------------------------------------- other routers


def test_longcat_zero_experts_with_correction_bias():
    """Note D: softmax over E+Z; top-k on softmax + bias; unbiased weights * 6, no renorm;
    a zero expert outputs weight * x."""
    rng = np.random.default_rng()
    E, Z, k = 32, 16, 6
    spec = make_spec(
        hidden=64, count=E, top_k=k, experts={"zero_experts": Z},
        routing={"correction_bias": True, "routed_scaling_factor": 6.0},
    )  # fmt: skip
    w, x = make_weights(rng, spec, router_scale=3.0), make_x(rng, 40, spec)
    bias = f64(w["gate.e_score_correction_bias"])
    ids, outs = [], []
    for xt in f64(x):
        p = softmax_list(token_logits(w, xt))
        chosen = pick_top([pi + b for pi, b in zip(p, bias)], k)
        ids.append(chosen)
        outs.append(sum(6.0 * p[e] * (xt if e >= E else expert_out(w, e, xt)) for e in chosen))
    r = ref.route(spec, x, w)
    np.testing.assert_array_equal(r.ids, ids)
    assert np.any(r.ids >= E) and np.any(r.ids < E)
    np.testing.assert_allclose(ref.moe_forward(spec, x, w), outs, **TIGHT)
    only_zero = np.tile(np.arange(E, E + k), (len(x), 1))  # all-identity routing
    wz = ref.routing_weights_for(spec, x, w, only_zero)
    np.testing.assert_allclose(ref.moe_forward(spec, x, w, ids=only_zero), wz.sum(1, keepdims=True) * f64(x), **TIGHT)


def test_llama4_sigmoid_top1_weight_on_input():
    """Llama-4: top-1 on raw logits; sigmoid(top logit) scales the expert INPUT; ungated shared."""
    rng = np.random.default_rng()
    spec = make_spec(
        hidden=128, count=16, top_k=1, inter=64, shared_expert={"intermediate_size": 64},
        routing={"score": "sigmoid", "select": "logits", "weight_on_input": True},
    )  # fmt: skip
    w, x = make_weights(rng, spec, expert_scale=3.0, router_scale=4.0), make_x(rng, 21, spec)
    outs, post = [], []
    for xt in f64(x):
        logits = token_logits(w, xt)
        e = pick_top(logits, 1)[0]
        s = sigmoid(logits[e])
        outs.append(expert_out(w, e, s * xt) + shared_out(w, xt))
        post.append(s * expert_out(w, e, xt) + shared_out(w, xt))
    got = ref.moe_forward(spec, x, w)
    np.testing.assert_allclose(got, outs, **TIGHT)
    assert not np.allclose(got, post, rtol=1e-3)  # the weight really goes in front of the FFN


def sparsemixer_token(logits, k, eps):
    """Phi-3.5 SparseMixer, inference path, transcribed round by round."""
    remaining = list(logits)
    picks, weights = [], []
    for _ in range(k):
        top = max(remaining)
        e = remaining.index(top)  # first occurrence: lower index on ties
        masked = [NEG_INF if (top - s) / max(abs(s), top) > 2 * eps else r for s, r in zip(logits, remaining)]
        ex = [0.0 if v == NEG_INF else math.exp(v - top) for v in masked]
        picks.append(e)
        weights.append(ex[e] / sum(ex))
        remaining[e] = NEG_INF
    return picks, weights


def sparsemixer_margin(logits, k, eps):
    """How far any logit is from changing a round's pick or its mask: each round's gap to the
    next best, and each remaining logit's distance to the mask threshold (found by bisection)."""
    remaining, margin = list(logits), math.inf
    for _ in range(k):
        top = max(remaining)
        remaining[remaining.index(top)] = NEG_INF
        rest = [v for v in remaining if v != NEG_INF]
        if not rest:
            break
        margin = min(margin, top - max(rest))
        lo, hi = top - 10 * (abs(top) + 1), top  # masked at lo, kept at hi
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if (top - mid) / max(abs(mid), top) > 2 * eps else (lo, mid)
        margin = min(margin, min(abs(v - hi) for v in rest))
    return margin


def test_phi_sparsemixer():
    rng = np.random.default_rng()
    spec = make_spec(hidden=64, count=16, top_k=2, routing={"score": "sparsemixer"})
    w, x = make_weights(rng, spec), make_x(rng, 64, spec)
    # Router rows close to a common row: logits cluster, so the 2*eps mask keeps several.
    common = rng.standard_normal(64) / 8.0
    w["gate.weight"] = bf16(common + 0.01 * rng.standard_normal((16, 64)))
    got = [sparsemixer_token(token_logits(w, xt), 2, 0.01) for xt in f64(x)]
    r = ref.route(spec, x, w)
    check_routing(r, [g[0] for g in got], [g[1] for g in got], 64, 2)
    assert np.any(r.weights < 0.99) and np.any(r.weights > 0.999)  # both masking outcomes occur
    np.testing.assert_allclose(r.margin, [sparsemixer_margin(token_logits(w, xt), 2, 0.01) for xt in f64(x)], **TIGHT)
    outs = [sum(wi * expert_out(w, e, xt) for e, wi in zip(*g)) for xt, g in zip(f64(x), got)]
    np.testing.assert_allclose(ref.moe_forward(spec, x, w), outs, **TIGHT)
    swapped = r.ids[:, ::-1]  # the order of the picks matters for SparseMixer
    want = [sparsemixer_given(token_logits(w, xt), ids, 0.01) for xt, ids in zip(f64(x), swapped)]
    np.testing.assert_allclose(ref.routing_weights_for(spec, x, w, swapped), want, **TIGHT)


def sparsemixer_given(logits, picks, eps):
    remaining, weights = list(logits), []
    for e in picks:
        top = logits[e]
        masked = [NEG_INF if (top - s) / max(abs(s), top) > 2 * eps else r for s, r in zip(logits, remaining)]
        m = max(v for v in masked if v != NEG_INF)
        ex = [0.0 if v == NEG_INF else math.exp(v - m) for v in masked]
        weights.append(ex[e] / sum(ex))
        remaining[e] = NEG_INF
    return weights


def sqrt_softplus(v):
    return math.sqrt(math.log1p(math.exp(v)))


def test_hash_routing_sqrt_softplus():
    """DeepSeek-V4 hash layers: experts = tid2eid[token]; weights = sqrt(softplus) scores of
    those experts, renormalized, times the scale; a table lookup has no near-tie."""
    rng = np.random.default_rng()
    vocab, E, k = 100, 16, 4
    spec = make_spec(
        hidden=64, count=E, top_k=k, shared_expert={"intermediate_size": 32},
        routing={"score": "sqrt_softplus", "hash_vocab_size": vocab, "renormalize": True, "routed_scaling_factor": 1.5},
    )  # fmt: skip
    w, x = make_weights(rng, spec), make_x(rng, 23, spec)
    w["tid2eid"] = np.stack([rng.permutation(E)[:k] for _ in range(vocab)]).astype(np.int32)
    tok = rng.integers(0, vocab, len(x))
    ids, wts, outs = [], [], []
    for xt, t in zip(f64(x), tok):
        chosen = [int(e) for e in w["tid2eid"][t]]
        logits = token_logits(w, xt)
        s = [sqrt_softplus(logits[e]) for e in chosen]
        tw = [v / sum(s) * 1.5 for v in s]
        ids.append(chosen)
        wts.append(tw)
        outs.append(sum(wi * expert_out(w, e, xt) for e, wi in zip(chosen, tw)) + shared_out(w, xt))
    r = ref.route(spec, x, w, token_ids=tok)
    check_routing(r, ids, wts, len(x), k)
    assert np.all(np.isinf(r.margin))
    np.testing.assert_allclose(ref.moe_forward(spec, x, w, token_ids=tok), outs, **TIGHT)
    with pytest.raises(ValueError, match="token_ids"):
        ref.route(spec, x, w)
    # the documented rule for ids outside [0, vocab): the nearest row of the table
    far = np.array([-5, vocab, vocab + 1000] + [0] * (len(x) - 3))
    near = np.clip(far, 0, vocab - 1)
    np.testing.assert_array_equal(ref.route(spec, x, w, token_ids=far).ids, w["tid2eid"][near])


@pytest.mark.parametrize("shared_clamp", [False, True])
def test_sqrt_softplus_scored_with_clamped_silu(shared_clamp):
    """DeepSeek-V4 scored layers: top-k on sqrt(softplus) + bias, unbiased weights renormalized
    times 1.5; routed SiLU clamped at 10 (gate from above, up both ways); shared clamp optional."""
    rng = np.random.default_rng()
    limit = 10.0
    spec = make_spec(
        hidden=128, count=32, top_k=6,
        routing={"score": "sqrt_softplus", "correction_bias": True, "renormalize": True, "routed_scaling_factor": 1.5},
        experts={"activation": {"limit": limit}}, shared_expert={"intermediate_size": 32, "clamp": shared_clamp},
    )  # fmt: skip
    w, x = make_weights(rng, spec, expert_scale=8.0), make_x(rng, 15, spec)
    bias = f64(w["gate.e_score_correction_bias"])

    def clamped(g, u):
        return silu_gated(g, u, limit)

    outs, unclamped = [], []
    for xt in f64(x):
        s = [sqrt_softplus(v) for v in token_logits(w, xt)]
        chosen = pick_top([si + b for si, b in zip(s, bias)], 6)
        tw = [s[e] / sum(s[c] for c in chosen) * 1.5 for e in chosen]
        sh = shared_out(w, xt, act=clamped if shared_clamp else silu_gated)
        outs.append(sum(wi * expert_out(w, e, xt, clamped) for e, wi in zip(chosen, tw)) + sh)
        unclamped.append(sum(wi * expert_out(w, e, xt) for e, wi in zip(chosen, tw)) + sh)
    got = ref.moe_forward(spec, x, w)
    np.testing.assert_allclose(got, outs, **TIGHT)
    assert not np.allclose(got, unclamped, rtol=1e-3)  # the clamp was exercised


def test_gelu_gated_with_norms():
    """Exact-erf GELU; router RMSNorm feeds only the router, pre-expert RMSNorm feeds the routed
    and the shared experts."""
    rng = np.random.default_rng()
    spec = make_spec(
        hidden=64, count=8, top_k=2, experts={"activation": {"kind": "gelu_gated"}},
        router={"norm": {"eps": 1e-5}}, pre_expert_norm={"eps": 1e-6}, shared_expert={"intermediate_size": 16},
        routing={"renormalize": True},
    )  # fmt: skip
    w, x = make_weights(rng, spec), make_x(rng, 9, spec)

    def rms(v, weight, eps):  # the normed activations are bf16, like the models' RMSNorm output
        return f64(bf16(v / math.sqrt(sum(t * t for t in v) / len(v) + eps) * f64(weight)))

    outs = []
    for xt in f64(x):
        p = softmax_list([float(v) for v in f64(w["gate.weight"]) @ rms(xt, w["router_norm.weight"], 1e-5)])
        chosen = pick_top(p, 2)
        xe = rms(xt, w["pre_expert_norm.weight"], 1e-6)
        y = sum(p[e] / (p[chosen[0]] + p[chosen[1]]) * expert_out(w, e, xe, gelu_gated) for e in chosen)
        outs.append(y + shared_out(w, xe, gelu_gated))
    np.testing.assert_allclose(ref.moe_forward(spec, x, w), outs, **TIGHT)


def test_fp8_activation_emulation():
    """experts.fp8_activations: each routed GEMM input is quantized per token per 128 channels
    (scale = max(amax, 1e-4) / 448 in fp32, value -> e4m3) and dequantized; the down input is the
    bf16 activation."""
    rng = np.random.default_rng()
    spec = make_spec(hidden=256, count=4, top_k=1, inter=160, experts={"fp8_activations": True})
    plain = make_spec(hidden=256, count=4, top_k=1, inter=160)
    w, x = make_weights(rng, spec), make_x(rng, 5, spec)

    def quant(v):
        out = []
        for start in range(0, len(v), 128):
            block = v[start : start + 128]
            s = float(np.float32(max(max(abs(t) for t in block), 1e-4) / 448.0))
            out += [float(np.float64(np.float32(t / s)).astype(ml_dtypes.float8_e4m3fn)) * s for t in block]
        return np.array(out)

    outs = []
    for xt in f64(x):
        p = softmax_list(token_logits(w, xt))
        e = pick_top(p, 1)[0]
        xq = quant(xt)
        h = silu_gated(f64(w["experts.gate_proj"][e]) @ xq, f64(w["experts.up_proj"][e]) @ xq)
        outs.append(p[e] * (f64(w["experts.down_proj"][e]) @ quant(f64(bf16(h)))))
    got = ref.moe_forward(spec, x, w)
    np.testing.assert_allclose(got, outs, **TIGHT)
    exact = ref.moe_forward(plain, x, w)
    err = np.linalg.norm(got - exact, axis=1) / np.linalg.norm(exact, axis=1)
    assert np.all(err > 1e-4) and np.all(err < 0.1)


def test_fp8_activations_reach_an_fp8_shared_expert():
    """With experts.fp8_activations, an FP8 block shared expert quantizes its inputs too (gate/up:
    x; down: the bf16 activation), as DeepSeek's Linear layers do; a BF16 shared expert does not."""
    rng = np.random.default_rng()
    kw = {"hidden": 256, "count": 4, "top_k": 1, "inter": 128, "experts": {"format": "fp8_block", "fp8_activations": True}}
    fp8 = make_spec(**kw, shared_expert={"intermediate_size": 128, "format": "fp8_block"})
    plain = make_spec(**kw, shared_expert={"intermediate_size": 128})
    w, x = make_weights(rng, fp8), make_x(rng, 3, fp8)

    def quant(v):
        out = []
        for start in range(0, len(v), 128):
            block = v[start : start + 128]
            s = float(np.float32(max(max(abs(t) for t in block), 1e-4) / 448.0))
            out += [float(np.float64(np.float32(t / s)).astype(ml_dtypes.float8_e4m3fn)) * s for t in block]
        return np.array(out)

    def shared(xt, q=None):  # q None: the BF16 shared expert, nothing quantized or rounded
        if q is None:
            g, u = f64(w["shared_expert.gate_proj"]) @ xt, f64(w["shared_expert.up_proj"]) @ xt
            return f64(w["shared_expert.down_proj"]) @ silu_gated(g, u)
        g, u = f64(w["shared_expert.gate_proj"]) @ q(xt), f64(w["shared_expert.up_proj"]) @ q(xt)
        return f64(w["shared_expert.down_proj"]) @ q(f64(bf16(silu_gated(g, u))))

    base = ref.moe_forward(fp8.model_copy(update={"shared_expert": None}), x, w)
    got_fp8, got_plain = ref.moe_forward(fp8, x, w) - base, ref.moe_forward(plain, x, w) - base
    np.testing.assert_allclose(got_fp8, [shared(xt, quant) for xt in f64(x)], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(got_plain, [shared(xt) for xt in f64(x)], rtol=1e-9, atol=1e-9)


def test_forward_from_activations():
    """moe_forward_from_activations, handed the activations the reference computes itself
    (expert_activation and shared_activation per token and choice), gives moe_forward's output; a
    changed activation of one (token, choice) changes that token's row only, by that choice's
    weight times the down projection of the change (no FP8: linear)."""
    rng = np.random.default_rng()
    kw = {"hidden": 256, "count": 8, "top_k": 2, "inter": 128}
    specs = (make_spec(**kw, experts={"format": "fp8_block", "fp8_activations": True},
                       shared_expert={"intermediate_size": 128, "format": "fp8_block"}),
             make_spec(**kw, shared_expert={"intermediate_size": 128, "gate": "sigmoid"}))
    for spec in specs:
        w, x = make_weights(rng, spec), make_x(rng, 5, spec)
        ids = ref.route(spec, x, w).ids
        xe = f64(x)
        h = np.stack([np.stack([ref.expert_activation(spec, w, int(e), xe[t:t + 1])[0] for e in ids[t]])
                      for t in range(len(x))])
        hs = ref.shared_activation(spec, xe, w)
        want = ref.moe_forward(spec, x, w, ids=ids)
        got = ref.moe_forward_from_activations(spec, x, w, ids, h, hs)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        if not spec.experts.fp8_activations:
            d = rng.standard_normal(h.shape[-1])
            h2 = h.copy()
            h2[3, 1] += d
            moved = ref.moe_forward_from_activations(spec, x, w, ids, h2, hs) - got
            rw = ref.routing_weights_for(spec, x, w, ids)
            np.testing.assert_allclose(np.delete(moved, 3, axis=0), 0.0, atol=1e-12)
            np.testing.assert_allclose(moved[3], rw[3, 1] * (f64(w["experts.down_proj"][ids[3, 1]]) @ d), rtol=1e-9, atol=1e-9)


def test_fp8_per_tensor_static_input_quantization():
    """Format d: each GEMM input (routed and shared, gate, up and down each with its own scale) is
    e4m3(x / input_scale) with x / s in float32, clamped to +-448, and the product is multiplied
    by input_scale; the down input is the bf16 activation. Scales small enough that some inputs
    saturate."""
    rng = np.random.default_rng()
    spec = make_spec(hidden=128, count=4, top_k=1, inter=64, experts={"format": "fp8_tensor"},
                     shared_expert={"intermediate_size": 32, "format": "fp8_tensor"})
    w, x = make_weights(rng, spec), make_x(rng, 5, spec)
    for name in ("experts.gate_proj", "experts.up_proj", "experts.down_proj"):
        w[f"{name}_input_scale"] = rng.uniform(1.5, 3.0, 4).astype(np.float32) / 448.0
    for name in ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"):
        w[f"{name}_input_scale"] = np.float32(rng.uniform(1.5, 3.0) / 448.0)

    def quant(v, s):
        s = float(s)
        out = []
        for t in v:
            r = float(np.float32(np.float32(t) / np.float32(s)))
            r = min(max(r, -448.0), 448.0)
            out.append(float(np.float64(r).astype(ml_dtypes.float8_e4m3fn)) * s)
        return np.array(out)

    def mlp(prefix, e, xt):
        m = (lambda n: f64(w[f"{prefix}.{n}"][e])) if e is not None else (lambda n: f64(w[f"{prefix}.{n}"]))
        sc = (lambda n: w[f"{prefix}.{n}_input_scale"][e]) if e is not None else (lambda n: w[f"{prefix}.{n}_input_scale"])
        h = silu_gated(m("gate_proj") @ quant(xt, sc("gate_proj")), m("up_proj") @ quant(xt, sc("up_proj")))
        h = f64(bf16(h))
        return m("down_proj") @ quant(h, sc("down_proj"))

    outs, saturated = [], 0
    for xt in f64(x):
        p = softmax_list(token_logits(w, xt))
        e = pick_top(p, 1)[0]
        saturated += sum(abs(t) / float(w["experts.gate_proj_input_scale"][e]) > 448 for t in xt)
        outs.append(p[e] * mlp("experts", e, xt) + mlp("shared_expert", None, xt))
    assert saturated > 0, "no input reached the saturation"
    np.testing.assert_allclose(ref.moe_forward(spec, x, w), outs, **TIGHT)


# ----------------------------------------------------------------------------- precision, ties


def test_bf16_logits_emulation_creates_a_tie():
    """With logits_dtype bf16 the logits are rounded to bfloat16 before scoring: two logits
    that differ by less than half a bf16 ulp become equal, and the lower index wins."""
    rng = np.random.default_rng()
    spec = make_spec(hidden=64, count=8, top_k=2, router={"bias": True, "logits_dtype": "bf16"})
    w, x = make_weights(rng, spec, router_scale=0.1), make_x(rng, 12, spec)
    gw, b = f64(w["gate.weight"]), 0.1 * rng.standard_normal(8)
    gw[[2, 5]] = 0.0  # logits 2 and 5 are exactly their biases
    b[0], b[2], b[5] = 4.0, 1.0, 1.0 + 2.0**-12  # 1 + 2^-12 rounds to 1.0 in bf16
    w["gate.weight"], w["gate.bias"] = bf16(gw), b
    exact = f64(x) @ gw.T + b
    np.testing.assert_array_equal(ref.router_logits(spec, x, w), f64(bf16(exact)))
    r = ref.route(spec, x, w)
    np.testing.assert_array_equal(r.ids, np.tile([0, 2], (12, 1)))
    np.testing.assert_array_equal(r.margin, 0.0)
    raw = ref.route(spec, x, w, logits_dtype_emulation=False)
    np.testing.assert_array_equal(raw.ids, np.tile([0, 5], (12, 1)))
    assert np.all(raw.margin > 0)


def test_planted_exact_tie_lower_index_and_kernel_choice():
    """Experts 3 and 5 get exactly equal scores at the k-th place: expert 3 is chosen, the
    margin is 0, and the reference evaluated with the kernel's choice (5) follows that choice."""
    rng = np.random.default_rng()
    spec = make_spec(hidden=64, count=8, top_k=2, router={"bias": True}, routing={"renormalize": True})
    w, x = make_weights(rng, spec, router_scale=0.3), make_x(rng, 10, spec)
    gw, b = f64(w["gate.weight"]), np.zeros(8)
    gw[[3, 5]] = 0.0
    b[0], b[3], b[5] = 6.0, 2.0, 2.0
    w["gate.weight"], w["gate.bias"] = bf16(gw), b
    r = ref.route(spec, x, w)
    np.testing.assert_array_equal(r.ids, np.tile([0, 3], (10, 1)))
    np.testing.assert_array_equal(r.margin, 0.0)
    kernel_ids = np.tile([0, 5], (10, 1))
    np.testing.assert_allclose(ref.routing_weights_for(spec, x, w, kernel_ids), r.weights, **TIGHT)
    outs = [sum(wi * expert_out(w, e, xt) for e, wi in zip([0, 5], ws)) for xt, ws in zip(f64(x), r.weights)]
    got = ref.moe_forward(spec, x, w, ids=kernel_ids)
    np.testing.assert_allclose(got, outs, **TIGHT)
    assert not np.allclose(got, ref.moe_forward(spec, x, w), rtol=1e-3)


def test_bf16_inputs_equal_their_float64_values():
    """The oracle converts every input to float64 exactly: bf16 arrays and their float64 copies
    give bit-identical results."""
    rng = np.random.default_rng()
    spec = make_spec(hidden=64, count=8, top_k=2, shared_expert={"intermediate_size": 16, "gate": "sigmoid"})
    w, x = make_weights(rng, spec), make_x(rng, 6, spec)
    a = ref.moe_forward(spec, x, w)
    b = ref.moe_forward(spec, f64(x), {k: f64(v) for k, v in w.items()})
    np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(a)) and np.linalg.norm(a) > 0


def test_missing_or_misshaped_weight_is_named():
    rng = np.random.default_rng()
    spec = make_spec(hidden=64, count=8, top_k=2, shared_expert={"intermediate_size": 16, "gate": "sigmoid"})
    w, x = make_weights(rng, spec), make_x(rng, 3, spec)
    del w["shared_expert_gate.weight"]
    with pytest.raises(KeyError, match="shared_expert_gate.weight"):
        ref.moe_forward(spec, x, w)
    w = make_weights(rng, spec)
    w["experts.down_proj"] = w["experts.down_proj"][:, :, :8]
    with pytest.raises(ValueError, match="experts.down_proj"):
        ref.moe_forward(spec, x, w)


def test_routed_sum_is_the_same_on_threads():
    """The reference computes experts on threads and sums them in expert order: the same bits
    as one thread."""
    rng = np.random.default_rng()
    spec = parse_spec({"name": "t", "model": "t", "hidden_size": 64,
                       "experts": {"count": 12, "top_k": 3, "intermediate_size": 32}}, check_generated=False)
    w = {"experts.gate_proj": rng.standard_normal((12, 32, 64)), "experts.up_proj": rng.standard_normal((12, 32, 64)),
         "experts.down_proj": rng.standard_normal((12, 64, 32))}
    x = rng.standard_normal((40, 64))
    ids = np.stack([rng.permutation(12)[:3] for _ in range(40)])
    rw = rng.random((40, 3))
    one = ref._routed(spec, x, w, ids, rw, threads=1)
    assert np.array_equal(ref._routed(spec, x, w, ids, rw, threads=5), one)
    want = sum(rw[:, j, None] * np.stack([ref._expert(spec, w, int(ids[t, j]), x[t:t + 1])[0] for t in range(40)])
               for j in range(3))
    assert np.allclose(one, want, rtol=1e-12, atol=1e-12)
