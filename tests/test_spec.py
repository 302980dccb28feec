"""CPU tests of the spec schema, its refusals and the spec catalog (specs/)."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from moegen.spec import _GENERATED, Spec, SpecError, load_spec, not_generated, parse_spec

SPECS = Path(__file__).resolve().parent.parent / "specs"
CATALOG = sorted(SPECS.glob("*.yaml"))

BASE = """\
name: t
model: test/model
hidden_size: 64
experts:
  count: 8
  top_k: 2
  intermediate_size: 32
"""

# shared/MODELS.md, transcribed: h, E, k, I, (shared width, gate) or None, renormalize, routed scale.
MODELS = {
    "mixtral-8x7b": (4096, 8, 2, 14336, None, True, 1.0),
    "mixtral-8x22b": (6144, 8, 2, 16384, None, True, 1.0),
    "qwen1.5-moe-a2.7b": (2048, 60, 4, 1408, (5632, "sigmoid"), False, 1.0),
    "qwen2-57b-a14b": (3584, 64, 8, 2560, (20480, "sigmoid"), False, 1.0),
    "qwen3-30b-a3b": (2048, 128, 8, 768, None, True, 1.0),
    "qwen3-235b-a22b": (4096, 128, 8, 1536, None, True, 1.0),
    "qwen3-next-80b-a3b": (2048, 512, 10, 512, (512, "sigmoid"), True, 1.0),
    "qwen3-coder-480b-a35b": (6144, 160, 8, 2560, None, True, 1.0),
    "olmoe-1b-7b": (2048, 64, 8, 1024, None, False, 1.0),
    "deepseek-v2-lite": (2048, 64, 6, 1408, (2816, "none"), False, 1.0),
}

# The catalog's other routing rules, same columns, then the fields that make the rule (MODELS.md
# notes A-E; DeepSeek-V4's shared-expert clamp is the spec's choice, off).
_SIG = {"routing.score": "sigmoid", "routing.select": "scores", "routing.correction_bias": True}
_V4 = {"routing.score": "sqrt_softplus", "experts.activation.limit": 10.0, "shared_expert.clamp": False}
_V4_SCORED = {**_V4, "routing.correction_bias": True, "routing.hash_vocab_size": None, "routing.n_group": 1}
_V4_HASH = {**_V4, "routing.correction_bias": False, "routing.hash_vocab_size": 129280}
_LLAMA4 = {"routing.score": "sigmoid", "routing.select": "logits", "routing.weight_on_input": True}
_OSS = {"experts.activation.kind": "swiglu_clamped", "experts.activation.alpha": 1.702, "experts.activation.limit": 7.0,
        "experts.activation.interleaved_gate_up": True, "experts.bias": True, "router.bias": True,
        "routing.score": "softmax", "routing.select": "logits"}
RULES = {
    "deepseek-v3": (7168, 256, 8, 2048, (2048, "none"), True, 2.5, {**_SIG, "routing.n_group": 8, "routing.topk_group": 4}),
    "kimi-k2": (7168, 384, 8, 2048, (2048, "none"), True, 2.827, {**_SIG, "routing.n_group": 1}),
    "glm-4.5": (5120, 160, 8, 1536, (1536, "none"), True, 2.5, {**_SIG, "routing.n_group": 1}),
    "glm-4.5-air": (4096, 128, 8, 1408, (1408, "none"), True, 1.0, {**_SIG, "routing.n_group": 1}),
    "deepseek-v4-flash": (4096, 256, 6, 2048, (2048, "none"), True, 1.5, _V4_SCORED),
    "deepseek-v4-flash-hash": (4096, 256, 6, 2048, (2048, "none"), True, 1.5, _V4_HASH),
    "deepseek-v4-pro": (7168, 384, 6, 3072, (3072, "none"), True, 2.5, _V4_SCORED),
    "deepseek-v4-pro-hash": (7168, 384, 6, 3072, (3072, "none"), True, 2.5, _V4_HASH),
    "longcat-flash": (6144, 512, 12, 2048, None, False, 6.0,
                      {"experts.zero_experts": 256, "routing.score": "softmax", "routing.correction_bias": True}),
    "llama-4-scout": (5120, 16, 1, 8192, (8192, "none"), False, 1.0, _LLAMA4),
    "llama-4-maverick": (5120, 128, 1, 8192, (8192, "none"), False, 1.0, _LLAMA4),
    "gpt-oss-20b": (2880, 32, 4, 2880, None, False, 1.0, _OSS),
    "gpt-oss-120b": (2880, 128, 4, 2880, None, False, 1.0, _OSS),
    "phi-3.5-moe": (4096, 16, 2, 6400, None, False, 1.0,
                    {"routing.score": "sparsemixer", "routing.sparsemixer_eps": 0.01}),
}


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def base_dict() -> dict:
    return yaml.safe_load(BASE)


# ----------------------------------------------------------------------------- catalog


def test_catalog_is_not_empty():
    assert len(CATALOG) >= len(MODELS) + len(RULES), f"expected at least the catalog specs in {SPECS}"
    assert {p.stem for p in CATALOG} >= set(MODELS) | set(RULES)


@pytest.mark.parametrize("path", CATALOG, ids=lambda p: p.stem)
def test_catalog_spec_loads(path: Path):
    spec = load_spec(path)  # check_generated=True: the generator must be able to build it
    assert spec.name == path.stem
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 10, "each spec opens with a one-line comment"


@pytest.mark.parametrize("path", CATALOG, ids=lambda p: p.stem)
def test_catalog_spec_runs_prefill_up_to_16384_tokens(path: Path):
    """Every catalog spec's layer goes to 16384 tokens, and the plan gives it prefill buckets below
    that (the grouped GEMMs take every catalog layer's formats and rules)."""
    from moegen.plan import make_plan

    spec = load_spec(path)
    plan = make_plan(spec)
    assert spec.max_tokens == 16384 and 0 < plan.prefill_from < 16384, (spec.max_tokens, plan.prefill_from)


def _check_shape(spec: Spec, h: int, e: int, k: int, i: int, shared: tuple | None) -> None:
    assert (spec.hidden_size, spec.experts.count, spec.experts.top_k, spec.experts.intermediate_size) == (h, e, k, i)
    if shared is None:
        assert spec.shared_expert is None
    else:
        assert (spec.shared_expert.intermediate_size, spec.shared_expert.gate) == shared


@pytest.mark.parametrize("stem", sorted(MODELS))
def test_catalog_matches_models_md(stem: str):
    h, e, k, i, shared, renorm, scale = MODELS[stem]
    spec = load_spec(SPECS / f"{stem}.yaml")
    _check_shape(spec, h, e, k, i, shared)
    r = spec.routing
    assert (r.renormalize, r.routed_scaling_factor) == (renorm, scale)
    assert (r.score.value, r.select.value, spec.router.logits_dtype) == ("softmax", "scores", "fp32")
    assert spec.experts.format.value == "bf16" and spec.experts.zero_experts == 0
    assert not r.correction_bias and r.n_group == 1 and r.hash_vocab_size is None


def _value(spec: Spec, dotted: str):
    obj = spec
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "value", obj)


@pytest.mark.parametrize("stem", sorted(RULES))
def test_catalog_routing_rules_match_models_md(stem: str):
    h, e, k, i, shared, renorm, scale, fields = RULES[stem]
    spec = load_spec(SPECS / f"{stem}.yaml")
    _check_shape(spec, h, e, k, i, shared)
    assert (spec.routing.renormalize, spec.routing.routed_scaling_factor) == (renorm, scale)
    assert spec.experts.format.value == "bf16" and spec.router.logits_dtype == "fp32"
    for dotted, want in fields.items():
        assert _value(spec, dotted) == want, f"{stem}: {dotted}"


# ----------------------------------------------------------------------------- refusals


def test_unknown_nested_key_names_file_line_and_field(tmp_path: Path):
    p = write(tmp_path, BASE + "  topk_group: 4\n")  # line 8, a routing key under experts
    with pytest.raises(SpecError) as info:
        load_spec(p)
    msg = str(info.value)
    assert f"{p}:8: experts.topk_group: unknown key" in msg


def test_unknown_top_level_key_names_file_line_and_field(tmp_path: Path):
    p = write(tmp_path, BASE.replace("hidden_size: 64\n", "hidden_size: 64\nhiden: 3\n"))  # line 4
    with pytest.raises(SpecError) as info:
        load_spec(p)
    assert f"{p}:4: hiden: unknown key" in str(info.value)


@pytest.mark.parametrize(
    "edit,field",
    [
        ("experts:\n  count: 8\n  top_k: 9\n", "experts.top_k"),
        ("parallel:\n  ep_size: 2\n  ep_rank: 2\n", "parallel.ep_rank"),
        ("routing:\n  n_group: 3\n", "routing.n_group"),
        ("routing:\n  n_group: 2\n  topk_group: 3\n", "routing.topk_group"),
        ("experts:\n  count: 0\n", "experts.count"),
        ("routing:\n  routed_scaling_factor: -1.0\n", "routing.routed_scaling_factor"),
        ("routing:\n  score: softmaxx\n", "routing.score"),
    ],
)
def test_impossible_values_are_refused_by_field(tmp_path: Path, edit: str, field: str):
    data = base_dict()
    for section, values in yaml.safe_load(edit).items():
        data.setdefault(section, {}).update(values)
    p = write(tmp_path, yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SpecError) as info:
        load_spec(p)
    msg = str(info.value)
    assert field in msg and str(p) in msg
    with pytest.raises(SpecError, match=re.escape(field)):
        parse_spec(data, check_generated=False)  # impossible, not merely not generated


@pytest.mark.parametrize(
    "section,values,message",
    [
        ("router", {"format": "fp8_tensor"}, "router.format=fp8_tensor is not generated yet"),
        ("parallel", {"ep_size": 2, "ep_rank": 1}, "parallel.ep_size=2 is not generated yet"),
    ],
)
def test_not_generated_features_are_refused_by_name(tmp_path: Path, section: str, values: dict, message: str):
    data = base_dict()
    data.setdefault(section, {}).update(values)
    p = write(tmp_path, yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SpecError) as info:
        load_spec(p)
    assert message in str(info.value) and str(p) in str(info.value)
    spec = load_spec(p, check_generated=False)  # valid schema, only not generated yet
    assert spec.name == "t"


# Rules the kernels generate and the GPU tier passed: a spec asking for them loads as is.
GENERATED = [
    ("routing", {"score": "sqrt_softplus", "correction_bias": True}, "routing.score", "sqrt_softplus"),
    ("routing", {"score": "sparsemixer", "sparsemixer_eps": 0.02}, "routing.sparsemixer_eps", 0.02),
    ("routing", {"hash_vocab_size": 100}, "routing.hash_vocab_size", 100),
    ("routing", {"score": "sigmoid", "select": "logits", "weight_on_input": True}, "routing.weight_on_input", True),
    ("experts", {"zero_experts": 8}, "experts.zero_experts", 8),
    ("experts", {"activation": {"kind": "gelu_gated"}}, "experts.activation.kind", "gelu_gated"),
    ("experts", {"activation": {"limit": 10.0}}, "experts.activation.limit", 10.0),
    ("experts", {"activation": {"kind": "swiglu_clamped", "alpha": 1.702, "limit": 7.0, "interleaved_gate_up": True},
                 "bias": True}, "experts.activation.interleaved_gate_up", True),
    ("shared_expert", {"intermediate_size": 32, "clamp": True}, "shared_expert.clamp", True),
    ("router", {"norm": {"eps": 1e-6}, "bias": True}, "router.norm.eps", 1e-6),
    ("pre_expert_norm", {"eps": 1e-5}, "pre_expert_norm.eps", 1e-5),
]


@pytest.mark.parametrize("section,values,dotted,want", GENERATED, ids=[g[2] for g in GENERATED])
def test_generated_features_are_accepted(tmp_path: Path, section: str, values: dict, dotted: str, want):
    data = base_dict()
    data.setdefault(section, {}).update(values)
    spec = load_spec(write(tmp_path, yaml.safe_dump(data, sort_keys=False)))  # check_generated=True
    assert _value(spec, dotted) == want and not_generated(spec) == []


def test_refusal_table_lists_only_real_restrictions():
    """Each entry of the table allows less than the schema: a field generated for every value has no entry."""
    for dotted, allowed in _GENERATED.items():
        *parents, name = dotted.split(".")
        cls = Spec
        for part in parents:  # SharedExpert | None -> SharedExpert
            ann = cls.model_fields[part].annotation
            cls = next((a for a in getattr(ann, "__args__", (ann,)) if a is not type(None)), ann)
        ann = cls.model_fields[name].annotation
        values = list(ann) if isinstance(ann, type) and issubclass(ann, Enum) else [False, True] if ann is bool else None
        assert values is None or set(allowed) < set(values), f"{dotted}: allows every value {allowed}; drop the entry"
        assert allowed, dotted


def test_missing_file_names_the_path(tmp_path: Path):
    p = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match=re.escape(str(p))):
        load_spec(p)


def test_invalid_yaml_names_the_path_and_line(tmp_path: Path):
    p = write(tmp_path, BASE + "routing: [softmax\n")
    with pytest.raises(SpecError) as info:
        load_spec(p)
    msg = str(info.value)
    assert str(p) in msg and "not valid YAML" in msg
    assert re.search(rf"{re.escape(str(p))}:\d+", msg)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_non_mapping_yaml_names_the_path(tmp_path: Path, text: str):
    p = write(tmp_path, text)
    with pytest.raises(SpecError, match=re.escape(str(p))):
        load_spec(p)


# ----------------------------------------------------------------------------- the Spec object


def test_spec_is_frozen():
    spec = parse_spec(base_dict())
    with pytest.raises(ValidationError):
        spec.hidden_size = 128
    with pytest.raises(ValidationError):
        spec.experts.top_k = 1
    with pytest.raises(ValidationError):
        spec.routing.renormalize = True
    assert spec.hidden_size == 64 and spec.experts.top_k == 2


@pytest.mark.parametrize(
    "section,key,value",
    [
        (None, "hidden_size", 128),
        (None, "name", "u"),
        ("experts", "top_k", 3),
        ("experts", "intermediate_size", 48),
        ("routing", "renormalize", True),
        ("routing", "routed_scaling_factor", 2.5),
        ("router", "logits_dtype", "bf16"),
        ("shared_expert", "intermediate_size", 16),
    ],
)
def test_digest_changes_with_any_field(section, key, value):
    a, b = base_dict(), base_dict()
    if section is None:
        b[key] = value
    else:
        b.setdefault(section, {})[key] = value
    da, db = parse_spec(a).digest(), parse_spec(b).digest()
    assert re.fullmatch(r"[0-9a-f]{64}", da)
    assert da != db
    assert parse_spec(base_dict()).digest() == da  # and is stable for equal specs


def test_digest_ignores_spelling_of_defaults():
    explicit = base_dict()
    explicit["routing"] = {"score": "softmax", "renormalize": False}
    assert parse_spec(explicit).digest() == parse_spec(base_dict()).digest()
    assert isinstance(parse_spec(explicit), Spec)


# ----------------------------------------------------------------------------- known spec.py issues


def test_empty_buckets_is_a_spec_error():
    data = base_dict()
    data["buckets"] = []
    with pytest.raises(SpecError, match="buckets"):
        parse_spec(data)


def test_error_line_is_the_offending_section(tmp_path: Path):
    text = BASE + "  format: bf16\nshared_expert:\n  intermediate_size: 16\n  format: bogus\n"  # bogus on line 11
    p = write(tmp_path, text)
    with pytest.raises(SpecError, match=re.escape(f"{p}:11: shared_expert.format")):
        load_spec(p)
