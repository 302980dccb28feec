"""Spec YAML as specs/*.yaml spell it: a comment line naming the model and its routing, then the
fields (required ones, the routing rule, and whatever differs from the schema's defaults)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel

from .spec import Spec

if TYPE_CHECKING:
    from .hf import Cfg, Family


# The routing rule is always written out, defaults or not: it is what a reader checks first.
_ALWAYS = {"router.logits_dtype", "routing.score", "routing.select", "routing.renormalize", "shared_expert.gate"}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return getattr(value, "value", value)  # enums as their YAML spelling


def _trim(model: BaseModel, always: set[str], prefix: str = "") -> dict[str, Any]:
    """Required fields, `always`, and whatever differs from the schema default, in field order."""
    out: dict[str, Any] = {}
    for fname, field in type(model).model_fields.items():
        value, dotted = getattr(model, fname), prefix + fname
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        if isinstance(value, BaseModel):
            sub = _trim(value, always, dotted + ".")
            if sub or default is None:
                out[fname] = sub
        elif field.is_required() or dotted in always or value != default:
            out[fname] = _plain(value)
    return out


def _display(model_id: str) -> str:
    base = model_id.rsplit("/", 1)[-1]
    base = re.sub(r"(-(Instruct|Chat|Base))+$", "", base, flags=re.IGNORECASE)
    return re.sub(r"-v\d+(\.\d+)*$", "", base)


def _summary(s: Spec, c: Cfg, scaled: bool) -> str:
    e, r, k = s.experts, s.routing, s.experts.top_k
    head = f"{e.count} experts" + (f" + {e.zero_experts} zero (identity) experts" if e.zero_experts else "")
    score = {"sqrt_softplus": "sqrt(softplus)", "sparsemixer": "SparseMixer"}.get(r.score.value, r.score.value)
    if r.hash_vocab_size:
        route = f"hash routing (tid2eid) -> {score} weights"
    elif r.score.value == "sparsemixer":
        route = f"SparseMixer top-{k}"
    elif r.select.value == "logits":
        route = f"top-{k} on logits -> {score}" + (", times the expert input" if r.weight_on_input else "")
    else:
        route = score + (" + correction bias" if r.correction_bias else "")
        route += f" -> best {r.topk_group} of {r.n_group} groups" if r.n_group > 1 else ""
        route += f" -> {'greedy ' if c.get('topk_method', None) == 'greedy' else ''}top-{k}"
    if r.select.value == "scores" and r.score.value != "sparsemixer":
        route += " -> renormalize" if r.renormalize else ", no renorm"
    route += f", scale {r.routed_scaling_factor}" if scaled else ""
    return f"{head}, {route}"


def _extras(s: Spec, c: Cfg) -> str:
    out, a = [], s.experts.activation
    if a.kind.value == "swiglu_clamped":
        out.append(f"clamped SwiGLU (alpha {a.alpha}, limit {a.limit})")
    elif a.limit is not None:
        out.append(f"SiLU clamped at {a.limit}")
    if s.experts.bias:
        out.append("expert biases")
    if s.experts.format.value != "bf16":
        out.append(f"{s.experts.format.value} experts")
    sh = s.shared_expert
    if sh is not None and sh.gate == "sigmoid":
        out.append(f"shared MLP {sh.intermediate_size} times a sigmoid gate")
    elif sh is not None:
        n = c.get("n_shared_experts", 1)
        out.append(f"{n} shared experts as one ungated MLP {sh.intermediate_size}" if n > 1
                   else f"shared MLP {sh.intermediate_size}, ungated")
    if sh is not None and a.limit is not None:  # the routed experts are clamped: say whether this one is
        out[-1] += ", clamped too" if sh.clamp else ", not clamped"
    return "".join(f"; {x}" for x in out)


def to_yaml(spec: Spec, fam: Family, c: Cfg, minimal: bool = False) -> str:
    """The spec file: one comment line naming the model and its routing, then the fields."""
    always = set() if minimal else _ALWAYS | ({"routing.routed_scaling_factor"} if fam.scaled else set())
    summary = fam.summary(spec) if fam.summary else _summary(spec, c, fam.scaled)
    head = f"# {_display(spec.model)} ({spec.model}): {summary}{_extras(spec, c)}.\n"
    return head + yaml.safe_dump(_trim(spec, always), sort_keys=False, default_flow_style=False)
