"""PyTorch baselines for `moegen bench --compare`, on the same weights and inputs as the layer.

Two ways people run an MoE layer without moegen, both with routing in PyTorch (softmax routing,
the rule the generated BF16 catalog uses):
- a loop over the hit experts, as the transformers modeling code does;
- torch._grouped_mm over tokens sorted by expert (one grouped GEMM for gate/up, one for down).
They are timed eagerly (their shapes depend on the routing, so they do not capture into a graph)
with CUDA events, the median of many runs, rotating over the same distinct-weight layers.
"""

from __future__ import annotations

from typing import Any

from .plan import Plan
from .spec import Select, Spec

REPEATS = 30


def _route(spec: Spec, x: Any, router: Any) -> tuple[Any, Any]:
    logits = x.float() @ router.float().t()
    k = spec.experts.top_k
    if spec.routing.select is Select.logits:
        top, ids = logits.topk(k, dim=-1)
        w = top.softmax(dim=-1)
    else:
        probs = logits.softmax(dim=-1)
        w, ids = probs.topk(k, dim=-1)
        if spec.routing.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
    return ids, w * spec.routing.routed_scaling_factor


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
    """transformers-style: for each hit expert, gather its tokens, run its MLP, add weighted."""
    f = torch.nn.functional
    ids, w = _route(spec, x, wts["gate.weight"])
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        h = f.silu(xe @ wts["experts.gate_proj"][e].t()) * (xe @ wts["experts.up_proj"][e].t())
        y = h @ wts["experts.down_proj"][e].t()
        out.index_add_(0, tok, y.float() * w[tok, slot, None])
    return (out + _shared(x, wts, torch)).to(x.dtype)


def grouped_mm(spec: Spec, x: Any, wts: dict[str, Any], torch: Any) -> Any:
    """Tokens sorted by expert, then torch._grouped_mm for gate/up and for down."""
    f = torch.nn.functional
    e_count, k = spec.experts.count, spec.experts.top_k
    ids, w = _route(spec, x, wts["gate.weight"])
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


def prepare(wts: dict[str, Any], torch: Any) -> dict[str, Any]:
    """The grouped GEMM's operand layouts, made once outside the timing."""
    out = dict(wts)
    out["_w13_t"] = torch.cat([wts["experts.gate_proj"], wts["experts.up_proj"]], dim=1).transpose(1, 2).contiguous()
    out["_w2_t"] = wts["experts.down_proj"].transpose(1, 2).contiguous()
    return out


def time_baselines(spec: Spec, plan: Plan, layer_weights: list[dict[str, Any]], xs: list[Any], timer: Any) -> dict[str, float]:
    """Median microseconds per layer of each baseline, rotating over the distinct-weight layers,
    timed as moegen's layers are (timer: moegen.bench's, its stream and its hold)."""
    import torch

    prepared = [prepare(w, torch) for w in layer_weights]
    results: dict[str, float] = {}
    with torch.cuda.stream(torch.cuda.ExternalStream(int(timer.stream))):
        for name, fn in (("torch_loop", loop_over_experts), ("torch_grouped_mm", grouped_mm)):
            def call(fn: Any = fn) -> None:
                for w, x in zip(prepared, xs):
                    fn(spec, x, w, torch)

            try:
                call()  # warm-up (and the grouped GEMM's availability)
            except (RuntimeError, AttributeError) as exc:  # e.g. torch._grouped_mm missing on this build
                results[name] = float("nan")
                print(f"  {name}: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
                continue
            results[name] = timer.median_ms(call, REPEATS) * 1e3 / len(xs)
    return results
