"""One MoE layer's weights from a safetensors checkpoint, in moegen's canonical names.

A checkpoint is a single `.safetensors` file, or a directory with `model.safetensors`, with a
sharded `model.safetensors.index.json`, or with shards and no index. Only the asked layer's
tensors are read (safetensors' safe_open: the headers, then those tensors), so one layer of a
several-hundred-GB model loads in the time its own bytes take.

Both layouts transformers uses are read:
- one tensor per expert, as the published checkpoints store them and as transformers'
  save_pretrained writes them back (`experts.{e}.w1.weight` / `experts.{e}.gate_proj.weight`, ...);
- fused 3-D experts, as transformers 5 holds them in memory (`experts.gate_up_proj` [E, 2I, H]
  with gate rows first, `experts.down_proj` [E, H, I]), transposed ([E, H, 2I], [E, I, H]) for
  GPT-OSS and Llama-4, gate/up rows interleaved where the spec says so (GPT-OSS).

Canonical names (moegen.weights.expected, moegen.reference): `gate.weight` [E+Z, H], `gate.bias`,
`gate.e_score_correction_bias` [E+Z], `tid2eid` [vocab, k], `experts.{gate,up}_proj` [E, I, H],
`experts.down_proj` [E, H, I], their biases `experts.{gate,up}_proj_bias` [E, I] and
`experts.down_proj_bias` [E, H], `shared_expert.{gate,up,down}_proj`, `shared_expert_gate.weight`
[1, H]. Arrays keep the stored dtype (bf16 as ml_dtypes.bfloat16). FP8 block weights stay codes
with their `<name>_scale_inv` (what the runtime takes); GPT-OSS MXFP4 experts are dequantized to
bf16, which is exact (an e2m1 value times a power of two).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .spec import Spec

INDEX = "model.safetensors.index.json"
# The MoE block's module name, per family: mlp (most), block_sparse_moe (Mixtral and PhiMoE
# checkpoints), feed_forward (Llama-4), ffn (DeepSeek-V4's own names).
_BLOCK = r"(?:^|\.)layers\.{layer}\.(?:mlp|block_sparse_moe|feed_forward|ffn)\."
_ROUTER = ("gate.weight", "router.weight", "router.classifier.weight")
_ROUTER_BIAS = ("router.bias", "router.classifier.bias", "gate.bias")
_CORRECTION = ("gate.e_score_correction_bias", "router.e_score_correction_bias", "gate.bias")  # V4: gate.bias
_PROJ = {"gate_proj": ("gate_proj", "w1"), "up_proj": ("up_proj", "w3"), "down_proj": ("down_proj", "w2")}
_SHARED = ("shared_expert", "shared_experts", "shared_mlp")


# safetensors' NumPy backend has no FP8 dtypes (it asks numpy for them): those are read from the
# file directly, by the header's offsets, as ml_dtypes arrays.
_RAW = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu}


def _raw(f: Path, name: str) -> np.ndarray:
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        meta = json.loads(fh.read(n))[name]
        start, end = meta["data_offsets"]
        fh.seek(8 + n + start)
        data = np.frombuffer(fh.read(end - start), np.uint8)
    return data.view(_RAW[meta["dtype"]]).reshape(meta["shape"])


class CheckpointError(ValueError):
    """A checkpoint that cannot give the layer; one line naming the tensor and the file."""


class MissingTensor(CheckpointError):
    """A tensor the spec needs is not in the checkpoint."""


class ShapeError(CheckpointError):
    """A tensor has the wrong shape for the spec."""


def _files(path: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, from the index or the files' headers."""
    from safetensors import safe_open

    if path.is_file():
        shards = [path]
    elif (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path / INDEX}: not a safetensors index ({exc})") from None
        return {name: path / f for name, f in weight_map.items()}
    elif path.is_dir():
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{path}: no .safetensors file and no {INDEX}")
    else:
        raise CheckpointError(f"{path}: no such checkpoint (a .safetensors file or a directory)")
    out: dict[str, Path] = {}
    for f in shards:
        with safe_open(f, framework="numpy") as h:
            out.update(dict.fromkeys(h.keys(), f))
    return out


class _Layer:
    """The layer's tensors under their names local to the MoE block; opens each shard once."""

    def __init__(self, root: Path, files: dict[str, Path], layer: int, stack: ExitStack) -> None:
        pattern = re.compile(_BLOCK.format(layer=layer))
        self.root, self.layer, self._stack = root, layer, stack
        self.full: dict[str, str] = {}
        self.prefix = f"model.layers.{layer}.mlp."  # the block's name prefix, as this checkpoint spells it
        for name in files:
            m = pattern.search(name)
            if m:
                self.full[name[m.end():]] = name
                self.prefix = name[: m.end()]
        self.files = files
        self._open: dict[Path, Any] = {}
        if not self.full:
            raise MissingTensor(f"{root}: no tensor of layer {layer}'s MoE block "
                                f"(looked for '*layers.{layer}.{{mlp,block_sparse_moe,feed_forward,ffn}}.*')")

    def first(self, names: tuple[str, ...]) -> str | None:
        return next((n for n in names if n in self.full), None)

    def read(self, local: str, shape: tuple[int, ...] | None, what: str) -> np.ndarray:
        from safetensors import safe_open

        full = self.full.get(local)
        if full is None:
            want = f" {list(shape)}" if shape else ""
            raise MissingTensor(f"{self.root}: missing tensor {self.prefix}{local}{want} ({what})")
        f = self.files[full]
        if f not in self._open:
            if not f.is_file():
                raise MissingTensor(f"{f}: no such shard file (the index puts {full} there)")
            self._open[f] = self._stack.enter_context(safe_open(f, framework="numpy"))
        h = self._open[f]
        a = _raw(f, full) if h.get_slice(full).get_dtype() in _RAW else h.get_tensor(full)
        if shape is not None and tuple(a.shape) != shape:
            raise ShapeError(f"{f}: {full} has shape {list(a.shape)}, expected {list(shape)} ({what})")
        return a


@contextmanager
def _layer(path: str | Path, layer: int) -> Iterator[_Layer]:
    root = Path(path)
    with ExitStack() as stack:
        yield _Layer(root, _files(root), layer, stack)


def _one_of(t: _Layer, names: tuple[str, ...], shape: tuple[int, ...], what: str) -> np.ndarray:
    return t.read(t.first(names) or names[0], shape, what)


def _split(w: np.ndarray, interleaved: bool, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """gate, up halves of a fused gate_up tensor along `axis` (rows interleaved or stacked)."""
    n = w.shape[axis] // 2
    if interleaved:  # GPT-OSS: even rows gate, odd rows up
        idx = (np.arange(0, 2 * n, 2), np.arange(1, 2 * n, 2))
    else:
        idx = (np.arange(n), np.arange(n, 2 * n))
    return tuple(np.ascontiguousarray(np.take(w, i, axis=axis)) for i in idx)


def _fused(t: _Layer, spec: Spec, transposed: bool) -> dict[str, np.ndarray]:
    e, i, h = spec.experts.count, spec.experts.intermediate_size, spec.hidden_size
    inter = spec.experts.activation.interleaved_gate_up
    gu = t.read("experts.gate_up_proj", None, "fused gate/up experts")
    lead = gu.shape[0] in (e, e + spec.experts.zero_experts)  # LongCat keeps E+Z rows, zero experts unused
    if transposed and lead and gu.shape[1:] == (h, 2 * i):
        gu = np.swapaxes(gu, 1, 2)
    elif not (lead and gu.shape[1:] == (2 * i, h)):
        want = [e, h, 2 * i] if transposed else [e, 2 * i, h]
        raise ShapeError(f"{t.files[t.full['experts.gate_up_proj']]}: {t.full['experts.gate_up_proj']} has shape "
                         f"{list(gu.shape)}, expected {want} (E, 2I, H as the spec says)")
    out = dict(zip(("experts.gate_proj", "experts.up_proj"), _split(gu[:e], inter, 1)))
    down = t.read("experts.down_proj", (e, i, h) if transposed else (e, h, i), "fused down experts")
    out["experts.down_proj"] = np.ascontiguousarray(np.swapaxes(down, 1, 2) if transposed else down)
    if spec.experts.bias:
        gub = t.read("experts.gate_up_proj_bias", (e, 2 * i), "fused gate/up biases")
        out.update(zip(("experts.gate_proj_bias", "experts.up_proj_bias"), _split(gub, inter, 1)))
        out["experts.down_proj_bias"] = t.read("experts.down_proj_bias", (e, h), "down biases")
    return out


def _mxfp4(t: _Layer, spec: Spec) -> dict[str, np.ndarray]:
    from .quant import load_gpt_oss_experts

    names = ["gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"]
    if spec.experts.bias:
        names += ["gate_up_proj_bias", "down_proj_bias"]
    x = load_gpt_oss_experts({n: t.read(f"experts.{n}", None, "MXFP4 experts") for n in names},
                             bias=spec.experts.bias)
    mats = (("gate", x.gate), ("up", x.up), ("down", x.down))
    if spec.experts.format.value == "mxfp4":  # kept as stored: codes and E8M0 scales, de-interleaved
        out = {f"experts.{p}_proj": m.packed for p, m in mats}
        out.update({f"experts.{p}_proj_scale": m.scale for p, m in mats})
    else:  # a BF16 spec of an MXFP4 checkpoint: the exact values, each a bf16 value
        out = {f"experts.{p}_proj": m.dequantize(np.float32).astype(ml_dtypes.bfloat16) for p, m in mats}
    if spec.experts.bias:
        out.update({"experts.gate_proj_bias": x.gate_bias, "experts.up_proj_bias": x.up_bias,
                    "experts.down_proj_bias": x.down_bias})
    return out


def _nvfp4(t: _Layer, prefix: str, shape: tuple[int, int], what: str) -> tuple[np.ndarray, ...]:
    """ModelOpt NVFP4 `{prefix}.weight` / `.weight_scale` / `.weight_scale_2` as stored (checked by
    moegen.quant.load_nvfp4): codes [R, K/2], e4m3 scales [R, K/16], scale_2 (a scalar)."""
    from .quant import load_nvfp4

    parts = {f"{prefix}.{k}": t.read(f"{prefix}.{k}", None, what) for k in ("weight", "weight_scale", "weight_scale_2")}
    w = load_nvfp4(parts, f"{prefix}.")
    _fp4_shape(t, prefix, (w.packed.shape[0], w.k), shape, what, "NVFP4", "uint8")
    return w.packed, w.scale, w.scale_2[0]


def _fp8_tensor(t: _Layer, prefix: str, shape: tuple[int, int], what: str) -> tuple[np.ndarray, ...]:
    """ModelOpt FP8 per-tensor (format d) `{prefix}.weight` e4m3 [R, K] / `.weight_scale` /
    `.input_scale` as stored (checked by moegen.quant.load_fp8_tensor): the kernels quantize their
    inputs by the static input scale, so it is required."""
    from .quant import load_fp8_tensor

    parts = {f"{prefix}.{k}": t.read(f"{prefix}.{k}", shape if k == "weight" else None, what)
             for k in ("weight", "weight_scale", "input_scale")}
    w = load_fp8_tensor(parts, f"{prefix}.")
    return w.q, w.scale, w.input_scale


def _fp4_shape(t: _Layer, prefix: str, got: tuple[int, int], shape: tuple[int, int], what: str, fmt: str,
               stored: str) -> None:
    """An FP4 matrix of the wrong size names its tensor, the size it holds and the form expected."""
    if got != shape:
        full = t.full[f"{prefix}.weight"]
        raise ShapeError(f"{t.files[full]}: {full} holds a [{got[0]}, {got[1]}] {fmt} matrix, expected "
                         f"{list(shape)} ({what}: {stored} [{shape[0]}, {shape[1] // 2}])")


def _per_expert(t: _Layer, spec: Spec) -> dict[str, np.ndarray]:
    e, i, h = spec.experts.count, spec.experts.intermediate_size, spec.hidden_size
    out = {}
    for proj, aliases in _PROJ.items():
        shape = (h, i) if proj == "down_proj" else (i, h)
        name = next((a for a in aliases if f"experts.0.{a}.weight" in t.full), aliases[0])
        if spec.experts.format.value == "nvfp4":  # kept as stored, gate and up each with its scale_2
            parts = [_nvfp4(t, f"experts.{x}.{name}", shape, f"expert {x} {proj}") for x in range(e)]
            for suffix, j in (("", 0), ("_scale", 1), ("_scale_2", 2)):
                out[f"experts.{proj}{suffix}"] = np.stack([p[j] for p in parts])
            continue
        if spec.experts.format.value == "fp8_tensor":  # ModelOpt FP8: codes, weight and input scales
            parts = [_fp8_tensor(t, f"experts.{x}.{name}", shape, f"expert {x} {proj}") for x in range(e)]
            for suffix, j in (("", 0), ("_scale", 1), ("_input_scale", 2)):
                out[f"experts.{proj}{suffix}"] = np.stack([p[j] for p in parts])
            continue
        if spec.experts.format.value == "mxfp4":  # DeepSeek-V4 FP4 per expert: kept as stored
            parts = [_fp4_e8m0(t, f"experts.{x}.{name}", shape, f"expert {x} {proj}") for x in range(e)]
            out[f"experts.{proj}"] = np.stack([p.packed for p in parts])
            out[f"experts.{proj}_scale"] = np.stack([p.scale for p in parts])
            continue
        mats = [t.read(f"experts.{x}.{name}.weight", shape, f"expert {x} {proj}") for x in range(e)]
        out[f"experts.{proj}"] = np.stack(mats)
        if f"experts.0.{name}.weight_scale_inv" in t.full:  # FP8 block checkpoints (format a)
            out[f"experts.{proj}_scale_inv"] = np.stack(
                [_fp32_scales(t.read(f"experts.{x}.{name}.weight_scale_inv", None, f"expert {x} {proj} FP8 scales"))
                 for x in range(e)])
    return out


def _fp32_scales(s: np.ndarray) -> np.ndarray:
    """FP8 block scales as float32: DeepSeek-V4 stores them as E8M0 (powers of two), exactly."""
    return s.astype(np.float32) if s.dtype != np.float32 else s


def _fp4_e8m0(t: _Layer, prefix: str, shape: tuple[int, int], what: str) -> Any:
    """DeepSeek-V4 FP4 (format e) `{prefix}.weight` int8 [R, K/2] + E8M0 scales [R, K/32], named
    `.scale` (DeepSeek's inference code) or `.weight_scale_inv`, checked by moegen.quant.load_dsv4_fp4."""
    from .quant import load_dsv4_fp4

    sname = next((n for n in ("scale", "weight_scale_inv") if f"{prefix}.{n}" in t.full), "scale")
    parts = {f"{prefix}.{k}": t.read(f"{prefix}.{k}", None, what) for k in ("weight", sname)}
    w = load_dsv4_fp4(parts, f"{prefix}.", scale_name=sname)
    _fp4_shape(t, prefix, (w.packed.shape[0], w.k), shape, what, "FP4", "int8")
    return w


def _shared(t: _Layer, spec: Spec) -> dict[str, np.ndarray]:
    s, h = spec.shared_expert.intermediate_size, spec.hidden_size
    prefix = next((p for p in _SHARED if any(k.startswith(p + ".") for k in t.full)), _SHARED[0])
    out = {}
    for proj, aliases in _PROJ.items():
        name = next((a for a in aliases if f"{prefix}.{a}.weight" in t.full), aliases[0])
        shape = (h, s) if proj == "down_proj" else (s, h)
        if spec.shared_expert.format.value == "nvfp4":
            w, sc, s2 = _nvfp4(t, f"{prefix}.{name}", shape, f"shared expert {proj}")
            out.update({f"shared_expert.{proj}": w, f"shared_expert.{proj}_scale": sc,
                        f"shared_expert.{proj}_scale_2": s2})
            continue
        if spec.shared_expert.format.value == "fp8_tensor":
            w, sc, si = _fp8_tensor(t, f"{prefix}.{name}", shape, f"shared expert {proj}")
            out.update({f"shared_expert.{proj}": w, f"shared_expert.{proj}_scale": sc,
                        f"shared_expert.{proj}_input_scale": si})
            continue
        out[f"shared_expert.{proj}"] = t.read(f"{prefix}.{name}.weight", shape, f"shared expert {proj}")
        if f"{prefix}.{name}.weight_scale_inv" in t.full:
            out[f"shared_expert.{proj}_scale_inv"] = _fp32_scales(
                t.read(f"{prefix}.{name}.weight_scale_inv", None, "FP8 scales"))
    if spec.shared_expert.gate == "sigmoid":
        out["shared_expert_gate.weight"] = t.read("shared_expert_gate.weight", (1, h), "shared expert gate")
    return out


def _transposed(path: Path, family: str | None) -> bool:
    """Whether fused experts are stored x @ W ([E, H, 2I]): the family's convention."""
    from .hf import FAMILIES, family_of, read_config

    if family is None:
        cfg = (path if path.is_dir() else path.parent) / "config.json"
        if not cfg.is_file():
            return False
        family = family_of(read_config(cfg), str(cfg))[0]
    return FAMILIES[family].fused_transposed


def load_layer(path: str | Path, spec: Spec, layer: int, family: str | None = None) -> dict[str, np.ndarray]:
    """The weights of MoE layer `layer` that `spec` needs, by canonical name (module docstring).

    `family` (a moegen.hf family key) tells the stored orientation of fused experts; by default
    it is read from the config.json beside the checkpoint.
    """
    scored, h = spec.experts.count + spec.experts.zero_experts, spec.hidden_size
    r = spec.routing
    with _layer(path, layer) as t:
        out = {"gate.weight": _one_of(t, _ROUTER, (scored, h), "router")}
        if spec.router.bias:
            out["gate.bias"] = _one_of(t, _ROUTER_BIAS, (scored,), "router bias")
        if r.correction_bias:
            out["gate.e_score_correction_bias"] = _one_of(t, _CORRECTION, (scored,), "selection correction bias")
        if r.hash_vocab_size is not None:
            out["tid2eid"] = t.read("gate.tid2eid", (r.hash_vocab_size, spec.experts.top_k), "hash routing table")
        if "experts.gate_up_proj" in t.full:
            out.update(_fused(t, spec, _transposed(Path(path), family)))
        elif "experts.gate_up_proj_blocks" in t.full:
            out.update(_mxfp4(t, spec))
        else:
            out.update(_per_expert(t, spec))
        if spec.shared_expert is not None:
            out.update(_shared(t, spec))
    return out


__all__ = ["CheckpointError", "MissingTensor", "ShapeError", "load_layer"]
