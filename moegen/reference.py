"""The float64 NumPy oracle of one MoE layer, written from the models' published definitions.

This module never looks at a kernel, a plan or a template: it follows shared/MODELS.md (the
model authors' routing rules, notes A-E) so that every numeric test has an independent truth.
It covers every routing rule and activation the Spec schema can express, including the ones the
generator refuses today.

Conventions
- Inputs may be any float dtype (bfloat16 from ml_dtypes included); everything is converted to
  float64 first, so the oracle sees exactly the values the kernel was given.
- Router logits are float64; with `router.logits_dtype: bf16` they are rounded to bfloat16
  (as the kernel stores them) before scoring. fp32 logits are not rounded: the difference is
  far below the tolerance and near-ties are handled through `Routing.margin`.
- Ties: on equal selection values the LOWER expert index wins (a stable sort of the negated
  values). Grouped top-k breaks equal group scores the same way (lower group index wins).
  Groups that are not kept are masked to -inf, so a masked expert can never be chosen.
- RMSNorm outputs (before the router, before the experts) are bf16 activations: rounded to
  bfloat16, as the models' norms return the input dtype.
- Hash routing keeps the table's order of experts (there is no selection value to sort by).
- Zero (identity) experts are indices >= experts.count; they return weight * (their input).
- Expert parallelism is ignored: the oracle is the whole layer (the sum over all ranks).
- `experts.fp8_activations` is emulated (MODELS.md format a) on the inputs of every FP8 block GEMM
  of the layer (the routed experts', and the shared expert's when it is FP8 block), as DeepSeek's
  Linear layers quantize theirs; the down projections' input is the bf16 activation.
- FP8 per-tensor weights (format d) quantize each GEMM's input by that matrix's static
  `<name>_input_scale`: e4m3(x / s) with x/s in float32, clamped to +-448 first (static scales do
  not bound the activations); the output is (x_q . W_q) * s * weight_scale, W given dequantized.
  The down projection's input is the bf16 activation the models hand it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from moegen.spec import ActivationKind, Score, Select, Spec

Weights = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Routing:
    """The routing decision for N tokens.

    ids:     [N, k] int64, chosen experts (>= E for zero experts), by descending selection
             value, ties -> lower index first (hash routing: the table's order).
    weights: [N, k] float64, final weights (after renormalization and routed_scaling_factor).
    margin:  [N] float64, how far the decision is from flipping, in selection-value units:
             the gap between the k-th and (k+1)-th selection value (and between the last kept
             and first dropped group; for SparseMixer also every round's order and masking
             threshold). np.inf when nothing could flip (hash routing, k == all experts).
    """

    ids: np.ndarray
    weights: np.ndarray
    margin: np.ndarray


# ----------------------------------------------------------------------------- small helpers


def _bf16(a: np.ndarray) -> np.ndarray:
    """Rounded to bfloat16 (a bf16 activation or logit), back in float64."""
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def _f64(a: np.ndarray) -> np.ndarray:
    # bf16/fp16/fp32 -> float64 is exact, so the oracle sees the kernel's input values.
    return np.asarray(a).astype(np.float64)


def _weight(weights: Weights, name: str, shape: tuple[int, ...], expert: int | None = None) -> np.ndarray:
    """One named weight in float64, shape-checked; with `expert`, only that expert's slice
    (a whole stacked tensor in float64 can be many GB). A weight may be any object with a
    `shape` whose `[e]` is expert e's matrix and that converts with np.asarray (e.g. quantized
    experts dequantized one at a time)."""
    if name not in weights:
        raise KeyError(f"reference: the spec needs weight {name!r}, which is missing")
    a = weights[name]
    if not hasattr(a, "shape"):
        a = np.asarray(a)
    if a.shape != shape:
        raise ValueError(f"reference: weight {name!r} has shape {a.shape}, expected {shape}")
    return _f64(a if expert is None else a[expert])


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm whose output is a bf16 activation, as the models' norms return their input dtype."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    return _bf16(y)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -z))  # 1 / (1 + e^-z) without overflow


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - np.max(z, axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


_erf = np.frompyfunc(math.erf, 1, 1)


def _gelu(z: np.ndarray) -> np.ndarray:
    # Exact (erf) GELU; math.erf is correctly rounded enough for a float64 oracle.
    return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)).astype(np.float64))


def _descending(values: np.ndarray) -> np.ndarray:
    # Stable sort of the negated values: equal values keep index order, so lower index wins.
    return np.argsort(-values, axis=-1, kind="stable")


def _gap(sorted_desc: np.ndarray, k: int) -> np.ndarray:
    """Gap between the k-th and (k+1)-th of each row's descending values (inf if no (k+1)-th)."""
    if k >= sorted_desc.shape[-1]:
        return np.full(sorted_desc.shape[0], np.inf)
    with np.errstate(invalid="ignore"):
        gap = sorted_desc[:, k - 1] - sorted_desc[:, k]
    return np.where(np.isnan(gap), np.inf, gap)  # -inf - -inf: both masked, nothing to flip


def _scored(spec: Spec) -> int:
    return spec.experts.count + spec.experts.zero_experts


# ----------------------------------------------------------------------------- router


def _logits(spec: Spec, x: np.ndarray, weights: Weights, emulate: bool) -> np.ndarray:
    h = spec.hidden_size
    if spec.router.norm is not None:
        x = _rms_norm(x, _weight(weights, "router_norm.weight", (h,)), spec.router.norm.eps)
    logits = x @ _weight(weights, "gate.weight", (_scored(spec), h)).T
    if spec.router.bias:
        logits = logits + _weight(weights, "gate.bias", (_scored(spec),))
    if emulate and spec.router.logits_dtype == "bf16":
        logits = _bf16(logits)
    return logits


def _scores(score: Score, logits: np.ndarray) -> np.ndarray:
    """The score function; softmax normalizes over the last axis, the others are elementwise."""
    if score is Score.softmax:
        return _softmax(logits)
    if score is Score.sigmoid:
        return _sigmoid(logits)
    if score is Score.sqrt_softplus:
        return np.sqrt(np.logaddexp(0.0, logits))  # DeepSeek-V4: sqrt(softplus(logit))
    raise ValueError("SparseMixer has no per-expert score; it is handled by its own rule")


def _input(x: np.ndarray, spec: Spec) -> np.ndarray:
    x = _f64(x)
    if x.ndim != 2 or x.shape[1] != spec.hidden_size:
        raise ValueError(f"reference: x must be [N, {spec.hidden_size}], got {x.shape}")
    return x


def _ids(spec: Spec, ids: np.ndarray, n: int) -> np.ndarray:
    ids = np.asarray(ids).astype(np.int64)
    if ids.shape != (n, spec.experts.top_k):
        raise ValueError(f"reference: ids must be [{n}, {spec.experts.top_k}], got {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= _scored(spec)):
        raise ValueError(f"reference: expert ids must lie in [0, {_scored(spec)})")
    return ids


# ----------------------------------------------------------------------------- selection


def _mask_groups(sel: np.ndarray, n_group: int, topk_group: int) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3 (note A): group score = sum of its top-2 values; keep topk_group groups."""
    n, scored = sel.shape
    grouped = sel.reshape(n, n_group, scored // n_group)
    top2 = -np.sort(-grouped, axis=-1)[..., :2]  # a group of one contributes its only value
    group_score = top2.sum(axis=-1)
    order = _descending(group_score)
    keep = np.zeros((n, n_group), dtype=bool)
    np.put_along_axis(keep, order[:, :topk_group], True, axis=1)
    masked = np.where(np.repeat(keep, scored // n_group, axis=1), sel, -np.inf)
    margin = _gap(np.take_along_axis(group_score, order, axis=1), topk_group)
    return masked, margin


def _select(spec: Spec, logits: np.ndarray, weights: Weights) -> tuple[np.ndarray, np.ndarray]:
    """Top-k on the selection values; returns (ids, margin)."""
    r, k = spec.routing, spec.experts.top_k
    if r.select is Select.logits:
        sel = logits
    else:
        sel = _scores(r.score, logits)
        if r.correction_bias:  # selection only: the weights below stay unbiased
            sel = sel + _weight(weights, "gate.e_score_correction_bias", (_scored(spec),))
    margin = np.full(len(sel), np.inf)
    if r.n_group > 1:
        sel, margin = _mask_groups(sel, r.n_group, r.topk_group)
    order = _descending(sel)
    ranked = np.take_along_axis(sel, order, axis=1)
    return order[:, :k], np.minimum(margin, _gap(ranked, k))


def _sparsemixer_threshold(top: np.ndarray, eps: float) -> np.ndarray:
    """The logit s at which (top - s) / max(|s|, top) == 2 eps, i.e. where masking flips."""
    return np.where(top > 0, top * (1 - 2 * eps), top / (1 - 2 * eps))


def _sparsemixer(spec: Spec, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Phi-3.5 (note C): k rounds of argmax; returns (ids, margin).

    The weights depend on the order of the picks and on which logits each round masks, so the
    margin also covers every round's order and the distance of every logit to its threshold.
    """
    k, eps = spec.experts.top_k, spec.routing.sparsemixer_eps
    order = _descending(logits)
    ranked = np.take_along_axis(logits, order, axis=1)
    margin = np.full(len(logits), np.inf)
    for j in range(1, min(k, logits.shape[1] - 1) + 1):
        margin = np.minimum(margin, _gap(ranked, j))
    for j in range(k):
        rest = ranked[:, j + 1 :]
        if rest.shape[1]:
            bound = _sparsemixer_threshold(ranked[:, j], eps)[:, None]
            margin = np.minimum(margin, np.abs(rest - bound).min(axis=1))
    return order[:, :k], margin


def _sparsemixer_weights(logits: np.ndarray, ids: np.ndarray, eps: float) -> np.ndarray:
    """Round j: its pick's logit plays the maximum; softmax over the unmasked rest."""
    rows = np.arange(len(logits))
    remaining = logits.copy()
    out = np.empty(ids.shape)
    for j in range(ids.shape[1]):
        pick = ids[:, j]
        top = logits[rows, pick][:, None]
        # As in the published code: the factor uses the ORIGINAL logits, the mask the remaining.
        factor = np.maximum(np.abs(logits), top)
        with np.errstate(invalid="ignore", divide="ignore"):
            drop = (top - logits) / factor > 2 * eps
        out[:, j] = _softmax(np.where(drop, -np.inf, remaining))[rows, pick]
        remaining[rows, pick] = -np.inf
    return out


def _hash_ids(spec: Spec, weights: Weights, token_ids: np.ndarray | None, n: int) -> np.ndarray:
    if token_ids is None:
        raise ValueError("reference: hash routing (routing.hash_vocab_size) needs token_ids")
    vocab, k = spec.routing.hash_vocab_size, spec.experts.top_k
    table = np.asarray(weights["tid2eid"]).astype(np.int64)
    if table.shape != (vocab, k):
        raise ValueError(f"reference: tid2eid has shape {table.shape}, expected {(vocab, k)}")
    tok = np.asarray(token_ids).astype(np.int64)
    if tok.shape != (n,):
        raise ValueError(f"reference: token_ids must be [{n}] ints")
    # The documented rule for ids outside [0, vocab): clamped to the nearest row, as the kernels do.
    return _ids(spec, table[np.clip(tok, 0, vocab - 1)], n)


def _weights_for(spec: Spec, logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    r = spec.routing
    if r.score is Score.sparsemixer:
        w = _sparsemixer_weights(logits, ids, r.sparsemixer_eps)
    elif r.select is Select.logits and r.hash_vocab_size is None:
        # GPT-OSS / Llama-4: the score function over the chosen k logits only.
        w = _scores(r.score, np.take_along_axis(logits, ids, axis=1))
    else:
        # Scores over all experts, gathered: the UNBIASED values (correction bias never enters).
        w = np.take_along_axis(_scores(r.score, logits), ids, axis=1)
    if r.renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return w * r.routed_scaling_factor


# ----------------------------------------------------------------------------- public routing


def router_logits(spec: Spec, x: np.ndarray, weights: Weights) -> np.ndarray:
    """[N, E+Z] float64 logits (after router norm and bias; bf16-rounded if the spec says so)."""
    return _logits(spec, _input(x, spec), weights, emulate=True)


def route(
    spec: Spec,
    x: np.ndarray,
    weights: Weights,
    token_ids: np.ndarray | None = None,
    logits_dtype_emulation: bool = True,
) -> Routing:
    """The experts, weights and tie margin of every token (see the module docstring for ties).

    logits_dtype_emulation=False skips the bf16 rounding of the logits (to study its effect).
    """
    x = _input(x, spec)
    logits = _logits(spec, x, weights, logits_dtype_emulation)
    if spec.routing.hash_vocab_size is not None:
        ids = _hash_ids(spec, weights, token_ids, len(x))
        margin = np.full(len(x), np.inf)  # a table lookup has no near-tie
    elif spec.routing.score is Score.sparsemixer:
        ids, margin = _sparsemixer(spec, logits)
    else:
        ids, margin = _select(spec, logits, weights)
    return Routing(ids=ids, weights=_weights_for(spec, logits, ids), margin=margin)


def routing_weights_for(
    spec: Spec,
    x: np.ndarray,
    weights: Weights,
    ids: np.ndarray,
    token_ids: np.ndarray | None = None,
) -> np.ndarray:
    """[N, k] weights the published rule gives to the GIVEN experts (e.g. the kernel's choice).

    The order of `ids` matters only for SparseMixer (round j picks ids[:, j]). token_ids is
    accepted for symmetry with route(); given the ids, hash-routed weights do not depend on it.
    """
    x = _input(x, spec)
    return _weights_for(spec, _logits(spec, x, weights, True), _ids(spec, ids, len(x)))


# ----------------------------------------------------------------------------- experts


def _activate(
    kind: ActivationKind, g: np.ndarray, u: np.ndarray, limit: float | None, alpha: float | None
) -> np.ndarray:
    if limit is not None:  # DeepSeek-V4 / GPT-OSS: gate clamped from above, up both ways
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    if kind is ActivationKind.swiglu_clamped:  # GPT-OSS note B
        return (u + 1.0) * g * _sigmoid(alpha * g)
    if kind is ActivationKind.gelu_gated:
        return _gelu(g) * u
    return g * _sigmoid(g) * u  # silu_gated


def _fp8_quant(a: np.ndarray) -> np.ndarray:
    """Dynamic per-token, per-128-channel e4m3 quantization (MODELS.md format a), dequantized."""
    n, c = a.shape
    blocks = np.pad(a, ((0, 0), (0, -c % 128))).reshape(n, -1, 128)
    scale = np.maximum(np.abs(blocks).max(axis=-1, keepdims=True), 1e-4) / 448.0
    scale = scale.astype(np.float32)  # the scale is an fp32 value
    # x / s in fp32 (the inputs are bf16 values), then rounded to e4m3, as the kernels and
    # DeepSeek's act_quant do: a quotient rounded from float64 straight to e4m3 differs where
    # the fp32 rounding crosses an e4m3 midpoint (ml_dtypes 0.7 casts float64 directly)
    q = (blocks.astype(np.float32) / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (q * scale.astype(np.float64)).reshape(n, -1)[:, :c]


def _static_fp8(x: np.ndarray, weights: Weights, name: str, shape: tuple[int, ...], e: int | None) -> np.ndarray:
    """Format d's input quantization by matrix `name`'s static input scale, dequantized."""
    s = np.float32(_weight(weights, f"{name}_input_scale", shape, e))
    q = np.clip(x.astype(np.float32) / s, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float64) * np.float64(s)


def _gate_up(x: np.ndarray, weights: Weights, prefix: str, e: int | None, dims: tuple[int, ...], inter: int, h: int,
             fp8_tensor: bool) -> tuple[np.ndarray, np.ndarray]:
    """Gate and up projections of expert e (stacked: lead dims `dims`) or of the shared expert (e None)."""
    xs = {p: _static_fp8(x, weights, f"{prefix}.{p}", dims, e) if fp8_tensor else x for p in ("gate_proj", "up_proj")}
    g = xs["gate_proj"] @ _weight(weights, f"{prefix}.gate_proj", (*dims, inter, h), e).T
    u = xs["up_proj"] @ _weight(weights, f"{prefix}.up_proj", (*dims, inter, h), e).T
    return g, u


def expert_activation(spec: Spec, weights: Weights, e: int, x: np.ndarray) -> np.ndarray:
    """Routed expert e's activation of input rows x (float64: what its down projection is handed,
    before any quantization of it)."""
    ex = spec.experts
    E, I, H = ex.count, ex.intermediate_size, spec.hidden_size
    act = ex.activation
    if ex.fp8_activations:
        x = _fp8_quant(x)
    g, u = _gate_up(x, weights, "experts", e, (E,), I, H, ex.format.value == "fp8_tensor")
    if ex.bias:
        g = g + _weight(weights, "experts.gate_proj_bias", (E, I), e)
        u = u + _weight(weights, "experts.up_proj_bias", (E, I), e)
    return _activate(act.kind, g, u, act.limit, act.alpha)


def expert_down(spec: Spec, weights: Weights, e: int, h: np.ndarray) -> np.ndarray:
    """Routed expert e's down projection of activations h (its input quantized as the format says)."""
    ex = spec.experts
    E, I, H = ex.count, ex.intermediate_size, spec.hidden_size
    if ex.fp8_activations:
        h = _fp8_quant(_bf16(h))
    if ex.format.value == "fp8_tensor":
        h = _static_fp8(_bf16(h), weights, "experts.down_proj", (E,), e)
    y = h @ _weight(weights, "experts.down_proj", (E, H, I), e).T
    if ex.bias:
        y = y + _weight(weights, "experts.down_proj_bias", (E, H), e)
    return y


def _expert(spec: Spec, weights: Weights, e: int, x: np.ndarray) -> np.ndarray:
    return expert_down(spec, weights, e, expert_activation(spec, weights, e, x))


# Experts computed at once by the routed sum (threads: NumPy releases the GIL in its array work;
# a large quantized layer dequantizes one expert per thread). The sum itself runs in expert order.
THREADS = min(8, os.cpu_count() or 1)


def _routed(spec: Spec, x: np.ndarray, weights: Weights, ids: np.ndarray, rw: np.ndarray,
            threads: int | None = None, h: np.ndarray | None = None) -> np.ndarray:
    """The weighted sum of the chosen experts' outputs; with h ([N, k, I]), each (token, choice)'s
    down projection takes h[token, choice] as its activation instead of computing it."""
    def one(e: int) -> tuple[np.ndarray, np.ndarray]:
        rows, slots = np.nonzero(ids == e)  # a token may list an expert twice (hash tables)
        w = rw[rows, slots][:, None]
        if e >= spec.experts.count:
            return rows, w * x[rows]  # zero (identity) expert: no GEMM
        if h is not None:
            y = expert_down(spec, weights, e, h[rows, slots])
            return rows, y if spec.routing.weight_on_input else w * y
        if spec.routing.weight_on_input:
            return rows, _expert(spec, weights, e, w * x[rows])  # Llama-4: not multiplied again
        return rows, w * _expert(spec, weights, e, x[rows])

    out = np.zeros_like(x)
    experts = [int(e) for e in np.unique(ids)]
    with ThreadPoolExecutor(max_workers=max(1, threads or THREADS)) as pool:
        for rows, y in pool.map(one, experts):  # in expert order, whatever finishes first
            np.add.at(out, rows, y)
    return out


def shared_activation(spec: Spec, x: np.ndarray, weights: Weights) -> np.ndarray:
    """The shared expert's activation of input rows x (float64, before any quantization of it)."""
    s, act, H = spec.shared_expert, spec.experts.activation, spec.hidden_size
    a8 = spec.experts.fp8_activations and s.format.value == "fp8_block"
    g, u = _gate_up(_fp8_quant(x) if a8 else x, weights, "shared_expert", None, (), s.intermediate_size, H,
                    s.format.value == "fp8_tensor")
    return _activate(act.kind, g, u, act.limit if s.clamp else None, act.alpha)


def _shared(spec: Spec, x: np.ndarray, weights: Weights, h: np.ndarray | None = None) -> np.ndarray:
    """The shared expert's output for input rows x; with h, from those activations."""
    s, H = spec.shared_expert, spec.hidden_size
    if h is None:
        h = shared_activation(spec, x, weights)
    if spec.experts.fp8_activations and s.format.value == "fp8_block":
        h = _fp8_quant(_bf16(h))
    if s.format.value == "fp8_tensor":
        h = _static_fp8(_bf16(h), weights, "shared_expert.down_proj", (), None)
    y = h @ _weight(weights, "shared_expert.down_proj", (H, s.intermediate_size)).T
    if s.gate == "sigmoid":  # Qwen: sigmoid(Linear h -> 1, no bias) scales the shared output
        y = y * _sigmoid(x @ _weight(weights, "shared_expert_gate.weight", (1, H)).T)
    return y


def _expert_input(spec: Spec, x: np.ndarray, weights: Weights) -> np.ndarray:
    """The experts' input: x, or pre_expert_norm(x) (the router sees raw x, or its own norm)."""
    if spec.pre_expert_norm is None:
        return x
    return _rms_norm(x, _weight(weights, "pre_expert_norm.weight", (spec.hidden_size,)), spec.pre_expert_norm.eps)


def moe_forward(
    spec: Spec,
    x: np.ndarray,
    weights: Weights,
    token_ids: np.ndarray | None = None,
    ids: np.ndarray | None = None,
) -> np.ndarray:
    """[N, H] float64 output of the whole MoE block; with `ids`, route to those experts."""
    x = _input(x, spec)
    if ids is None:
        r = route(spec, x, weights, token_ids)
        ids, rw = r.ids, r.weights
    else:
        ids = _ids(spec, ids, len(x))
        rw = routing_weights_for(spec, x, weights, ids, token_ids)
    xe = _expert_input(spec, x, weights)
    out = _routed(spec, xe, weights, ids, rw)
    if spec.shared_expert is not None:
        out = out + _shared(spec, xe, weights)
    return out


def moe_forward_from_activations(
    spec: Spec,
    x: np.ndarray,
    weights: Weights,
    ids: np.ndarray,
    h: np.ndarray,
    h_shared: np.ndarray | None = None,
    token_ids: np.ndarray | None = None,
) -> np.ndarray:
    """moe_forward routed to `ids`, with each down projection handed given activations: h [N, k, I]
    per (token, choice), h_shared [N, I_shared]; the routing weights and everything after the
    activations as moe_forward computes them."""
    x = _input(x, spec)
    ids = _ids(spec, ids, len(x))
    rw = routing_weights_for(spec, x, weights, ids, token_ids)
    xe = _expert_input(spec, x, weights)
    out = _routed(spec, xe, weights, ids, rw, h=np.asarray(h, np.float64))
    if spec.shared_expert is not None:
        out = out + _shared(spec, xe, weights, None if h_shared is None else np.asarray(h_shared, np.float64))
    return out
