"""PyTorch baselines for `moegen bench --compare`, on the same weights and inputs as the layer.

Two ways people run an MoE layer without moegen, both with routing in PyTorch (softmax, or
DeepSeek-V3's sigmoid with the correction bias and group-limited top-k, MODELS.md note A):
- a loop over the hit experts, as the transformers modeling code does;
- torch._grouped_mm over tokens sorted by expert (one grouped GEMM for gate/up, one for down).
They are timed eagerly (their shapes depend on the routing, so they do not capture into a graph)
with CUDA events, the median of many runs, rotating over the same distinct-weight layers.

FP8 block weights (format a): PyTorch has no grouped GEMM scaled per 128x128 block, so `prepare`
dequantizes the e4m3 codes times their block scales to BF16 once, outside the timing, and the
baselines run the same BF16 ops (their time is a BF16 layer's, reading twice the bytes). They take
BF16 activations also where the spec quantizes its GEMM inputs to FP8 (experts.fp8_activations).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .formats import FP8_BLOCK
from .plan import Plan
from .spec import Score, Select, Spec

REPEATS = 30
DEQUANT_CHUNK = 1 << 26  # weights dequantized at once: bounds the fp32 temporaries beside the layers


def unsupported(spec: Spec) -> list[str]:
    """What the spec asks for that the baselines do not compute (empty: they run it). Each is
    refused by name rather than timed as some other layer."""
    ex, r, sh = spec.experts, spec.routing, spec.shared_expert
    why = []
    if ex.format.value not in ("bf16", "fp8_block"):
        why.append(f"experts.format={ex.format.value} (the baselines take BF16 or FP8 block weights)")
    if sh and sh.format.value not in ("bf16", "fp8_block"):
        why.append(f"shared_expert.format={sh.format.value}")
    if spec.parallel.ep_size > 1:
        why.append("expert parallelism (parallel.ep_size > 1)")
    if r.hash_vocab_size is not None:
        why.append("hash routing (routing.hash_vocab_size)")
    elif r.select is Select.logits and r.score is not Score.softmax:
        why.append(f"routing.score={r.score.value} with routing.select=logits")
    elif r.score not in (Score.softmax, Score.sigmoid):
        why.append(f"routing.score={r.score.value}")
    if r.weight_on_input:
        why.append("routing.weight_on_input")
    if ex.zero_experts:
        why.append("zero experts (experts.zero_experts)")
    if spec.router.bias:
        why.append("router.bias")
    if spec.router.norm is not None:
        why.append("router.norm")
    if spec.router.logits_dtype != "fp32":
        why.append(f"router.logits_dtype={spec.router.logits_dtype}")
    if spec.pre_expert_norm is not None:
        why.append("pre_expert_norm")
    if ex.bias:
        why.append("expert biases (experts.bias)")
    if ex.activation.kind.value != "silu_gated" or ex.activation.limit is not None:
        why.append(f"experts.activation={ex.activation.kind.value}"
                   + (f" limit {ex.activation.limit}" if ex.activation.limit is not None else ""))
    return why


def describe(spec: Spec) -> str:
    """What the baselines run, said next to their times: which weights, which activations."""
    fp8 = spec.experts.format.value == "fp8_block" or (spec.shared_expert and spec.shared_expert.format.value == "fp8_block")
    if not fp8:
        return "torch baselines on the BF16 weights"
    note = ("torch baselines on the FP8 block weights dequantized to BF16 once, outside the timing "
            "(PyTorch has no 128x128-block-scaled grouped GEMM)")
    if spec.experts.fp8_activations:
        note += "; on BF16 activations, where the layer quantizes its GEMM inputs to FP8"
    return note


def _route(spec: Spec, x: Any, wts: dict[str, Any], torch: Any) -> tuple[Any, Any]:
    """moegen.reference's rules in fp32: softmax, or sigmoid; the correction bias for selection
    only; DeepSeek-V3's groups (score = sum of a group's top-2 biased values, the best topk_group
    kept, the rest masked); the weights the unbiased scores of the chosen experts."""
    logits = x.float() @ wts["gate.weight"].float().t()
    r, k = spec.routing, spec.experts.top_k
    if r.select is Select.logits:
        top, ids = logits.topk(k, dim=-1)
        return ids, top.softmax(dim=-1) * r.routed_scaling_factor
    scores = logits.softmax(dim=-1) if r.score is Score.softmax else logits.sigmoid()
    sel = scores + wts["gate.e_score_correction_bias"] if r.correction_bias else scores
    if r.n_group > 1:
        grouped = sel.view(len(sel), r.n_group, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(r.topk_group, dim=-1).indices, True)
        sel = sel.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    if sel is scores:  # plain softmax/sigmoid: the selected values are the weights
        w, ids = sel.topk(k, dim=-1)
    else:
        ids = sel.topk(k, dim=-1).indices
        w = scores.gather(1, ids)
    if r.renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w * r.routed_scaling_factor


def _shared(x: Any, wts: dict[str, Any], torch: Any) -> Any:
    if "shared_expert.gate_proj" not in wts:
        return 0
    f = torch.nn.functional
    h = f.silu(x @ wts["shared_expert.gate_proj"].t()) * (x @ wts["shared_expert.up_proj"].t())
    y = h @ wts["shared_expert.down_proj"].t()
    if "shared_expert_gate.weight" in wts:
        y = y * torch.sigmoid(x @ wts["shared_expert_gate.weight"].t())
    return y


def loop_over_experts(spec: Spec, x: Any, wts: dict[str, Any], torch: Any) -> Any:
    """transformers-style: for each hit expert, gather its tokens, run its MLP, add weighted.
    wts: as `prepare` returns them (BF16 weights without a correction bias may be given as they are)."""
    f = torch.nn.functional
    ids, w = _route(spec, x, wts, torch)
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        h = f.silu(xe @ wts["experts.gate_proj"][e].t()) * (xe @ wts["experts.up_proj"][e].t())
        y = h @ wts["experts.down_proj"][e].t()
        out.index_add_(0, tok, y.float() * w[tok, slot, None])
    return (out + _shared(x, wts, torch)).to(x.dtype)


def grouped_mm(spec: Spec, x: Any, wts: dict[str, Any], torch: Any) -> Any:
    """Tokens sorted by expert, then torch._grouped_mm for gate/up and for down (wts: `prepare`'s)."""
    f = torch.nn.functional
    e_count, k = spec.experts.count, spec.experts.top_k
    ids, w = _route(spec, x, wts, torch)
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=e_count)
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // k]
    w13 = wts["_w13_t"]  # [E, H, 2I]
    h = torch._grouped_mm(xs, w13, offs=offs)
    i = spec.experts.intermediate_size
    act = f.silu(h[:, :i]) * h[:, i:]
    y = torch._grouped_mm(act, wts["_w2_t"], offs=offs)  # [N*k, H]
    out = torch.zeros_like(x, dtype=torch.float32)
    out.index_add_(0, order // k, y.float() * w.reshape(-1)[order, None])
    return (out + _shared(x, wts, torch)).to(x.dtype)


def _device(wts: dict[str, Any], torch: Any) -> Any:
    """Where the layer's tensors are (moegen bench makes the BF16 ones on the GPU, FP8 codes on the host)."""
    for a in wts.values():
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tensor(a: Any, device: Any, torch: Any) -> Any:
    """A weight as a torch tensor on `device`, at its own address (moegen bench gives every layer
    the same random weights, whose copies must not share L2 lines): torch tensors copied; NumPy
    arrays (ml_dtypes' e4m3 and bfloat16 included, which torch.from_numpy does not read) through
    their bytes."""
    if isinstance(a, torch.Tensor):
        return a.to(device, copy=True)
    a = np.ascontiguousarray(a)
    if a.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return torch.from_numpy(a.view(np.uint8)).to(device).view(torch.float8_e4m3fn)
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16)
    return torch.from_numpy(a).to(device)


def _dequantize_into(out: Any, q: Any, s: Any, torch: Any) -> None:
    """out[..., i, j] = q[..., i, j] * s[..., i // 128, j // 128] (format a), a few matrices at a
    time: the codes travel to the device and widen there, never a whole layer's fp32 at once."""
    r, c = out.shape[-2:]
    dst = out if out.dim() == 3 else out.unsqueeze(0)
    q = q.reshape(-1, r, c)
    s = s.reshape(-1, *s.shape[-2:])
    step = max(1, DEQUANT_CHUNK // (r * c))
    for a in range(0, len(dst), step):
        qa = _tensor(q[a:a + step], out.device, torch).float()
        sa = _tensor(s[a:a + step], out.device, torch).float()
        sa = sa.repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)[:, :r, :c]
        dst[a:a + step] = (qa * sa).to(out.dtype)  # q * s in fp32 (to 2^-24), then out's dtype


def prepare(wts: dict[str, Any], torch: Any, dtype: Any = None) -> dict[str, Any]:
    """The baselines' operands, made once outside the timing: host arrays as device tensors; FP8
    block weights (`<name>` e4m3 codes with `<name>_scale_inv`) dequantized to `dtype` (BF16;
    the tests take float32 to see the dequantization exactly); the grouped GEMM's [E, H, 2I] and
    [E, I, H] operands. BF16 experts are copied into them, as before; dequantized experts are
    written once as [E, 2I, H] (gate rows, then up rows) and [E, H, I], which the loop reads per
    expert and the grouped GEMM transposed (views, as torchtitan hands them): the BF16 copy of a
    DeepSeek-V3 layer is 22.5 GB, two would not fit beside moegen's layers."""
    device = _device(wts, torch)
    dtype = dtype or torch.bfloat16
    out = {name: _tensor(a, device, torch) for name, a in wts.items()
           if not name.endswith("_scale_inv") and f"{name}_scale_inv" not in wts}

    def dequantized(name: str, target: Any = None) -> Any:
        q = wts[name]
        target = torch.empty(tuple(q.shape), dtype=dtype, device=device) if target is None else target
        _dequantize_into(target, q, wts[f"{name}_scale_inv"], torch)
        return target

    for name in ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"):
        if f"{name}_scale_inv" in wts:
            out[name] = dequantized(name)
    if "experts.gate_proj_scale_inv" in wts:
        e, i, h = wts["experts.gate_proj"].shape
        w13 = torch.empty((e, 2 * i, h), dtype=dtype, device=device)
        out["experts.gate_proj"] = dequantized("experts.gate_proj", w13[:, :i])
        out["experts.up_proj"] = dequantized("experts.up_proj", w13[:, i:])
        out["experts.down_proj"] = dequantized("experts.down_proj")
        out["_w13_t"] = w13.transpose(1, 2)
        out["_w2_t"] = out["experts.down_proj"].transpose(1, 2)
        return out
    out["_w13_t"] = torch.cat([out["experts.gate_proj"], out["experts.up_proj"]], dim=1).transpose(1, 2).contiguous()
    out["_w2_t"] = out["experts.down_proj"].transpose(1, 2).contiguous()
    return out


def prepare_layers(spec: Spec, layer_weights: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every layer's `prepare`d weights, made once for all token counts. Where they would not fit
    in half the device memory left beside moegen's layers (an FP8 layer's BF16 copy is twice its
    size), only the first layers that do, at least one: the rotation then revisits them, each far
    larger than L2. Empty, said on stdout, where not even one fits."""
    import torch

    print(f"--compare: {describe(spec)}")
    torch.cuda.empty_cache()  # bench's random-weight temporaries, cached: free for the copies
    free = torch.cuda.mem_get_info()[0]
    before = torch.cuda.memory_allocated()
    try:
        out = [prepare(layer_weights[0], torch)]
        per = torch.cuda.memory_allocated() - before
        keep = len(layer_weights) if per <= 0 else max(1, min(len(layer_weights), int(0.5 * free / per)))
        out += [prepare(w, torch) for w in layer_weights[1:keep]]
    except torch.cuda.OutOfMemoryError:
        print("--compare: the baselines' weights do not fit on the device beside moegen's layers; skipped")
        return []
    if keep < len(layer_weights):
        print(f"--compare: the baselines rotate over the first {keep} of the {len(layer_weights)} distinct-weight "
              f"layers ({per / 1e9:.1f} GB each on the device)")
    return out


def time_baselines(spec: Spec, plan: Plan, layer_weights: list[dict[str, Any]], xs: list[Any], timer: Any,
                   prepared: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Median microseconds per layer of each baseline, rotating over the distinct-weight layers,
    timed as moegen's layers are (timer: moegen.bench's, its stream and its hold). prepared:
    prepare_layers(spec, layer_weights), made by the caller once for all its token counts."""
    import torch

    if prepared is None:
        prepared = prepare_layers(spec, layer_weights)
    if not prepared:
        return {}
    results: dict[str, float] = {}
    with torch.cuda.stream(torch.cuda.ExternalStream(int(timer.stream))):
        for name, fn in (("torch_loop", loop_over_experts), ("torch_grouped_mm", grouped_mm)):
            def call(fn: Any = fn) -> None:
                for j, x in enumerate(xs):
                    fn(spec, x, prepared[j % len(prepared)], torch)

            try:
                call()  # warm-up (and the grouped GEMM's availability)
            except (RuntimeError, AttributeError) as exc:  # e.g. torch._grouped_mm missing on this build
                results[name] = float("nan")
                print(f"  {name}: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
                continue
            results[name] = timer.median_ms(call, REPEATS) * 1e3 / len(xs)
    return results
