"""Random weights for a layer in every format it takes, and the values the reference reads.

`random_weights(plan)` is what `moegen check` runs a layer on when no checkpoint is given, and what
the GPU tests use. The large values are drawn with PyTorch on the device (host NumPy takes minutes
for a DeepSeek-V4 layer's 6 G weights); quantized weights are drawn as they are stored (codes and
scales), so nothing is quantized on the host. The reference is given each weight's exact value as
its format defines it (moegen.formats), dequantized one expert at a time when it asks for one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .formats import FP8BlockWeight, MXFP4Weight, NVFP4Weight
from .plan import Plan
from .weights import tensors


class PerExpert:
    """A stacked quantized weight [E, R, K] as the reference reads it: [e] dequantizes expert e
    alone, in float64 (a large layer whole in float64 would not fit in host memory)."""

    def __init__(self, shape: tuple[int, ...], matrix: Callable[[int], np.ndarray]) -> None:
        self.shape, self._matrix = tuple(shape), matrix

    def __getitem__(self, e: int) -> np.ndarray:
        return self._matrix(e)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = np.stack([self._matrix(e) for e in range(self.shape[0])])
        return a if dtype is None else a.astype(dtype)


def _per_expert(shape: tuple[int, ...], matrix: Callable[[int], np.ndarray], whole: Callable[[], np.ndarray]) -> Any:
    """Expert e's float64 values on demand for stacked weights; a matrix without an expert axis
    (the shared expert's) dequantized at once."""
    return PerExpert(shape, matrix) if len(shape) == 3 else whole()


def host_bf16(t: Any) -> np.ndarray:
    """A PyTorch bf16 tensor's values on the host as ml_dtypes.bfloat16 (NumPy has no bf16 of its own)."""
    import torch

    return t.detach().view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)


def random_weights(plan: Plan, device: str = "cuda") -> tuple[dict[str, Any], dict[str, Any]]:
    """(what the layer is given, what the reference reads): random weights scaled so router logits
    and expert outputs are O(1).
    - bf16: N(0, 1/K), drawn on `device` in bf16 (the largest layers' fp32 would not fit); the
      reference reads the same values.
    - FP8 128x128 blocks: N(0, 1/K) quantized on `device` with scale = amax / 448 a block, one
      matrix at a time.
    - FP8 per-tensor: e4m3 codes of O(1) values, a weight scale a matrix, static input scales that
      leave some activations past +-448 steps (the saturation is exercised), gate's and up's equal.
    - MXFP4 / NVFP4: uniform random e2m1 codes (every code, -0 and +-6 included) and scales that
      make the values O(1/sqrt(K)).
    - The hash table: k distinct random experts a row. Norm weights around 1, biases small."""
    import torch

    rng = np.random.default_rng()
    want = tensors(plan)
    layer_w: dict[str, Any] = {}
    ref_w: dict[str, Any] = {}
    for name, (shape, dtype) in want.items():
        if name.endswith(("_scale_inv", "_scale", "_scale_2", "_input_scale")):  # made with their weight
            continue
        if f"{name}_input_scale" in want:
            _fp8_tensor(name, shape, layer_w, ref_w, device)
        elif dtype == "uint8":
            _fp4(name, shape, f"{name}_scale_2" in want, layer_w, ref_w, device)
        elif dtype == "int32":
            layer_w[name] = ref_w[name] = rng.random((shape[0], plan.experts)).argsort(1)[:, : shape[1]].astype(np.int32)
        elif dtype == "bfloat16":
            layer_w[name] = torch.randn(shape, device=device, dtype=torch.bfloat16).mul_(1 / math.sqrt(shape[-1]))
            ref_w[name] = host_bf16(layer_w[name])
        elif name.endswith("norm.weight"):
            layer_w[name] = ref_w[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif dtype == "float32":  # biases
            layer_w[name] = ref_w[name] = (0.1 * rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
        else:
            _fp8_block(name, shape, layer_w, ref_w, device)
    return layer_w, ref_w


def _fp8_block(name: str, shape: tuple[int, ...], layer_w: dict, ref_w: dict, device: str) -> None:
    """FP8 128x128 blocks, scale = amax / 448, written from the format's definition."""
    import torch

    codes, scales = [], []
    for _ in range(math.prod(shape[:-2])):
        w = torch.randn(shape[-2:], device=device) / math.sqrt(shape[-1])
        r, k = w.shape
        amax = w.reshape(r // 128, 128, k // 128, 128).abs().amax(dim=(-3, -1))
        scale = torch.clamp(amax, min=1e-12) / 448.0
        full = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)
        codes.append((w / full).to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy())
        scales.append(scale.cpu().numpy())
    q = np.stack(codes).reshape(shape).view(ml_dtypes.float8_e4m3fn)
    s = np.stack(scales).reshape(*shape[:-2], shape[-2] // 128, shape[-1] // 128)
    layer_w[name], layer_w[f"{name}_scale_inv"] = q, s
    ref_w[name] = _per_expert(shape, lambda e: FP8BlockWeight(q[e], s[e]).dequantize(),
                              lambda: FP8BlockWeight(q, s).dequantize())


def _fp8_tensor(name: str, shape: tuple[int, ...], layer_w: dict, ref_w: dict, device: str) -> None:
    """FP8 per-tensor weights as ModelOpt stores them: e4m3 codes of O(1) values, a weight scale a
    matrix around 1/(16 sqrt(K)), static input scales (gate's and up's equal: ModelOpt calibrates
    both on the same input, and the kernels quantize x once for both)."""
    import torch

    rng = np.random.default_rng()
    codes = (torch.randn(shape, device=device) * 16).to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy()
    codes = codes.view(ml_dtypes.float8_e4m3fn)
    w_scale = (rng.uniform(0.5, 1.0, shape[:-2]) / (16 * math.sqrt(shape[-1]))).astype(np.float32)
    in_scale = rng.uniform(2.0, 4.0, shape[:-2]).astype(np.float32) / 448.0
    other = {"gate_proj": "up_proj", "up_proj": "gate_proj"}
    twin = next((f"{name[: -len(m)]}{o}_input_scale" for m, o in other.items() if name.endswith(m)), "")
    if twin in layer_w:
        in_scale = layer_w[twin]
    layer_w[name], layer_w[f"{name}_scale"], layer_w[f"{name}_input_scale"] = codes, w_scale, in_scale
    ref_w[name] = _per_expert(shape, lambda e: codes[e].astype(np.float64) * np.float64(w_scale[e]),
                              lambda: codes.astype(np.float64) * np.float64(w_scale))
    ref_w[f"{name}_input_scale"] = in_scale


def _fp4(name: str, shape: tuple[int, ...], nv: bool, layer_w: dict, ref_w: dict, device: str) -> None:
    """MXFP4 / NVFP4 weights drawn as stored, and their exact values (moegen.formats)."""
    import torch

    rng = np.random.default_rng()
    k = 2 * shape[-1]
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, device=device).cpu().numpy()
    layer_w[name] = codes
    if nv:  # NVFP4: positive e4m3 scales in [1/4, 2), fp32 scale_2 a matrix
        scale = rng.integers(0x28, 0x40, (*shape[:-1], k // 16), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        s2 = (rng.uniform(0.5, 1.0, shape[:-2]) / (6 * math.sqrt(k))).astype(np.float32)
        layer_w[f"{name}_scale"], layer_w[f"{name}_scale_2"] = scale, s2
        ref_w[name] = _per_expert(
            (*shape[:-1], k), lambda e: NVFP4Weight(codes[e], scale[e], s2[e][..., None], (shape[-2],), k).dequantize(),
            lambda: NVFP4Weight(codes, scale, s2[..., None], (shape[-2],), k).dequantize())
    else:  # MXFP4: E8M0 scales around 1 / (6 sqrt(K))
        lo = 127 - math.ceil(math.log2(6 * math.sqrt(k)))
        scale = rng.integers(lo, lo + 3, (*shape[:-1], k // 32), dtype=np.uint8)
        layer_w[f"{name}_scale"] = scale
        ref_w[name] = _per_expert((*shape[:-1], k), lambda e: MXFP4Weight(codes[e], scale[e], k).dequantize(),
                                  lambda: MXFP4Weight(codes, scale, k).dequantize())
