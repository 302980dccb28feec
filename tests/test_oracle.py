"""Oracle tier: moegen's whole import path against transformers' own MoE blocks.

For every family the installed transformers implements: a tiny randomly initialized model
(odd sizes: hidden 72 or 160, 60 experts for Qwen2-MoE, zero experts for LongCat), saved with
save_pretrained (bf16 safetensors, sharded), its config imported with moegen.hf, its MoE layer
loaded with moegen.checkpoint, and moegen.reference.moe_forward compared with the transformers
block's forward on the same bf16-representable input, per row. transformers runs in float64
on CPU; where its code casts to float32 itself (router logits / softmax in most families) the
error is float32 rounding, ~1e-7, so one tolerance (1e-5 per row) holds for every family.
The GPU variant builds the layer with moegen for families the generator produces and compares
the device output with transformers at N = 1, 7, 64 (bf16: 1e-2 per row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from moegen import reference
from moegen.checkpoint import load_layer
from moegen.hf import import_config
from moegen.spec import Spec, not_generated

torch = pytest.importorskip("torch", reason="the oracle tier needs PyTorch (pip install torch)")
transformers = pytest.importorskip("transformers", reason="the oracle tier needs transformers")
pytest.importorskip("safetensors", reason="the oracle tier needs safetensors")

ROW_TOL = 1e-5  # float64 on both sides, float32 where transformers casts: ~1e-7 measured
GPU_ROW_TOL = 1e-2  # DESIGN.md: bf16 outputs
TIE = 1e-6  # rows whose routing decision is this close to flipping are not compared
_COMMON = {"vocab_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 64}
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}


@dataclass(frozen=True)
class Family:
    config: str  # transformers class names
    model: str
    kwargs: dict[str, Any]
    layers: tuple[int, ...] = (1,)  # the MoE layers to check
    module: str = "mlp"  # the MoE block's attribute on the decoder layer
    extra: dict[str, Any] = field(default_factory=dict)


def _sizes(h: int, i: int, s: int) -> dict[str, int]:
    return {"hidden_size": h, "moe_intermediate_size": i, "intermediate_size": s}


FAMILIES = {
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM",
                      {"hidden_size": 72, "intermediate_size": 40, "num_local_experts": 6, "head_dim": 16}),
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                        {**_sizes(72, 24, 48), "shared_expert_intermediate_size": 56, "num_experts": 60,
                         "num_experts_per_tok": 4}),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        {**_sizes(72, 24, 48), "num_experts": 10, "num_experts_per_tok": 3, "norm_topk_prob": True,
                         "head_dim": 16}),
    "qwen3_next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM",
                         {**_sizes(72, 24, 48), "shared_expert_intermediate_size": 40, "num_experts": 12,
                          "num_experts_per_tok": 3, "head_dim": 16, "linear_key_head_dim": 8,
                          "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 2}),
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM",
                    {"hidden_size": 72, "intermediate_size": 24, "num_experts": 10, "num_experts_per_tok": 3,
                     "eos_token_id": 1, "pad_token_id": 0}),
    "deepseek_v2": Family("DeepseekV2Config", "DeepseekV2ForCausalLM",
                          {**_sizes(72, 24, 48), "n_routed_experts": 10, "num_experts_per_tok": 3,
                           "n_shared_experts": 2, "first_k_dense_replace": 1, "topk_method": "greedy",
                           "routed_scaling_factor": 1.5, **_MLA}),
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM",
                          {**_sizes(72, 24, 48), "n_routed_experts": 16, "num_experts_per_tok": 4,
                           "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
                           "routed_scaling_factor": 2.5, **_MLA}),
    "glm4_moe": Family("Glm4MoeConfig", "Glm4MoeForCausalLM",
                       {**_sizes(72, 24, 48), "n_routed_experts": 10, "num_experts_per_tok": 3,
                        "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                        "head_dim": 16}),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM",
                      {"hidden_size": 72, "intermediate_size": 40, "num_local_experts": 6, "num_experts_per_tok": 2,
                       "head_dim": 16}),
    "llama4": Family("Llama4TextConfig", "Llama4ForCausalLM",
                     {"hidden_size": 72, "intermediate_size": 40, "intermediate_size_mlp": 48,
                      "num_local_experts": 6, "num_experts_per_tok": 1, "head_dim": 16,
                      "interleave_moe_layer_step": 2}, module="feed_forward"),
    "phimoe": Family("PhimoeConfig", "PhimoeForCausalLM",
                     {"hidden_size": 72, "intermediate_size": 40, "num_local_experts": 6, "head_dim": 16}),
    "longcat_flash": Family("LongcatFlashConfig", "LongcatFlashForCausalLM",
                            {"hidden_size": 72, "ffn_hidden_size": 48, "expert_ffn_hidden_size": 24,
                             "n_routed_experts": 8, "zero_expert_num": 4, "moe_topk": 3, "num_layers": 1,
                             "head_dim": 8, **_MLA}, layers=(0,)),
    "deepseek_v4": Family("DeepseekV4Config", "DeepseekV4ForCausalLM",
                          {"hidden_size": 72, "moe_intermediate_size": 24, "n_routed_experts": 8,
                           "num_experts_per_tok": 2, "num_hidden_layers": 4, "head_dim": 16, "q_lora_rank": 24,
                           "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 8,
                           "index_topk": 4, "sliding_window": 8, "hc_mult": 2,
                           "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"]}, layers=(1, 2)),
}
CASES = [(f, L) for f, fam in FAMILIES.items() for L in fam.layers]


def _classes(fam: Family) -> tuple[Any, Any]:
    cfg, model = getattr(transformers, fam.config, None), getattr(transformers, fam.model, None)
    if cfg is None or model is None:
        pytest.skip(f"transformers {transformers.__version__} has no {fam.model}")
    return cfg, model


def _randomize(block: Any, gen: Any) -> None:
    """O(1) logits and outputs: weights ~ N(0, 1/fan_in); biases, correction biases and the
    hash table random too, so none of them can be silently ignored."""
    with torch.no_grad():
        for name, p in [*block.named_parameters(), *block.named_buffers()]:
            if name.endswith("tid2eid"):
                rows = [torch.randperm(p.shape[1] * 4, generator=gen)[: p.shape[1]] % 8 for _ in range(p.shape[0])]
                p.copy_(torch.stack(rows))
            elif p.dim() >= 2:  # fused experts may be stored [E, in, out]: scale by the larger side
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(max(p.shape[-2:]) if p.dim() == 3 else p.shape[-1]))
            elif p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if "correction" in name else 0.5))


@dataclass
class Built:
    model: Any
    fam: Family
    dir: Path


def build(family: str, tmp: Path, seed: int = 0, overrides: dict[str, Any] | None = None,
          shard: str | None = "40KB") -> Built:
    """A tiny random model of the family, saved (bf16, sharded) with save_pretrained."""
    fam = FAMILIES[family]
    cfg_cls, model_cls = _classes(fam)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**_COMMON, **fam.kwargs, **(overrides or {})})
    cfg._experts_implementation = "eager"  # the loop over experts: any dtype, float64 too
    model = model_cls(cfg).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    for L in fam.layers:
        _randomize(getattr(model.model.layers[L], fam.module), gen)
    model = model.to(torch.bfloat16)  # bf16 weights, as the published checkpoints
    model.save_pretrained(tmp, **({"max_shard_size": shard} if shard else {}))
    return Built(model, fam, tmp)


def block_forward(b: Built, layer: int, x: np.ndarray, token_ids: np.ndarray | None) -> np.ndarray:
    """The transformers MoE block of `layer`, in float64, on x [N, H]."""
    block = getattr(b.model.model.layers[layer], b.fam.module).to(torch.float64)
    xt = torch.from_numpy(x.astype(np.float64)).view(1, *x.shape)
    with torch.no_grad():
        if token_ids is not None:
            out = block(xt, input_ids=torch.from_numpy(token_ids).view(1, -1))
        else:
            out = block(xt)
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(x.shape).numpy()


def row_errors(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.linalg.norm(got - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)


def _inputs(spec: Spec, n: int, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, spec.hidden_size)).astype(ml_dtypes.bfloat16)
    vocab = spec.routing.hash_vocab_size
    return x, (rng.integers(0, vocab, n) if vocab else None)


def oracle(family: str, layer: int, tmp: Path, n: int = 64) -> tuple[Spec, np.ndarray, int]:
    b = build(family, tmp)
    spec = import_config(tmp / "config.json", layer=layer, model=f"tiny/{family}").spec
    weights = load_layer(tmp, spec, layer)
    x, tok = _inputs(spec, n, seed=layer + 1)
    want = block_forward(b, layer, x, tok)
    r = reference.route(spec, x, weights, tok)
    keep = r.margin >= TIE
    got = reference.moe_forward(spec, x, weights, tok)
    return spec, row_errors(got[keep], want[keep]), int(keep.sum())


@pytest.mark.parametrize("family,layer", CASES, ids=[f"{f}-L{L}" for f, L in CASES])
def test_reference_matches_transformers(family: str, layer: int, tmp_path: Path):
    _, err, compared = oracle(family, layer, tmp_path)
    assert compared >= 60, f"{family}: only {compared} of 64 rows away from routing near-ties"
    worst = int(np.argmax(err))
    assert err[worst] <= ROW_TOL, f"{family} layer {layer}: row {worst} relative error {err[worst]:.2e}"
    print(f"{family} L{layer}: max row error {err.max():.2e} over {compared} rows")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_layout_loads_the_same(family: str, tmp_path: Path):
    """transformers' in-memory names (fused 3-D experts, renamed routers) give the same arrays as
    the per-expert names save_pretrained writes."""
    from safetensors.torch import save_file

    b = build(family, tmp_path / "saved", shard=None)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((b.dir / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in b.model.state_dict().items()}, fused / "model.safetensors")
    layer = b.fam.layers[-1]
    spec = import_config(b.dir / "config.json", layer=layer, model=f"tiny/{family}").spec
    want, got = load_layer(b.dir, spec, layer), load_layer(fused, spec, layer)
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.array_equal(np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)), k


def test_a_wrong_weight_is_caught(tmp_path: Path):
    """The comparison is not vacuous: one perturbed expert row moves the error past the tolerance."""
    b = build("qwen2_moe", tmp_path)
    spec = import_config(tmp_path / "config.json", layer=1, model="tiny/qwen2_moe").spec
    weights = load_layer(tmp_path, spec, 1)
    x, _ = _inputs(spec, 64, 2)
    want = block_forward(b, 1, x, None)
    weights["experts.down_proj"] = weights["experts.down_proj"].astype(np.float64)
    weights["experts.down_proj"][:, 0, :] *= 1.01
    assert row_errors(reference.moe_forward(spec, x, weights), want).max() > ROW_TOL


# ----------------------------------------------------------------------------- GPU variant

GPU_SIZES = {"hidden_size": 160}  # a multiple of 32 (the bf16 kernels) but not of 128


@pytest.mark.gpu
@pytest.mark.parametrize("family", [f for f, fam in FAMILIES.items()])
def test_generated_layer_matches_transformers(family: str, tmp_path: Path):
    from moegen.build import render_all, write_dir
    from moegen.plan import make_plan
    from moegen.runtime import load

    fam = FAMILIES[family]
    inter = {k: 64 for k in ("intermediate_size", "moe_intermediate_size", "expert_ffn_hidden_size")
             if k in fam.kwargs}
    shared = {"shared_expert_intermediate_size": 96} if "shared_expert_intermediate_size" in fam.kwargs else {}
    b = build(family, tmp_path / "ckpt", overrides={**GPU_SIZES, **inter, **shared})
    layer = fam.layers[-1]
    spec = import_config(b.dir / "config.json", layer=layer, model=f"tiny/{family}").spec
    missing = not_generated(spec)
    if missing:
        pytest.skip(f"{family}: the generator does not produce it yet: {'; '.join(missing)}")
    out_dir = tmp_path / "gen" / spec.name
    write_dir(out_dir, render_all(spec, make_plan(spec)))
    weights = load_layer(b.dir, spec, layer)
    gpu = load(out_dir, weights)
    for n in (1, 7, 64):
        x, tok = _inputs(spec, n, seed=n)
        want = block_forward(b, layer, x, tok)
        keep = reference.route(spec, x, weights, tok).margin >= 1e-4  # fp32 kernels may flip closer ties
        xd = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
        out = torch.full_like(xd, float("nan"))
        gpu(xd, out=out, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        got = out.float().cpu().numpy().astype(np.float64)
        err = row_errors(got[keep], want[keep])
        assert np.isfinite(got).all() and err.max() <= GPU_ROW_TOL, f"{family} N={n}: row error {err.max():.2e}"
