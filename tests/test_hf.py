"""CPU tests of the Hugging Face path: config.json -> Spec (moegen.hf, `moegen spec import-hf`),
one layer's weights from safetensors (moegen.checkpoint), and `moegen check` without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from moegen import spec as spec_module
from moegen.check import run_check
from moegen.checkpoint import CheckpointError, MissingTensor, ShapeError, load_layer
from moegen.cli import main
from moegen.hf import (
    FAMILIES,
    Cfg,
    HFError,
    LayerError,
    MissingField,
    UnknownArchitecture,
    UnsupportedConfig,
    import_config,
    moe_layers,
)
from moegen.spec import load_spec, not_generated, parse_spec
from moegen.specyaml import to_yaml

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "hf"
# tests/data/hf/<name>/ holds config.json, import.json, or both (see tests/data/hf/README.md).
CATALOG = sorted(p.name for p in DATA.iterdir() if (p / "config.json").is_file() or (p / "import.json").is_file())
# Catalog specs whose first comment line import-hf words differently (none: a spec whose values
# the importer reproduces is regenerated from it, comment included).
COMMENT_DIFFERS: dict[str, str] = {}
BF16 = ml_dtypes.bfloat16


def import_args(name: str) -> list[str]:
    """The config and extra `import-hf` arguments that make specs/<name>.yaml: config.json in
    tests/data/hf/<name>/ unless its import.json names another ("config", relative to that
    directory), plus import.json's "args" (e.g. the layer)."""
    d = DATA / name
    how = json.loads((d / "import.json").read_text()) if (d / "import.json").is_file() else {}
    assert set(how) <= {"config", "args"}, f"{d / 'import.json'}: unknown keys {sorted(set(how) - {'config', 'args'})}"
    config = (d / how.get("config", "config.json")).resolve()
    assert config.is_file(), f"{name}: no config {config}"
    args = how.get("args", [])
    assert isinstance(args, list) and all(isinstance(a, str) for a in args), f"{name}: args must be a list of strings"
    return [str(config), *args]


def write_config(tmp: Path, cfg: dict, name: str = "config.json") -> Path:
    p = tmp / name
    p.write_text(json.dumps(cfg))
    return p


# ----------------------------------------------------------------------------- catalog round trip


def test_every_catalog_spec_has_a_transcribed_config():
    assert len(CATALOG) >= 10
    assert all((ROOT / "specs" / f"{n}.yaml").is_file() for n in CATALOG)


@pytest.mark.parametrize("name", CATALOG)
def test_import_reproduces_the_committed_spec(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / f"{name}.yaml"
    assert main(["spec", "import-hf", *import_args(name), "-o", str(out)]) == 0
    got, want = out.read_text().splitlines(True), (ROOT / "specs" / f"{name}.yaml").read_text().splitlines(True)
    assert got[1:] == want[1:], "the fields differ from the committed spec"
    assert got[0].rstrip("\n") == COMMENT_DIFFERS.get(name, want[0].rstrip("\n"))
    assert not_generated(load_spec(out)) == []  # what the catalog builds today
    assert capsys.readouterr().out.startswith(f"{out}: {name} (")


def test_import_to_stdout_names_the_spec_after_the_repo(capsys: pytest.CaptureFixture[str]):
    assert main(["spec", "import-hf", str(DATA / "qwen3-30b-a3b" / "config.json")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B): ") and "\nname: qwen3-30b-a3b\n" in text


def test_model_id_from_the_hf_cache_path(tmp_path: Path):
    cfg = json.loads((DATA / "olmoe-1b-7b" / "config.json").read_text())
    del cfg["_name_or_path"]
    snap = tmp_path / "models--allenai--OLMoE-1B-7B-0924" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    spec = import_config(write_config(snap, cfg)).spec
    assert (spec.model, spec.name) == ("allenai/OLMoE-1B-7B-0924", "olmoe-1b-7b-0924")
    with pytest.raises(MissingField, match="--model"):
        import_config(write_config(tmp_path, cfg))


# ----------------------------------------------------------------------------- every family (MODELS.md values)

V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
      "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
      "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
      "topk_method": "noaux_tc", "first_k_dense_replace": 3, "num_hidden_layers": 61, "vocab_size": 129280,
      "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}}
V4 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
      "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "n_shared_experts": 1,
      "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
      "num_hash_layers": 3, "num_hidden_layers": 43, "vocab_size": 129280}
GLM = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 5120,
       "n_routed_experts": 160, "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "n_shared_experts": 1,
       "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
       "first_k_dense_replace": 3, "num_hidden_layers": 92}
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
           "num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 2880, "swiglu_limit": 7.0,
           "num_hidden_layers": 24, "quantization_config": {"quant_method": "mxfp4",
                                                            "modules_to_not_convert": ["model.layers.*.mlp.router"]}}
LLAMA4 = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
          "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "num_local_experts": 128,
                          "num_experts_per_tok": 1, "intermediate_size": 8192, "interleave_moe_layer_step": 2,
                          "num_hidden_layers": 48}}
PHI = {"architectures": ["PhiMoEForCausalLM"], "model_type": "phimoe", "hidden_size": 4096, "num_local_experts": 16,
       "num_experts_per_tok": 2, "intermediate_size": 6400, "router_jitter_noise": 0.01, "num_hidden_layers": 32}
LONGCAT = {"architectures": ["LongcatFlashForCausalLM"], "model_type": "longcat_flash", "hidden_size": 6144,
           "n_routed_experts": 512, "zero_expert_num": 256, "zero_expert_type": "identity", "moe_topk": 12,
           "expert_ffn_hidden_size": 2048, "routed_scaling_factor": 6.0, "num_layers": 28}


def dump(spec) -> dict:
    return spec.model_dump(mode="json")


@pytest.mark.parametrize("cfg,layer,want", [
    (V3, 3, {"experts": {"count": 256, "format": "fp8_block", "fp8_activations": True},
             "shared_expert": {"intermediate_size": 2048, "gate": "none", "format": "fp8_block"},
             "routing": {"score": "sigmoid", "correction_bias": True, "n_group": 8, "topk_group": 4,
                         "renormalize": True, "routed_scaling_factor": 2.5}}),
    ({**V3, "model_type": "kimi_k2", "n_routed_experts": 384, "routed_scaling_factor": 2.827, "n_group": 1,
      "topk_group": 1, "first_k_dense_replace": 1}, 1,
     {"experts": {"count": 384}, "routing": {"n_group": 1, "routed_scaling_factor": 2.827}}),
    (GLM, 3, {"experts": {"count": 160, "intermediate_size": 1536}, "routing": {"score": "sigmoid",
              "correction_bias": True, "routed_scaling_factor": 2.5}}),
    (GPT_OSS, 0, {"experts": {"count": 32, "top_k": 4, "bias": True, "format": "mxfp4",
                              "activation": {"kind": "swiglu_clamped", "alpha": 1.702, "limit": 7.0,
                                             "interleaved_gate_up": True}},
                  "router": {"bias": True, "format": "bf16"}, "routing": {"select": "logits", "score": "softmax"}}),
    (LLAMA4, 1, {"hidden_size": 5120, "experts": {"count": 128, "top_k": 1},
                 "shared_expert": {"intermediate_size": 8192, "gate": "none"},
                 "routing": {"score": "sigmoid", "select": "logits", "weight_on_input": True}}),
    (PHI, 0, {"experts": {"count": 16, "intermediate_size": 6400}, "routing": {"score": "sparsemixer",
                                                                              "sparsemixer_eps": 0.01}}),
    (LONGCAT, 27, {"experts": {"count": 512, "zero_experts": 256, "top_k": 12}, "routing": {
        "score": "softmax", "correction_bias": True, "renormalize": False, "routed_scaling_factor": 6.0}}),
    (V4, 2, {"experts": {"activation": {"limit": 10.0}}, "shared_expert": {"clamp": False},
             "routing": {"score": "sqrt_softplus", "hash_vocab_size": 129280, "correction_bias": False}}),
    (V4, 3, {"routing": {"score": "sqrt_softplus", "hash_vocab_size": None, "correction_bias": True,
                         "routed_scaling_factor": 1.5}}),
])
def test_family_fields(cfg: dict, layer: int, want: dict, tmp_path: Path):
    got = dump(import_config(write_config(tmp_path, cfg), layer=layer, model="org/m").spec)

    def check(g: dict, w: dict, where: str) -> None:
        for k, v in w.items():
            if isinstance(v, dict):
                check(g[k], v, f"{where}{k}.")
            else:
                assert g[k] == v, f"{where}{k}: {g[k]!r} != {v!r}"

    check(got, want, "")


def test_every_family_is_recognized_by_architecture_alone(tmp_path: Path):
    for fam in FAMILIES.values():
        cfg = {"architectures": [fam.architectures[0]]}
        with pytest.raises(MissingField):  # recognized, then the first needed field is missing
            import_config(write_config(tmp_path, cfg), model="org/m")
        assert fam.architectures


def test_v4_comment_says_whether_the_shared_expert_is_clamped(tmp_path: Path):
    """MODELS.md note E: disputed, so a spec option; the import leaves it unclamped and says so."""
    r = import_config(write_config(tmp_path, V4), layer=3, model="deepseek-ai/DeepSeek-V4-Flash")
    assert r.spec.shared_expert.clamp is False
    assert r.text.splitlines()[0].endswith("; SiLU clamped at 10.0; shared MLP 2048, ungated, not clamped.")
    clamped = r.spec.model_copy(update={"shared_expert": r.spec.shared_expert.model_copy(update={"clamp": True})})
    text = to_yaml(clamped, FAMILIES["deepseek_v4"], Cfg(V4, "config.json"))
    assert text.splitlines()[0].endswith("shared MLP 2048, ungated, clamped too.") and "  clamp: true\n" in text


def test_yaml_writes_only_what_differs_and_round_trips(tmp_path: Path):
    r = import_config(write_config(tmp_path, GPT_OSS), model="openai/gpt-oss-20b")
    assert r.text.startswith("# gpt-oss-20b (openai/gpt-oss-20b): 32 experts, top-4 on logits -> softmax; "
                             "clamped SwiGLU (alpha 1.702, limit 7.0); expert biases; mxfp4 experts.\n")
    assert "arch:" not in r.text and "max_tokens:" not in r.text  # defaults are not written
    p = tmp_path / "gpt.yaml"
    p.write_text(r.text)
    assert load_spec(p, check_generated=False) == r.spec


# ----------------------------------------------------------------------------- refusals


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and isinstance(exc, ValueError)
    return text


def test_unknown_architecture_names_what_it_found(tmp_path: Path):
    p = write_config(tmp_path, {"architectures": ["FooForCausalLM"], "model_type": "foo"})
    with pytest.raises(UnknownArchitecture) as info:
        import_config(p)
    assert "architectures=['FooForCausalLM'], model_type='foo'" in one_line(info.value) and str(p) in str(info.value)


def test_missing_field_names_the_field_and_file(tmp_path: Path):
    cfg = json.loads((DATA / "mixtral-8x7b" / "config.json").read_text())
    del cfg["num_local_experts"]
    p = write_config(tmp_path, cfg)
    with pytest.raises(MissingField) as info:
        import_config(p)
    assert one_line(info.value) == f"{p}: missing field 'num_local_experts', which the spec needs"


def test_layer_out_of_range_names_the_range():
    with pytest.raises(LayerError) as info:
        import_config(DATA / "mixtral-8x7b" / "config.json", layer=32)
    assert "layer 32 is out of range: the model has layers 0..31 (num_hidden_layers=32)" in one_line(info.value)


@pytest.mark.parametrize("cfg,layer,why", [
    (json.loads((DATA / "deepseek-v2-lite" / "config.json").read_text()), 0, "first_k_dense_replace=1 makes layer 0"),
    (V3, 2, "first_k_dense_replace=3 makes layers 0..2 dense"),
    (LLAMA4, 0, "interleave_moe_layer_step=2 makes only layers [1, 3, 5, 7]"),
    ({**json.loads((DATA / "qwen3-30b-a3b" / "config.json").read_text()), "mlp_only_layers": [5]}, 5,
     "listed in mlp_only_layers=[5]"),
    ({**json.loads((DATA / "qwen2-57b-a14b" / "config.json").read_text()), "decoder_sparse_step": 2}, 2,
     "decoder_sparse_step=2"),
])
def test_dense_layer_is_refused_with_the_reason(cfg: dict, layer: int, why: str, tmp_path: Path):
    with pytest.raises(LayerError) as info:
        import_config(write_config(tmp_path, cfg), layer=layer, model="org/m")
    assert f"layer {layer} is dense, not MoE: " in one_line(info.value) and why in str(info.value)


def test_default_layer_is_the_first_moe_layer_and_v4_kinds(tmp_path: Path):
    assert import_config(write_config(tmp_path, V3), model="org/m").layer == 3
    _, n, kinds = moe_layers(write_config(tmp_path, V4))
    assert n == 43 and all(v is None for v in kinds.values())  # every V4 layer is MoE
    hashed = [L for L in range(5) if import_config(tmp_path / "config.json", layer=L, model="o/m").spec
              .routing.hash_vocab_size]
    assert hashed == [0, 1, 2]


@pytest.mark.parametrize("cfg,match", [
    ({**V3, "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "weight_block_size"),
    ({**V4, "quantization_config": {"quant_method": "fp8", "expert_dtype": "fp4", "scale_fmt": "ue8m0"}},
     "expert_dtype='fp4'"),
    ({**V3, "quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
    ({**json.loads((DATA / "deepseek-v2-lite" / "config.json").read_text()), "topk_method": "group_limited_greedy"},
     "group_limited_greedy"),
    ({**PHI, "num_experts_per_tok": 3}, "SparseMixer always routes to 2"),
    ({**PHI, "hidden_act": "relu"}, "hidden_act='relu'"),
])
def test_inexpressible_configs_are_refused(cfg: dict, match: str, tmp_path: Path):
    with pytest.raises(UnsupportedConfig, match=match) as info:
        import_config(write_config(tmp_path, cfg), model="org/m")
    one_line(info.value)


def test_cli_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    p = write_config(tmp_path, {"model_type": "bert"})
    assert main(["spec", "import-hf", str(p)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moegen: error: ") and "model_type='bert'" in err
    (tmp_path / "bad.json").write_text("{")
    assert main(["spec", "import-hf", str(tmp_path / "bad.json")]) == 1
    assert "not valid JSON" in capsys.readouterr().err
    assert issubclass(HFError, ValueError) and issubclass(CheckpointError, ValueError)


def test_cli_notes_what_the_generator_does_not_produce(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch):
    v3 = ["spec", "import-hf", str(write_config(tmp_path, V3)), "--model", "deepseek-ai/DeepSeek-V3",
          "-o", str(tmp_path / "v3.yaml")]
    assert main(v3) == 0
    assert "note:" not in capsys.readouterr().err  # FP8 block with FP8 activations is generated
    # a field the generator would not produce is written to the spec and noted, not dropped
    monkeypatch.setitem(spec_module._GENERATED, "experts.fp8_activations", (False,))
    assert main(v3) == 0
    assert "note: the generator does not produce this yet: experts.fp8_activations=True" in capsys.readouterr().err
    assert "fp8_activations: true" in (tmp_path / "v3.yaml").read_text()
    monkeypatch.undo()
    assert main(["spec", "import-hf", str(write_config(tmp_path, GPT_OSS)), "--model", "openai/gpt-oss-20b",
                 "-o", str(tmp_path / "oss.yaml")]) == 0
    assert "note:" not in capsys.readouterr().err  # MXFP4 is generated
    assert main(["spec", "import-hf", str(write_config(tmp_path, PHI)), "--model", "microsoft/Phi-3.5-MoE-instruct",
                 "-o", str(tmp_path / "phi.yaml")]) == 0
    assert "note:" not in capsys.readouterr().err  # SparseMixer is generated


# ----------------------------------------------------------------------------- checkpoints

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="checkpoint loading needs safetensors")
QWEN2 = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 40, "num_experts": 6,
         "num_experts_per_tok": 2, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 16,
         "num_hidden_layers": 3, "_name_or_path": "org/tiny-qwen2"}
TINY_OSS = {**GPT_OSS, "hidden_size": 40, "num_local_experts": 6, "intermediate_size": 24, "num_hidden_layers": 3,
            "_name_or_path": "org/tiny-oss"}
TINY_OSS.pop("quantization_config")


def canonical(spec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    e, i, h = spec.experts.count, spec.experts.intermediate_size, spec.hidden_size
    shapes = {"gate.weight": (e, h), "experts.gate_proj": (e, i, h), "experts.up_proj": (e, i, h),
              "experts.down_proj": (e, h, i)}
    if spec.shared_expert:
        s = spec.shared_expert.intermediate_size
        shapes.update({"shared_expert.gate_proj": (s, h), "shared_expert.up_proj": (s, h),
                       "shared_expert.down_proj": (h, s), "shared_expert_gate.weight": (1, h)})
    if spec.experts.bias:
        shapes.update({"gate.bias": (e,), "experts.gate_proj_bias": (e, i), "experts.up_proj_bias": (e, i),
                       "experts.down_proj_bias": (e, h)})
    return {k: rng.standard_normal(v).astype(BF16) for k, v in shapes.items()}


def stored(w: dict[str, np.ndarray], layout: str, layer: int) -> dict[str, np.ndarray]:
    """The same weights under a checkpoint's names, plus another layer's tensors that must not be read."""
    p = f"model.layers.{layer}.mlp."
    out = {f"model.layers.{layer + 1}.mlp.gate.weight": w["gate.weight"], "model.embed_tokens.weight": w["gate.weight"]}
    if layout == "per_expert":  # Mixtral's names
        p = f"model.layers.{layer}.block_sparse_moe."
        for e in range(len(w["experts.gate_proj"])):
            for proj, n in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                out[f"{p}experts.{e}.{n}.weight"] = w[f"experts.{proj}"][e]
    elif layout == "fused":  # transformers 5 in memory: [E, 2I, H], gate rows first
        out[f"{p}experts.gate_up_proj"] = np.concatenate([w["experts.gate_proj"], w["experts.up_proj"]], axis=1)
        out[f"{p}experts.down_proj"] = w["experts.down_proj"]
    else:  # GPT-OSS: [E, H, 2I] with gate/up columns interleaved, [E, I, H], router.*
        gu = np.stack([w["experts.gate_proj"], w["experts.up_proj"]], axis=2).reshape(len(w["gate.weight"]), -1,
                                                                                    w["gate.weight"].shape[1])
        out[f"{p}experts.gate_up_proj"] = np.ascontiguousarray(np.swapaxes(gu, 1, 2))
        out[f"{p}experts.down_proj"] = np.ascontiguousarray(np.swapaxes(w["experts.down_proj"], 1, 2))
        bias = np.stack([w["experts.gate_proj_bias"], w["experts.up_proj_bias"]], axis=2)
        out[f"{p}experts.gate_up_proj_bias"] = bias.reshape(len(bias), -1)
        out[f"{p}experts.down_proj_bias"] = w["experts.down_proj_bias"]
        out[f"{p}router.bias"] = w["gate.bias"]
    router = "router.weight" if layout == "oss" else "gate.weight"
    out[f"{p}{router}"] = w["gate.weight"]
    for k, v in w.items():
        if k.startswith("shared_expert"):
            out[f"{p}{k}" if k.endswith(".weight") else f"{p}{k}.weight"] = v
    return out


def save_sharded(d: Path, tensors: dict[str, np.ndarray], shards: int) -> list[Path]:
    names = sorted(tensors)
    files, weight_map = [], {}
    for s in range(shards):
        f = d / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        safetensors_numpy.save_file({n: np.ascontiguousarray(tensors[n]) for n in part}, f)
        weight_map.update(dict.fromkeys(part, f.name))
        files.append(f)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


@pytest.mark.parametrize("cfg,layout,shards", [(QWEN2, "per_expert", 1), (QWEN2, "fused", 3),
                                               (TINY_OSS, "oss", 1), (TINY_OSS, "oss", 2)])
def test_both_layouts_load_to_the_canonical_names(cfg: dict, layout: str, shards: int, tmp_path: Path):
    spec = import_config(write_config(tmp_path, cfg), layer=1).spec
    w = canonical(spec, np.random.default_rng(0))
    tensors = stored(w, layout, 1)
    if shards == 1:
        safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    else:
        save_sharded(tmp_path, tensors, shards)
    got = load_layer(tmp_path, spec, 1)
    assert sorted(got) == sorted(w)
    for k in w:
        assert got[k].dtype == np.dtype(BF16) and np.array_equal(got[k].view(np.uint16), w[k].view(np.uint16)), k


def test_mxfp4_checkpoint_keeps_its_codes_for_an_mxfp4_spec(tmp_path: Path):
    """GPT-OSS as shipped: *_blocks / *_scales with gate and up rows interleaved. An MXFP4 spec
    gets the codes and E8M0 scales as stored (de-interleaved, nothing re-quantized); a BF16
    spec of the same checkpoint gets their exact values."""
    from moegen.quant import quantize_mxfp4

    cfg = {**TINY_OSS, "hidden_size": 64, "intermediate_size": 32}
    mx = import_config(write_config(tmp_path, {**cfg, "quantization_config": {"quant_method": "mxfp4"}}), layer=1).spec
    assert mx.experts.format.value == "mxfp4"
    rng = np.random.default_rng()
    e, i, h = 6, 32, 64
    q = {p: quantize_mxfp4(rng.standard_normal(shape).astype(np.float32))
         for p, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i)))}
    pre = "model.layers.1.mlp."

    def interleave(a, b):
        return np.stack([a, b], axis=2).reshape(e, 2 * i, *a.shape[2:])

    tensors = {f"{pre}router.weight": rng.standard_normal((e, h)).astype(BF16),
               f"{pre}router.bias": rng.standard_normal(e).astype(BF16),
               f"{pre}experts.gate_up_proj_blocks": interleave(q["gate"].blocks(), q["up"].blocks()),
               f"{pre}experts.gate_up_proj_scales": interleave(q["gate"].scale, q["up"].scale),
               f"{pre}experts.down_proj_blocks": q["down"].blocks(), f"{pre}experts.down_proj_scales": q["down"].scale,
               f"{pre}experts.gate_up_proj_bias": rng.standard_normal((e, 2 * i)).astype(BF16),
               f"{pre}experts.down_proj_bias": rng.standard_normal((e, h)).astype(BF16)}
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    got = load_layer(tmp_path, mx, 1)
    for p in ("gate", "up", "down"):
        assert np.array_equal(got[f"experts.{p}_proj"], q[p].packed), p
        assert np.array_equal(got[f"experts.{p}_proj_scale"], q[p].scale), p
    bf = import_config(write_config(tmp_path, cfg), layer=1).spec
    got = load_layer(tmp_path, bf, 1)
    for p in ("gate", "up", "down"):
        assert np.array_equal(got[f"experts.{p}_proj"].astype(np.float64), q[p].dequantize()), p


def test_nvfp4_checkpoint_keeps_codes_scales_and_each_scale_2(tmp_path: Path):
    """ModelOpt NVFP4 per expert: weight / weight_scale / weight_scale_2, the gate's and the up's
    scale_2 kept apart; a matrix of the wrong size names the tensor and the expected form."""
    from moegen.quant import quantize_nvfp4

    e, i, h = 6, 32, 64
    spec = parse_spec({"name": "tiny-nvfp4", "model": "org/tiny", "hidden_size": h, "experts": {
        "count": e, "top_k": 2, "intermediate_size": i, "format": "nvfp4"}}, check_generated=False)
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    rng = np.random.default_rng()
    q = {(x, p): quantize_nvfp4(rng.standard_normal((h, i) if p == "down_proj" else (i, h)).astype(np.float32))
         for x in range(e) for p in ("gate_proj", "up_proj", "down_proj")}
    pre = "model.layers.1.mlp."
    tensors = {f"{pre}gate.weight": rng.standard_normal((e, h)).astype(BF16)}
    for (x, p), w in q.items():
        tensors.update({f"{pre}experts.{x}.{p}.{k}": v for k, v in w.tensors().items()})
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    got = load_layer(tmp_path, spec, 1)
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert np.array_equal(got[f"experts.{p}"], np.stack([q[x, p].packed for x in range(e)]))
        assert np.array_equal(got[f"experts.{p}_scale"].view(np.uint8),
                              np.stack([q[x, p].scale for x in range(e)]).view(np.uint8))
        assert np.array_equal(got[f"experts.{p}_scale_2"], np.array([q[x, p].scale_2[0] for x in range(e)]))
    assert not np.array_equal(got["experts.gate_proj_scale_2"], got["experts.up_proj_scale_2"])
    small = quantize_nvfp4(rng.standard_normal((i - 8, h)).astype(np.float32))
    tensors.update({f"{pre}experts.2.up_proj.{k}": v for k, v in small.tensors().items()})
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ShapeError, match=r"experts\.2\.up_proj\.weight holds a \[24, 64\] NVFP4 matrix, "
                                         r"expected \[32, 64\] \(expert 2 up_proj: uint8 \[32, 32\]\)"):
        load_layer(tmp_path, spec, 1)


def test_fp8_per_tensor_checkpoint_keeps_codes_and_both_scales(tmp_path: Path):
    """ModelOpt FP8 per-tensor (format d), routed and shared: weight / weight_scale / input_scale as
    stored, one pair of scales per matrix; a missing input_scale names the tensor (the kernels
    quantize their inputs by it)."""
    from moegen.quant import quantize_fp8_tensor

    e, i, s, h = 4, 32, 48, 64
    spec = parse_spec({"name": "tiny-fp8t", "model": "org/tiny", "hidden_size": h,
                       "experts": {"count": e, "top_k": 2, "intermediate_size": i, "format": "fp8_tensor"},
                       "shared_expert": {"intermediate_size": s, "format": "fp8_tensor", "gate": "sigmoid"}},
                      check_generated=False)
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    rng = np.random.default_rng()

    def q(rows, cols):
        return quantize_fp8_tensor(rng.standard_normal((rows, cols)).astype(np.float32),
                                   input_scale=float(rng.uniform(0.01, 0.02)))

    pre = "model.layers.1.mlp."
    routed = {(x, p): q(h, i) if p == "down_proj" else q(i, h) for x in range(e) for p in ("gate_proj", "up_proj", "down_proj")}
    shared = {p: q(h, s) if p == "down_proj" else q(s, h) for p in ("gate_proj", "up_proj", "down_proj")}
    tensors = {f"{pre}gate.weight": rng.standard_normal((e, h)).astype(BF16),
               f"{pre}shared_expert_gate.weight": rng.standard_normal((1, h)).astype(BF16)}
    for (x, p), w in routed.items():
        tensors.update({f"{pre}experts.{x}.{p}.{k}": v for k, v in w.tensors().items()})
    for p, w in shared.items():
        tensors.update({f"{pre}shared_expert.{p}.{k}": v for k, v in w.tensors().items()})
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    got = load_layer(tmp_path, spec, 1)
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert np.array_equal(got[f"experts.{p}"].view(np.uint8), np.stack([routed[x, p].q for x in range(e)]).view(np.uint8))
        assert np.array_equal(got[f"experts.{p}_scale"], np.array([routed[x, p].scale for x in range(e)]))
        assert np.array_equal(got[f"experts.{p}_input_scale"], np.array([routed[x, p].input_scale for x in range(e)]))
        assert got[f"shared_expert.{p}_input_scale"] == shared[p].input_scale
        assert np.array_equal(got[f"shared_expert.{p}"].view(np.uint8), shared[p].q.view(np.uint8))
    tensors[f"{pre}experts.1.up_proj.input_scale"] = np.array([0.01], np.float16)
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.1\.up_proj\.input_scale: float16 \[1\], expected a float32 scalar"):
        load_layer(tmp_path, spec, 1)
    del tensors[f"{pre}experts.3.down_proj.input_scale"]
    tensors[f"{pre}experts.1.up_proj.input_scale"] = routed[1, "up_proj"].input_scale
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(MissingTensor, match=r"missing tensor model\.layers\.1\.mlp\.experts\.3\.down_proj\.input_scale"):
        load_layer(tmp_path, spec, 1)


def test_deepseek_v4_fp4_experts_and_e8m0_fp8_shared_expert(tmp_path: Path):
    """DeepSeek-V4 as released: per-expert int8 FP4 `weight` + E8M0 `scale` (format e, MXFP4's
    math), the shared expert FP8 with E8M0 block scales: the layer gets the codes as stored and
    the scales as fp32, exactly; an FP4 matrix of the wrong size names the tensor."""
    from moegen.quant import quantize_mxfp4

    e, i, h = 4, 64, 128
    spec = parse_spec({"name": "tiny-v4", "model": "org/tiny", "hidden_size": h,
                       "experts": {"count": e, "top_k": 2, "intermediate_size": i, "format": "mxfp4"},
                       "shared_expert": {"intermediate_size": i, "format": "fp8_block"}}, check_generated=False)
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    rng = np.random.default_rng()
    pre = "model.layers.1.ffn."
    tensors = {f"{pre}gate.weight": rng.standard_normal((e, h)).astype(BF16)}
    q = {}
    for x in range(e):
        for p, n, shape in (("gate_proj", "w1", (i, h)), ("up_proj", "w3", (i, h)), ("down_proj", "w2", (h, i))):
            q[x, p] = quantize_mxfp4(rng.standard_normal(shape).astype(np.float32))
            tensors[f"{pre}experts.{x}.{n}.weight"] = q[x, p].packed.view(np.int8)
            tensors[f"{pre}experts.{x}.{n}.scale"] = q[x, p].scale.view(ml_dtypes.float8_e8m0fnu)
    for n, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
        tensors[f"{pre}shared_experts.{n}.weight"] = rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn)
        tensors[f"{pre}shared_experts.{n}.weight_scale_inv"] = np.full((1, 1), 0.25, np.float32).astype(
            ml_dtypes.float8_e8m0fnu)
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    got = load_layer(tmp_path, spec, 1)
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert np.array_equal(got[f"experts.{p}"], np.stack([q[x, p].packed for x in range(e)])), p
        assert np.array_equal(got[f"experts.{p}_scale"], np.stack([q[x, p].scale for x in range(e)])), p
        assert got[f"shared_expert.{p}_scale_inv"].dtype == np.float32
        assert np.array_equal(got[f"shared_expert.{p}_scale_inv"], np.full((1, 1), 0.25, np.float32))
    tensors[f"{pre}experts.1.w2.weight"] = tensors[f"{pre}experts.1.w2.weight"][:, :16]
    tensors[f"{pre}experts.1.w2.scale"] = tensors[f"{pre}experts.1.w2.scale"][:, :1]
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ShapeError, match=r"experts\.1\.w2\.weight holds a \[128, 32\] FP4 matrix, expected \[128, 64\]"):
        load_layer(tmp_path, spec, 1)


def test_only_the_layers_shards_are_read(tmp_path: Path):
    """A shard that holds none of layer 1's tensors is never opened: corrupt it and load anyway."""
    spec = import_config(write_config(tmp_path, QWEN2), layer=1).spec
    w = canonical(spec, np.random.default_rng(1))
    tensors = stored(w, "per_expert", 1)
    other = {k: tensors.pop(k) for k in list(tensors) if "layers.1." not in k}
    safetensors_numpy.save_file(tensors, tmp_path / "model-00001-of-00002.safetensors")
    safetensors_numpy.save_file(other, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {**dict.fromkeys(tensors, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(other, "model-00002-of-00002.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"not a safetensors file")
    assert np.array_equal(load_layer(tmp_path, spec, 1)["experts.up_proj"].view(np.uint16),
                          w["experts.up_proj"].view(np.uint16))


def test_fp8_block_experts_keep_their_codes_and_scales(tmp_path: Path):
    cfg = {**QWEN2, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    spec = import_config(write_config(tmp_path, cfg), layer=1).spec
    tensors = stored(canonical(spec, np.random.default_rng(2)), "per_expert", 1)
    for k in [k for k in tensors if ".experts." in k]:
        tensors[k] = tensors[k].astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        tensors[k.replace(".weight", ".weight_scale_inv")] = np.full((1, 1), 0.5, np.float32)
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    got = load_layer(tmp_path, spec, 1)
    assert got["experts.gate_proj"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert got["experts.down_proj_scale_inv"].shape == (6, 1, 1)


def test_missing_tensor_and_wrong_shape_name_the_tensor_and_file(tmp_path: Path):
    spec = import_config(write_config(tmp_path, QWEN2), layer=1).spec
    tensors = stored(canonical(spec, np.random.default_rng(3)), "per_expert", 1)
    del tensors["model.layers.1.block_sparse_moe.experts.4.w3.weight"]
    f = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, f)
    with pytest.raises(MissingTensor) as info:
        load_layer(tmp_path, spec, 1)
    assert f"{tmp_path}: missing tensor model.layers.1.block_sparse_moe.experts.4.w3.weight [24, 40]" in one_line(info.value)
    tensors["model.layers.1.block_sparse_moe.experts.4.w3.weight"] = np.zeros((24, 41), BF16)
    safetensors_numpy.save_file(tensors, f)
    with pytest.raises(ShapeError) as info:
        load_layer(tmp_path, spec, 1)
    assert (f"{f}: model.layers.1.block_sparse_moe.experts.4.w3.weight has shape [24, 41], expected [24, 40]"
            in one_line(info.value))
    with pytest.raises(MissingTensor, match="no tensor of layer 5's MoE block"):
        load_layer(tmp_path, spec, 5)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_layer(tmp_path / "nope", spec, 1)


# ----------------------------------------------------------------------------- moegen check, no GPU


def test_check_without_gpu_validates_builds_and_says_gpu_skipped(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("MOEGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("moegen.check.gpu_unavailable_reason", lambda: "no CUDA device here")
    status = main(["check", str(ROOT / "specs" / "olmoe-1b-7b.yaml")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "validate     ok" in out and "build        ok" in out and "0 spill bytes" in out
    assert "gpu          skipped  no CUDA device here: the layer was validated and built, not run" in out
    assert out.rstrip().endswith("check PASSED (validate + build only: the GPU part was skipped): "
                                 f"{ROOT / 'specs' / 'olmoe-1b-7b.yaml'}")


def test_check_reads_the_checkpoint_without_a_gpu(tmp_path: Path, monkeypatch, capsys):
    """`check --weights` loads the layer's tensors and matches them to what the layer takes before
    (and without) the GPU part; a missing tensor fails that line, naming it."""
    monkeypatch.setenv("MOEGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("moegen.check.gpu_unavailable_reason", lambda: "no CUDA device here")
    spec_path = tmp_path / "tiny.yaml"
    cfg = {**QWEN2, "hidden_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    assert main(["spec", "import-hf", str(write_config(tmp_path, cfg)), "-o", str(spec_path), "--layer", "1"]) == 0
    spec = load_spec(spec_path)
    tensors = stored(canonical(spec, np.random.default_rng()), "per_expert", 1)
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    capsys.readouterr()
    assert main(["check", str(spec_path), "--weights", str(tmp_path), "--layer", "1"]) == 0
    out = capsys.readouterr().out
    assert f"weights      ok       {tmp_path} layer 1: " in out and "gpu          skipped" in out, out
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    assert main(["check", str(spec_path), "--weights", str(tmp_path), "--layer", "1"]) == 1
    out = capsys.readouterr().out
    assert "weights      FAILED" in out and "experts.3.w3.weight" in out and "gpu " not in out, out


def test_check_names_spilling_kernels_and_goes_on(tmp_path: Path, monkeypatch):
    """Another NVRTC may spill a few bytes where the pinned one spills none (NVRTC 13.0: 8 bytes in
    one of Qwen3-30B-A3B-MXFP4's down kernels on an H200): check names the kernel and the bytes and
    does not fail the layer for it."""
    import dataclasses

    from moegen import check
    from moegen.nvrtc import KernelResources

    real = check.build

    def spilling(spec_path: str, out_root: str):
        built = real(spec_path, out_root)
        res = dict(built.compiled.resources)
        name = min(res)
        res[name] = KernelResources(128, 0, 8, 4, 4)
        return dataclasses.replace(built, compiled=dataclasses.replace(built.compiled, resources=res))

    monkeypatch.setenv("MOEGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(check, "build", spilling)
    monkeypatch.setattr(check, "gpu_unavailable_reason", lambda: "no CUDA device here")
    status, report = run_check(str(ROOT / "specs" / "olmoe-1b-7b.yaml"))
    line = next(x for x in report.lines if x.startswith("build"))
    assert status == 0 and line.startswith("build        ok"), report.lines
    assert "8 spill bytes (NVRTC " in line and ": 8 bytes)" in line, line


def test_check_fails_on_a_bad_spec(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: m\nhidden_size: 64\nexperts: {count: 8, top_k: 9, intermediate_size: 32}\n")
    status, report = run_check(str(bad))
    assert status == 1 and report.lines[0].startswith("validate     FAILED") and "top_k=9" in report.lines[0]
    status, report = run_check(str(ROOT / "specs" / "olmoe-1b-7b.yaml"), weights="ckpt")
    assert status == 1 and "--weights needs --layer" in report.lines[0]


@pytest.mark.gpu
def test_check_on_gpu_passes_for_a_catalog_spec():
    status, report = run_check(str(ROOT / "specs" / "qwen3-30b-a3b.yaml"), tokens=[1, 7, 64])
    assert status == 0, "\n".join(report.lines)
    assert sum(line.startswith("reference    ok") for line in report.lines) == 3


def test_minimal_writes_only_non_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """--minimal: the style that writes no default at all (routing rule included)."""
    assert main(["spec", "import-hf", str(write_config(tmp_path, GLM)), "--model", "zai-org/GLM-4.5",
                 "--layer", "3", "--minimal"]) == 0
    body = capsys.readouterr().out.split("\n", 1)[1]
    assert body == ("name: glm-4.5\nmodel: zai-org/GLM-4.5\nhidden_size: 5120\nexperts:\n  count: 160\n  top_k: 8\n"
                    "  intermediate_size: 1536\nshared_expert:\n  intermediate_size: 1536\nrouting:\n  score: sigmoid\n"
                    "  renormalize: true\n  routed_scaling_factor: 2.5\n  correction_bias: true\n")
