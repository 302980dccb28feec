"""Hugging Face config.json -> Spec, for every family in shared/MODELS.md.

Field names and defaults follow the installed transformers' configuration and modeling files
(transformers 5.x): a field that transformers defaults is defaulted the same way here, a field
it requires (hidden size, expert count, top-k, expert width) is required. Where implementations
disagree (transformers' DeepSeek-V2 ignores norm_topk_prob; transformers' DeepSeek-V4 clamps the
shared expert as well as the routed ones), the comment at that line says which one is followed.

Naming: `--name` > the stem of `-o` > the config's directory name; `--model` > the config's
`_name_or_path` > an HF cache path `models--<org>--<repo>/...`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from .spec import Spec, SpecError, parse_spec
from .specyaml import to_yaml


class HFError(ValueError):
    """A config.json that cannot be imported; one line naming the file and the reason."""


class UnknownArchitecture(HFError):
    """No moegen family for the config's architectures / model_type."""


class MissingField(HFError):
    """The config lacks a field the spec needs."""


class LayerError(HFError):
    """The layer asked for is out of range, or is not a MoE layer."""


class UnsupportedConfig(HFError):
    """The config asks for something the Spec schema cannot express."""


# transformers' attribute_map aliases: save_pretrained may write either name (Qwen3MoeConfig
# writes num_local_experts for num_experts, LongcatFlashConfig moe_topk, ...).
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_ALIASES = {**{k: tuple(x for x in _EXPERTS if x != k) for k in _EXPERTS},
            "num_experts_per_tok": ("moe_topk",), "moe_topk": ("num_experts_per_tok",),
            "expert_ffn_hidden_size": ("moe_intermediate_size",)}


class Cfg:
    """One config mapping and where it came from, so every error can name the file and field."""

    def __init__(self, data: dict[str, Any], source: str, prefix: str = "") -> None:
        self.data, self.source, self.prefix = data, source, prefix

    def need(self, key: str) -> Any:
        for k in (key, *_ALIASES.get(key, ())):
            if self.data.get(k) is not None:
                return self.data[k]
        raise MissingField(f"{self.source}: missing field {self.prefix}{key!r}, which the spec needs")

    def get(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        return default if value is None else value


@dataclass(frozen=True)
class Family:
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    body: Callable[[Cfg, int], dict[str, Any]]  # the spec fields of layer L (a MoE layer)
    dense: Callable[[Cfg, int], str | None] = lambda c, L: None  # why layer L is dense, or None
    layers_field: str = "num_hidden_layers"
    scaled: bool = False  # the family has a routed_scaling_factor: always written in the spec
    fused_transposed: bool = False  # fused experts stored [E, H, 2I] / [E, I, H] (x @ W)
    summary: Callable[[Spec], str] | None = None  # the catalog's wording, where a family has one


# ----------------------------------------------------------------------------- shared pieces


def _activation(c: Cfg) -> dict[str, Any]:
    act = c.get("hidden_act", "silu")
    if act in ("silu", "swish"):
        return {}
    if act == "gelu":  # exact (erf) GELU, as the reference computes it
        return {"kind": "gelu_gated"}
    raise UnsupportedConfig(f"{c.source}: hidden_act={act!r} has no spec activation (silu, gelu)")


def _experts(c: Cfg, count: str, inter: str, top_k: str = "num_experts_per_tok") -> dict[str, Any]:
    e = {"count": c.need(count), "top_k": c.need(top_k), "intermediate_size": c.need(inter)}
    act = _activation(c)
    return {**e, "activation": act} if act else e


def _ungated_shared(c: Cfg) -> dict[str, Any] | None:
    n = c.get("n_shared_experts", 0)
    return {"intermediate_size": n * c.need("moe_intermediate_size"), "gate": "none"} if n else None


def _sparse_step_dense(c: Cfg, layer: int) -> str | None:
    """Qwen2/Qwen3 MoE and Qwen3-Next: mlp_only_layers, then decoder_sparse_step."""
    if layer in c.get("mlp_only_layers", []):
        return f"it is listed in mlp_only_layers={c.get('mlp_only_layers', [])}"
    step = c.get("decoder_sparse_step", 1)
    if (layer + 1) % step:
        return f"decoder_sparse_step={step} makes only layers with (layer + 1) % {step} == 0 MoE"
    return None


def _first_k_dense(c: Cfg, layer: int, default: int = 0) -> str | None:
    k, freq = c.get("first_k_dense_replace", default), c.get("moe_layer_freq", 1)
    if layer < k:
        return f"first_k_dense_replace={k} makes {f'layers 0..{k - 1}' if k > 1 else 'layer 0'} dense"
    if (layer - k) % freq:  # the DeepSeek authors' rule; every published config has freq 1
        return f"moe_layer_freq={freq} makes only every {freq}th layer from {k} MoE"
    return None


# ----------------------------------------------------------------------------- families


def _mixtral(c: Cfg, layer: int) -> dict[str, Any]:
    return {"experts": _experts(c, "num_local_experts", "intermediate_size"), "routing": {"renormalize": True}}


def _qwen(c: Cfg, shared: bool, renorm_default: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"experts": _experts(c, "num_experts", "moe_intermediate_size")}
    if shared:
        d["shared_expert"] = {"intermediate_size": c.need("shared_expert_intermediate_size"), "gate": "sigmoid"}
    d["routing"] = {"renormalize": c.get("norm_topk_prob", renorm_default)}
    return d


def _olmoe(c: Cfg, layer: int) -> dict[str, Any]:
    return {"experts": _experts(c, "num_experts", "intermediate_size"),
            "routing": {"renormalize": c.get("norm_topk_prob", False)}}


def _deepseek_v2(c: Cfg, layer: int) -> dict[str, Any]:
    method = c.get("topk_method", "greedy")
    if method != "greedy":  # group_limited_greedy ranks groups by their max, the schema by a top-2 sum
        raise UnsupportedConfig(f"{c.source}: topk_method={method!r} (group score = max) is not expressible; "
                                "the spec's grouped top-k ranks groups by their top-2 sum (DeepSeek-V3)")
    # transformers' DeepseekV2 ignores norm_topk_prob; the authors' code renormalizes when it is set.
    return {"experts": _experts(c, "n_routed_experts", "moe_intermediate_size"), "shared_expert": _ungated_shared(c),
            "routing": {"score": c.get("scoring_func", "softmax"), "renormalize": c.get("norm_topk_prob", False),
                        "routed_scaling_factor": c.get("routed_scaling_factor", 1.0)}}


def _sigmoid_grouped(c: Cfg, renorm: bool, scale: float) -> dict[str, Any]:
    """DeepSeek-V3, Kimi-K2, GLM-4.5 (note A): sigmoid, selection-only bias, grouped top-k."""
    method = c.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise UnsupportedConfig(f"{c.source}: topk_method={method!r}: only noaux_tc (correction bias) is supported")
    return {"experts": _experts(c, "n_routed_experts", "moe_intermediate_size"), "shared_expert": _ungated_shared(c),
            "routing": {"score": c.get("scoring_func", "sigmoid"), "renormalize": c.get("norm_topk_prob", renorm),
                        "routed_scaling_factor": c.get("routed_scaling_factor", scale), "correction_bias": True,
                        "n_group": c.get("n_group", 1), "topk_group": c.get("topk_group", 1)}}


def _v4_kind(c: Cfg, layer: int) -> str:
    n = c.need("num_hidden_layers")
    kinds = c.get("mlp_layer_types", None)
    if kinds is None:  # transformers: the first num_hash_layers (default 3) layers are hash-routed
        h = c.get("num_hash_layers", 3)
        kinds = ["hash_moe"] * min(n, h) + ["moe"] * max(0, n - h)
    return kinds[layer]


def _deepseek_v4(c: Cfg, layer: int) -> dict[str, Any]:
    hashed = _v4_kind(c, layer) == "hash_moe"
    score = {"sqrtsoftplus": "sqrt_softplus"}.get(c.get("scoring_func", "sqrtsoftplus"), c.get("scoring_func", ""))
    limit = float(c.get("swiglu_limit", 10.0))
    experts = _experts(c, "n_routed_experts", "moe_intermediate_size")
    experts["activation"] = {**experts.get("activation", {}), "limit": limit}
    # MODELS.md note E: whether the shared expert is clamped too is disputed between implementations
    # (transformers' DeepseekV4MLP clamps it). The config documents swiglu_limit for the routed experts
    # and MODELS.md lists the clamp on the routed experts only, so the shared expert is left unclamped;
    # shared_expert.clamp in the spec selects the other reading.
    shared = {"intermediate_size": c.get("n_shared_experts", 1) * c.need("moe_intermediate_size"), "clamp": False}
    routing = {"score": score, "renormalize": c.get("norm_topk_prob", True),
               "routed_scaling_factor": c.get("routed_scaling_factor", 1.5)}
    routing.update({"hash_vocab_size": c.need("vocab_size")} if hashed else {"correction_bias": True})
    return {"experts": experts, "shared_expert": shared, "routing": routing}


def _gpt_oss(c: Cfg, layer: int) -> dict[str, Any]:
    experts = _experts(c, "num_local_experts", "intermediate_size")
    experts.update(bias=True, activation={"kind": "swiglu_clamped", "alpha": float(c.get("swiglu_alpha", 1.702)),
                                          "limit": float(c.get("swiglu_limit", 7.0)), "interleaved_gate_up": True})
    return {"experts": experts, "router": {"bias": True}, "routing": {"select": "logits"}}


def _llama4_layers(c: Cfg) -> list[int]:
    step = c.get("interleave_moe_layer_step", 1)
    return list(c.get("moe_layers", range(step - 1, c.need("num_hidden_layers"), step)))


def _llama4(c: Cfg, layer: int) -> dict[str, Any]:
    return {"experts": _experts(c, "num_local_experts", "intermediate_size"),
            "shared_expert": {"intermediate_size": c.need("intermediate_size"), "gate": "none"},
            "routing": {"score": "sigmoid", "select": "logits", "weight_on_input": True}}


def _llama4_dense(c: Cfg, layer: int) -> str | None:
    moe = _llama4_layers(c)
    if layer in moe:
        return None
    return f"interleave_moe_layer_step={c.get('interleave_moe_layer_step', 1)} makes only layers {moe[:4]}... MoE"


def _phimoe(c: Cfg, layer: int) -> dict[str, Any]:
    if c.get("num_experts_per_tok", 2) != 2:  # sparsemixer() runs exactly two rounds
        raise UnsupportedConfig(f"{c.source}: num_experts_per_tok={c.data['num_experts_per_tok']}: "
                                "PhiMoE's SparseMixer always routes to 2 experts")
    return {"experts": _experts(c, "num_local_experts", "intermediate_size"),
            "routing": {"score": "sparsemixer", "sparsemixer_eps": float(c.get("router_jitter_noise", 0.01))}}


def _longcat(c: Cfg, layer: int) -> dict[str, Any]:
    if c.get("zero_expert_type", "identity") != "identity":
        raise UnsupportedConfig(f"{c.source}: zero_expert_type={c.data['zero_expert_type']!r}: only identity")
    experts = _experts(c, "n_routed_experts", "expert_ffn_hidden_size", top_k="moe_topk")
    experts["zero_experts"] = c.get("zero_expert_num", 0)
    return {"experts": experts, "router": {"bias": c.get("router_bias", False)},
            "routing": {"routed_scaling_factor": c.get("routed_scaling_factor", 6.0), "correction_bias": True}}


def _summary_mixtral(s: Spec) -> str:
    k = s.experts.top_k
    return f"{s.experts.count} experts, top-{k}, softmax over all -> top-{k} -> renormalize"


def _summary_qwen3(s: Spec) -> str:
    tail = " -> renormalize" if s.routing.renormalize else ", no renorm"
    return f"{s.experts.count} experts, top-{s.experts.top_k}, softmax -> top-k{tail}"


_QWEN2 = Family(("qwen2_moe",), ("Qwen2MoeForCausalLM",), lambda c, L: _qwen(c, True, False), _sparse_step_dense)
FAMILIES: dict[str, Family] = {
    "mixtral": Family(("mixtral",), ("MixtralForCausalLM",), _mixtral, summary=_summary_mixtral),
    "qwen2_moe": _QWEN2,
    "qwen3_moe": Family(("qwen3_moe",), ("Qwen3MoeForCausalLM",), lambda c, L: _qwen(c, False, False),
                        _sparse_step_dense, summary=_summary_qwen3),
    "qwen3_next": Family(("qwen3_next",), ("Qwen3NextForCausalLM",), lambda c, L: _qwen(c, True, True),
                         _sparse_step_dense),
    "olmoe": Family(("olmoe",), ("OlmoeForCausalLM",), _olmoe),
    "deepseek_v2": Family(("deepseek_v2",), ("DeepseekV2ForCausalLM",), _deepseek_v2, _first_k_dense, scaled=True),
    "deepseek_v3": Family(("deepseek_v3", "kimi_k2"), ("DeepseekV3ForCausalLM",),
                          lambda c, L: _sigmoid_grouped(c, True, 2.5), lambda c, L: _first_k_dense(c, L, 3),
                          scaled=True),
    "deepseek_v4": Family(("deepseek_v4",), ("DeepseekV4ForCausalLM",), _deepseek_v4, scaled=True),
    "glm4_moe": Family(("glm4_moe",), ("Glm4MoeForCausalLM",), lambda c, L: _sigmoid_grouped(c, True, 1.0),
                       lambda c, L: _first_k_dense(c, L, 1), scaled=True),
    "gpt_oss": Family(("gpt_oss",), ("GptOssForCausalLM",), _gpt_oss, fused_transposed=True),
    "llama4": Family(("llama4", "llama4_text"), ("Llama4ForConditionalGeneration", "Llama4ForCausalLM"), _llama4,
                     _llama4_dense, fused_transposed=True),
    "phimoe": Family(("phimoe",), ("PhiMoEForCausalLM", "PhimoeForCausalLM"), _phimoe),
    "longcat_flash": Family(("longcat_flash",), ("LongcatFlashForCausalLM",), _longcat, layers_field="num_layers",
                            scaled=True),
}


# ----------------------------------------------------------------------------- weight formats


def _excluded(q: dict[str, Any], module: str) -> bool:
    """transformers' / ModelOpt's skip lists: exact names, suffixes or fnmatch patterns."""
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or q.get("exclude_modules") or []
    return any(fnmatch(module, p) or fnmatch(module, f"*{p}") or module.startswith(f"{p}.") for p in skip)


def _formats(c: Cfg, body: dict[str, Any], layer: int) -> None:
    """quantization_config -> experts/shared_expert/router formats, in place."""
    q = c.get("quantization_config", None)
    if not q:
        return
    method, where = q.get("quant_method"), f"{c.source}: quantization_config"
    if method == "fp8":
        if q.get("scale_fmt", "float") != "float" or q.get("expert_dtype", "fp8") != "fp8":
            raise UnsupportedConfig(f"{where}: scale_fmt={q.get('scale_fmt')!r}, expert_dtype="
                                    f"{q.get('expert_dtype')!r} (DeepSeek-V4 formats) have no spec format yet")
        block = q.get("weight_block_size")
        if block not in (None, [128, 128]):
            raise UnsupportedConfig(f"{where}: weight_block_size={block}: only [128, 128] FP8 blocks are supported")
        fmt = "fp8_block" if block else "fp8_tensor"
        router = None  # the DeepSeek / Qwen FP8 releases leave the router unquantized
    elif method == "mxfp4":
        fmt, router = "mxfp4", None
    elif method == "modelopt" and q.get("quant_algo") in ("NVFP4", "FP8"):
        fmt = router = "nvfp4" if q["quant_algo"] == "NVFP4" else "fp8_tensor"
    else:
        raise UnsupportedConfig(f"{where}: quant_method={method!r} (quant_algo={q.get('quant_algo')!r}) "
                                "is not a format moegen knows (fp8, mxfp4, modelopt NVFP4/FP8)")
    mlp = f"model.layers.{layer}.mlp"
    if not _excluded(q, f"{mlp}.experts"):
        body["experts"]["format"] = fmt
        if fmt == "fp8_block" and q.get("activation_scheme", "dynamic") == "dynamic":
            body["experts"]["fp8_activations"] = True
    if body.get("shared_expert") and not any(_excluded(q, f"{mlp}.{m}") for m in ("shared_expert", "shared_experts")):
        body["shared_expert"]["format"] = fmt
    if router and not any(_excluded(q, f"{mlp}.{m}") for m in ("gate", "router")):
        body.setdefault("router", {})["format"] = router


# ----------------------------------------------------------------------------- import


@dataclass(frozen=True)
class Imported:
    spec: Spec
    family: str
    layer: int
    text: str  # the YAML file, comment line first


def read_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise HFError(f"{p}: no such config file") from None
    except OSError as exc:
        raise HFError(f"{p}: cannot read the config: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise HFError(f"{p}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise HFError(f"{p}: a config.json must hold a JSON object, got {type(data).__name__}")
    return data


def family_of(data: dict[str, Any], source: str) -> tuple[str, Family]:
    mt, archs = data.get("model_type"), data.get("architectures") or []
    for key, fam in FAMILIES.items():
        if mt in fam.model_types:
            return key, fam
    for key, fam in FAMILIES.items():
        if any(a in fam.architectures for a in archs):
            return key, fam
    raise UnknownArchitecture(f"{source}: unknown model: architectures={archs}, model_type={mt!r}; "
                              f"moegen imports {', '.join(FAMILIES)}")


def _text_cfg(data: dict[str, Any], source: str) -> Cfg:
    if isinstance(data.get("text_config"), dict):  # Llama-4: the language model's fields are nested
        return Cfg({"quantization_config": data.get("quantization_config"), **data["text_config"]}, source,
                   "text_config.")
    return Cfg(data, source)


def moe_layers(path: str | Path) -> tuple[str, int, dict[int, str | None]]:
    """(family, layer count, {layer: None if MoE else why it is dense}) of a config.json."""
    data = read_config(path)
    key, fam = family_of(data, str(path))
    c = _text_cfg(data, str(path))
    n = int(c.need(fam.layers_field))
    return key, n, {i: fam.dense(c, i) for i in range(n)}


def _pick_layer(c: Cfg, fam: Family, layer: int | None) -> int:
    n = int(c.need(fam.layers_field))
    if layer is None:  # the first MoE layer
        layer = next((i for i in range(n) if fam.dense(c, i) is None), None)
        if layer is None:
            raise LayerError(f"{c.source}: no MoE layer among the {n} layers")
        return layer
    if not 0 <= layer < n:
        raise LayerError(f"{c.source}: layer {layer} is out of range: the model has layers 0..{n - 1} "
                         f"({c.prefix}{fam.layers_field}={n})")
    why = fam.dense(c, layer)
    if why:
        raise LayerError(f"{c.source}: layer {layer} is dense, not MoE: {why}")
    return layer


def _model_id(data: dict[str, Any], path: Path, model: str | None) -> str:
    if model:
        return model
    named = data.get("_name_or_path")
    if isinstance(named, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", named):
        return named
    m = re.search(r"models--([^/]+?)--([^/]+)", str(path.resolve()))
    if m:  # a Hugging Face cache snapshot: .../models--<org>--<repo>/snapshots/<hash>/config.json
        return f"{m[1]}/{m[2]}"
    raise MissingField(f"{path}: cannot tell the model's repo id: pass --model org/name "
                       "(or give the config an _name_or_path)")


def import_config(path: str | Path, layer: int | None = None, name: str | None = None, model: str | None = None,
                  out: str | Path | None = None, check_generated: bool = False, minimal: bool = False,
                  max_tokens: int | None = None) -> Imported:
    """The Spec of one MoE layer of a Hugging Face config.json, and its YAML text (minimal: only
    the fields that differ from the schema defaults; else the routing rule is written in full).
    max_tokens: the largest N a call may pass (the schema's default where None)."""
    p = Path(path)
    data = read_config(p)
    key, fam = family_of(data, str(p))
    c = _text_cfg(data, str(p))
    L = _pick_layer(c, fam, layer)
    body = fam.body(c, L)
    _formats(c, body, L)
    model_id = _model_id(data, p, model)
    if not name:
        stem = Path(out).stem if out else model_id.rsplit("/", 1)[-1]
        name = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-._") or "model"
    d = {"name": name, "model": model_id, "hidden_size": c.need("hidden_size"), **body, "max_tokens": max_tokens}
    d = {k: v for k, v in d.items() if v is not None}
    spec = parse_spec(d, f"{p} (layer {L})", check_generated=check_generated)
    return Imported(spec, key, L, to_yaml(spec, fam, c, minimal))


__all__ = ["FAMILIES", "HFError", "Imported", "LayerError", "MissingField", "SpecError", "UnknownArchitecture",
           "UnsupportedConfig", "family_of", "import_config", "moe_layers", "read_config"]
