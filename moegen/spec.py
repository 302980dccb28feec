"""The spec: what a model's MoE block is, validated once, frozen.

One pydantic tree covers the whole feature set of the catalog (routing rules, activations,
weight formats, parallelism). Fields the generator cannot produce yet are still part of the
schema, so a spec that asks for them is refused by name ("<field>=<value> is not generated
yet") instead of being silently computed wrong.
"""

from __future__ import annotations

import hashlib
import json
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class SpecError(ValueError):
    """A spec file that cannot be used; the message names the file and the field."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WeightFormat(str, Enum):
    bf16 = "bf16"
    fp8_tensor = "fp8_tensor"  # e4m3, one fp32 scale per tensor, static input scale
    fp8_block = "fp8_block"  # e4m3, fp32 scale per 128x128 block (DeepSeek-V3 style)
    nvfp4 = "nvfp4"  # e2m1, e4m3 scale per 16 along K, fp32 scale_2
    mxfp4 = "mxfp4"  # e2m1, e8m0 scale per 32 along K
    int4_group = "int4_group"


class Score(str, Enum):
    softmax = "softmax"
    sigmoid = "sigmoid"
    sqrt_softplus = "sqrt_softplus"
    sparsemixer = "sparsemixer"


class Select(str, Enum):
    scores = "scores"  # top-k ranks score(logits) (+ correction bias); weights are the scores
    logits = "logits"  # top-k ranks raw logits; weights = score function over the chosen k


class ActivationKind(str, Enum):
    silu_gated = "silu_gated"
    gelu_gated = "gelu_gated"
    swiglu_clamped = "swiglu_clamped"  # GPT-OSS: (up + 1) * gate * sigmoid(alpha * gate)


Positive = Annotated[int, Field(gt=0)]


class RMSNorm(_Frozen):
    eps: Annotated[float, Field(gt=0)] = 1e-6


class Activation(_Frozen):
    kind: ActivationKind = ActivationKind.silu_gated
    limit: Annotated[float, Field(gt=0)] | None = None  # clamp applied to gate (and up)
    alpha: Annotated[float, Field(gt=0)] | None = None  # swiglu_clamped only
    interleaved_gate_up: bool = False  # checkpoint stores gate/up rows interleaved


class Experts(_Frozen):
    count: Positive
    top_k: Positive
    intermediate_size: Positive
    zero_experts: Annotated[int, Field(ge=0)] = 0
    activation: Activation = Activation()
    bias: bool = False
    format: WeightFormat = WeightFormat.bf16
    fp8_activations: bool = False  # fp8_block: quantize activations per token per 128 channels


class SharedExpert(_Frozen):
    intermediate_size: Positive  # the shared experts fused into one MLP of this width
    gate: Literal["none", "sigmoid"] = "none"  # sigmoid(Linear h -> 1) times the shared output
    clamp: bool = False  # apply the routed experts' activation limit too
    format: WeightFormat = WeightFormat.bf16


class Router(_Frozen):
    bias: bool = False
    logits_dtype: Literal["fp32", "bf16"] = "fp32"
    norm: RMSNorm | None = None  # RMSNorm applied to x before the router
    format: WeightFormat = WeightFormat.bf16


class Routing(_Frozen):
    score: Score = Score.softmax
    select: Select = Select.scores
    renormalize: bool = False
    routed_scaling_factor: Annotated[float, Field(gt=0)] = 1.0
    correction_bias: bool = False  # added to scores for selection only
    n_group: Positive = 1
    topk_group: Positive = 1
    hash_vocab_size: Positive | None = None  # hash routing through tid2eid [vocab, k]
    weight_on_input: bool = False  # Llama-4: the routing weight scales the expert input
    sparsemixer_eps: Annotated[float, Field(gt=0)] = 0.01


class Parallel(_Frozen):
    ep_size: Positive = 1
    ep_rank: Annotated[int, Field(ge=0)] = 0


class Spec(_Frozen):
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")]
    model: str  # the published model this layer comes from
    arch: Literal["sm_90a"] = "sm_90a"
    hidden_size: Positive
    experts: Experts
    shared_expert: SharedExpert | None = None
    router: Router = Router()
    routing: Routing = Routing()
    pre_expert_norm: RMSNorm | None = None
    parallel: Parallel = Parallel()
    max_tokens: Annotated[int, Field(gt=0, le=65536)] = 256
    buckets: tuple[Positive, ...] | None = None  # upper token counts of the buckets
    batch_invariant: bool = False  # one reduction order for every N: no fused small-batch buckets

    @model_validator(mode="after")
    def _consistent(self) -> Spec:
        e, r = self.experts, self.routing
        scored = e.count + e.zero_experts
        if e.top_k > scored:
            raise ValueError(f"experts.top_k={e.top_k} exceeds the {scored} experts the router scores")
        if scored % r.n_group:
            raise ValueError(f"routing.n_group={r.n_group} does not divide the {scored} scored experts")
        if r.topk_group > r.n_group:
            raise ValueError(f"routing.topk_group={r.topk_group} exceeds routing.n_group={r.n_group}")
        if r.n_group > 1 and r.topk_group * (scored // r.n_group) < e.top_k:
            raise ValueError("routing.topk_group groups hold fewer experts than experts.top_k")
        if r.correction_bias and r.select is not Select.scores:
            raise ValueError("routing.correction_bias needs routing.select=scores")
        if self.parallel.ep_rank >= self.parallel.ep_size:
            raise ValueError(
                f"parallel.ep_rank={self.parallel.ep_rank} must be below parallel.ep_size={self.parallel.ep_size}"
            )
        b = self.buckets
        if b is not None and (not b or list(b) != sorted(set(b)) or b[-1] != self.max_tokens):
            raise ValueError("buckets must be strictly increasing and end at max_tokens")
        a = e.activation
        if a.kind is ActivationKind.swiglu_clamped and (a.alpha is None or a.limit is None):
            raise ValueError("experts.activation: swiglu_clamped needs alpha and limit")
        return self

    def digest(self) -> str:
        """sha256 of the canonical JSON form: what the generated files are made from."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


# What the generator produces today, for the fields where that is narrower than the schema.
# Anything else a spec asks for is refused by name, so a spec never builds into a layer that
# ignores part of what it says. A field not listed here is generated for every value the schema
# accepts.
_GENERATED: dict[str, tuple[Any, ...]] = {
    "router.format": (WeightFormat.bf16,),
    "parallel.ep_size": (1,),  # expert parallelism: compiled, not yet run across GPUs
}


def _field(spec: Spec, dotted: str) -> Any:
    obj: Any = spec
    for part in dotted.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part)
    return obj


def not_generated(spec: Spec) -> list[str]:
    """The fields of `spec` that ask for something the generator does not produce yet."""
    out = []
    for dotted, allowed in _GENERATED.items():
        if dotted.startswith("shared_expert.") and spec.shared_expert is None:
            continue
        value = _field(spec, dotted)
        if value not in allowed:
            shown = value.value if isinstance(value, Enum) else value
            if isinstance(value, BaseModel):
                shown = "set"
            out.append(f"{dotted}={shown} is not generated yet")
    return out


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "<top level>"


def _line_of(text: str, loc: tuple[Any, ...]) -> int | None:
    """Line of the key path `loc` in the YAML text, walking it key by key through the nesting."""
    keys = [p for p in loc if isinstance(p, str)]
    if not keys:
        return None
    lines = text.splitlines()
    start, indent, found = 0, -1, None
    for key in keys:
        want = re.compile(rf"^(\s*){re.escape(key)}\s*:")
        for i in range(start, len(lines)):
            m = want.match(lines[i])
            stripped = lines[i].strip()
            if stripped and not stripped.startswith("#") and len(lines[i]) - len(lines[i].lstrip()) <= indent:
                break  # left the enclosing mapping
            if m and len(m.group(1)) > indent:
                start, indent, found = i + 1, len(m.group(1)), i + 1
                break
        else:
            break
    return found


def parse_spec(data: Any, source: str = "<spec>", text: str = "", check_generated: bool = True) -> Spec:
    """Validate a mapping into a Spec; every problem is reported as `source:line: field: why`."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the spec must be a YAML mapping, got {type(data).__name__}")
    try:
        spec = Spec.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            line = _line_of(text, loc)
            where = f"{source}:{line}" if line else source
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            lines.append(f"{where}: {_loc(loc)}: {msg}")
        raise SpecError("invalid spec\n  " + "\n  ".join(lines)) from None
    if check_generated:
        missing = not_generated(spec)
        if missing:
            raise SpecError(f"{source}: " + "; ".join(missing))
    return spec


def load_spec(path: str | Path, check_generated: bool = True) -> Spec:
    """Read and validate a spec YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError(f"{p}: no such spec file") from None
    except OSError as exc:
        raise SpecError(f"{p}: cannot read the spec: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise SpecError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    return parse_spec(data, str(p), text, check_generated)
