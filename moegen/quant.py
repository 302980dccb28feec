"""Quantized expert weights on the host: quantizers, activation emulation, checkpoint loaders.

The formats are shared/MODELS.md "Weight formats" a-e; their containers and element codecs
live in formats.py (re-exported here). Every quantizer takes [..., N, K] (N output rows, K
input columns; leading axes such as experts are independent matrices) and returns a container;
every loader takes the tensors as a checkpoint stores them (NumPy arrays), validates them and
returns the same container, never re-quantizing. Blocks not aligned to the block size are
zero-padded: FP8 containers keep the original [N, K] codes; FP4 containers keep the padded
bytes and the logical K (`k`).

Recipes (where the published definition leaves a choice; all arithmetic is float32, as the
published code does it, and every rounding is one RNE ml_dtypes cast):
- a. FP8 block: s = max(amax, 1e-4) / 448 per 128x128 block (DeepGEMM's per_block_cast_to_fp8:
  the same floor as the activations); ue8m0: s rounded UP to a power of two, exactly;
  q = e4m3(W / s) (a division; DeepGEMM multiplies by 1/s, which can differ in the last bit).
- d. FP8 per tensor: s = amax / 448 (ModelOpt); an all-zero matrix gets s = 1.
- b. NVFP4 (ModelOpt NVFP4QTensor): scale_2 = amax(W) / (6 * 448) per matrix (1 if W is all
  zero); block scale = e4m3(amax(block) / (6 * scale_2)), with 1.0 for an all-zero block;
  codes = e2m1(W / (float32(block scale) * scale_2)). Deviation: where the e4m3 block scale
  underflows to 0 (a block below ~2^-10 of the tensor's amax / 448), ModelOpt divides by zero;
  here its codes are 0 (it dequantizes to 0 either way).
- c/e. MXFP4, OCP MX v1.0 sec. 6.3: X = floor(log2(amax(block))) - 2 (emax of e2m1), clamped to
  [-127, 127]; an all-zero block gets X = -127 (byte 0, as Microsoft's microxcaling reference);
  codes = e2m1(V / 2^X), saturating: elements in (6, 8) * 2^X become +-6. scale_rule="ceil"
  instead takes X = ceil(log2(amax / 6)) (no saturation; ModelOpt's MXFP4QTensor does this).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import ml_dtypes
import numpy as np

from .formats import (
    E2M1_EMAX,
    E2M1_MAX,
    E4M3,
    E4M3_MAX,
    E8M0,
    E8M0_BIAS,
    E8M0_NAN,
    FP8_BLOCK,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    FP8BlockWeight,
    FP8TensorWeight,
    GptOssExperts,
    MXFP4Weight,
    NibbleOrder,
    NVFP4Weight,
    QuantError,
    as_float32,
    ceil_log2,
    e2m1_encode,
    e4m3_encode,
    floor_log2,
    pack_nibbles,
    pad_axis,
    ue8m0_ceil,
    unpack_nibbles,
)

__all__ = [
    "FP8BlockWeight",
    "FP8TensorWeight",
    "GptOssExperts",
    "MXFP4Weight",
    "NVFP4Weight",
    "QuantError",
    "dsv4_fp4_tensors",
    "fp8_block_activations",
    "fp8_input_scale",
    "fp8_tensor_activations",
    "fuse_rows",
    "load_dsv4_fp4",
    "load_fp8_block",
    "load_fp8_tensor",
    "load_gpt_oss_experts",
    "load_nvfp4",
    "load_nvfp4_gate_up",
    "quantize_fp8_block",
    "quantize_fp8_tensor",
    "quantize_mxfp4",
    "quantize_nvfp4",
]

ACT_AMAX_FLOOR = 1e-4  # MODELS.md format a: s = max(amax, 1e-4) / 448
_F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _blocks_k(w: np.ndarray, block: int) -> np.ndarray:
    """[..., N, K] -> [..., N, ceil(K/block), block], zero-padded."""
    p = pad_axis(w, -1, block)
    return p.reshape(*p.shape[:-1], p.shape[-1] // block, block)


# ----------------------------------------------------------------------------- quantizers


def quantize_fp8_block(w: np.ndarray, *, ue8m0: bool = False, amax_floor: float = ACT_AMAX_FLOOR) -> FP8BlockWeight:
    """Format a: e4m3 codes and one float32 scale per 128x128 block (module docstring)."""
    w = as_float32(w, "w")
    n, k = w.shape[-2:]
    p = pad_axis(pad_axis(w, -1, FP8_BLOCK), -2, FP8_BLOCK)
    nb, kb = p.shape[-2] // FP8_BLOCK, p.shape[-1] // FP8_BLOCK
    p = p.reshape(*p.shape[:-2], nb, FP8_BLOCK, kb, FP8_BLOCK)
    s = np.maximum(np.abs(p).max(axis=(-3, -1)), _F32(amax_floor)) / _F32(E4M3_MAX)
    if ue8m0:
        s = ue8m0_ceil(s)
    q = e4m3_encode(p / s[..., :, None, :, None]).reshape(*w.shape[:-2], nb * FP8_BLOCK, kb * FP8_BLOCK)
    return FP8BlockWeight(np.ascontiguousarray(q[..., :n, :k]), s.astype(np.float32), ue8m0)


def _per_matrix_scale(amax: np.ndarray, divisor: float) -> np.ndarray:
    s = (amax / _F32(divisor)).astype(np.float32)
    return np.where(s > 0, s, _F32(1))  # all-zero (or subnormal-only) matrix: any scale works


def quantize_fp8_tensor(w: np.ndarray, *, input_scale: float | None = None) -> FP8TensorWeight:
    """Format d: e4m3 codes and one float32 scale per matrix (amax / 448)."""
    w = as_float32(w, "w")
    s = _per_matrix_scale(np.abs(w).max(axis=(-2, -1)), E4M3_MAX)
    q = e4m3_encode(w / s[..., None, None])
    return FP8TensorWeight(q, s, None if input_scale is None else np.array(input_scale, np.float32))


def quantize_nvfp4(w: np.ndarray, *, scale_2: float | np.ndarray | None = None) -> NVFP4Weight:
    """Format b, ModelOpt's recipe (module docstring). scale_2: impose a global scale ([...] or
    scalar) instead of amax / 2688; block scales then saturate at 448 and codes at 6."""
    w = as_float32(w, "w")
    n, k = w.shape[-2:]
    if scale_2 is None:
        s2 = _per_matrix_scale(np.abs(w).max(axis=(-2, -1)), E2M1_MAX * E4M3_MAX)
    else:
        s2 = np.broadcast_to(np.asarray(scale_2, np.float32), w.shape[:-2])
        if not (np.isfinite(s2) & (s2 > 0)).all():
            raise QuantError("scale_2: expected finite positive float32 values")
    blk = _blocks_k(w, NVFP4_BLOCK)
    s2b = s2[..., None, None]
    bs = np.abs(blk).max(axis=-1) / (_F32(E2M1_MAX) * s2b)  # float32 divisor, as ModelOpt
    scale = e4m3_encode(np.where(bs == 0, _F32(1), bs))
    denom = (scale.astype(np.float32) * s2b)[..., None]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scaled = np.where(denom > 0, blk / denom, _F32(0))
    codes = e2m1_encode(scaled).reshape(*w.shape[:-1], -1)
    return NVFP4Weight(pack_nibbles(codes), scale, s2[..., None].astype(np.float32), (n,), k)


def quantize_mxfp4(w: np.ndarray, *, scale_rule: Literal["ocp", "ceil"] = "ocp") -> MXFP4Weight:
    """Formats c/e: e2m1 codes, one E8M0 scale byte per 32 along K (module docstring)."""
    w = as_float32(w, "w")
    blk = _blocks_k(w, MXFP4_BLOCK)
    amax = np.abs(blk).max(axis=-1)
    nz = amax > 0
    safe = np.where(nz, amax, _F32(1))
    if scale_rule == "ocp":
        x = floor_log2(safe) - E2M1_EMAX
    elif scale_rule == "ceil":
        x = ceil_log2((safe / _F32(E2M1_MAX)).astype(np.float32))
    else:
        raise QuantError(f"scale_rule: {scale_rule!r}, expected 'ocp' or 'ceil'")
    x = np.clip(np.where(nz, x, -E8M0_BIAS), -E8M0_BIAS, E8M0_BIAS).astype(np.int32)
    scaled = np.ldexp(blk, -x[..., None]).astype(np.float32)  # exact: a power-of-two scale
    codes = e2m1_encode(scaled).reshape(*w.shape[:-1], -1)
    return MXFP4Weight(pack_nibbles(codes), (x + E8M0_BIAS).astype(np.uint8), w.shape[-1])


def fuse_rows(*parts: NVFP4Weight) -> NVFP4Weight:
    """Stack NVFP4 matrices along N (e.g. gate then up), each keeping its own scale_2 exactly."""
    k, lead = parts[0].k, parts[0].packed.shape[:-2]
    for p in parts:
        if p.k != k or p.packed.shape[:-2] != lead:
            raise QuantError(f"fuse_rows: parts differ (K {p.k} vs {k}, leading {p.packed.shape[:-2]} vs {lead}); "
                             "expected equal K and leading axes")
    return NVFP4Weight(np.concatenate([p.packed for p in parts], axis=-2),
                       np.concatenate([p.scale for p in parts], axis=-2),
                       np.concatenate([p.scale_2 for p in parts], axis=-1),
                       tuple(s for p in parts for s in p.segments), k)


def dsv4_fp4_tensors(w: MXFP4Weight, nibble_order: NibbleOrder = "low_even") -> dict[str, np.ndarray]:
    """Format e as stored: {"weight": int8 [N, K/2], "scale": float8_e8m0fnu [N, K/32]}.
    nibble_order is NOT verified against DeepSeek-V4's code (MODELS.md): see load_dsv4_fp4."""
    packed = pack_nibbles(unpack_nibbles(w.packed), nibble_order)
    return {"weight": packed.view(np.int8), "scale": w.scale.view(E8M0)}


# ----------------------------------------------------------------------------- activations


def fp8_block_activations(x: np.ndarray, *, ue8m0: bool = False) -> np.ndarray:
    """Format a's dynamic activation quantization, dequantized: [..., C] -> float64 [..., C].

    Per row, per 128 channels (the last block zero-padded): s = max(amax, 1e-4) / 448 in
    float32 (ue8m0: rounded up to a power of two), q = e4m3(x / s) with x and the quotient in
    float32 as DeepSeek's act_quant kernel computes them; returns q * s.
    """
    a = as_float32(x, "x")
    c = a.shape[-1]
    blk = _blocks_k(a, FP8_BLOCK)
    s = np.maximum(np.abs(blk).max(axis=-1, keepdims=True), _F32(ACT_AMAX_FLOOR)) / _F32(E4M3_MAX)
    if ue8m0:
        s = ue8m0_ceil(s)
    q = e4m3_encode(blk / s).astype(np.float64) * s.astype(np.float64)
    return q.reshape(*a.shape[:-1], -1)[..., :c]


def fp8_input_scale(x: np.ndarray) -> np.float32:
    """Format d's static activation scale from calibration data: amax / 448 (1 if all zero)."""
    return np.float32(_per_matrix_scale(np.abs(as_float32(x, "x")).max(), E4M3_MAX))


def fp8_tensor_activations(x: np.ndarray, input_scale: float) -> np.ndarray:
    """Format d's static activation quantization, dequantized: e4m3(x / input_scale) saturating
    at +-448 (values past the calibrated range clamp, they do not become NaN) * input_scale."""
    s = np.float32(input_scale)
    if not (np.isfinite(s) and s > 0):
        raise QuantError(f"input_scale: {input_scale}, expected a finite positive float32")
    return e4m3_encode(as_float32(x, "x") / s).astype(np.float64) * np.float64(s)


# ----------------------------------------------------------------------------- loaders

# Loaders never copy a large weight they can keep as given: a container may share memory with
# the arrays it was loaded from (de-interleaving and nibble re-ordering do copy).
Tensors = Mapping[str, np.ndarray]


def _get(tensors: Tensors, name: str, form: str) -> np.ndarray:
    if name not in tensors:
        raise QuantError(f"missing tensor {name}: expected {form}")
    return np.asarray(tensors[name])


def _require(ok: bool, name: str, a: np.ndarray, form: str, why: str = "") -> None:
    if not ok:
        raise QuantError(f"{name}: {why or f'{a.dtype} {list(a.shape)}'}, expected {form}")


def _scalar_f32(tensors: Tensors, name: str) -> np.ndarray:
    form = "a float32 scalar ([] or [1]), finite and > 0"
    a = _get(tensors, name, form)
    _require(a.dtype == np.float32 and a.size == 1 and a.ndim <= 1, name, a, form)
    _require(bool(np.isfinite(a).all() and (a > 0).all()), name, a, form, f"value {a.reshape(-1)[0]}")
    return a.reshape(())


def _float_tensor(tensors: Tensors, name: str, shape: tuple[int, ...], note: str) -> np.ndarray:
    form = f"bfloat16 or float {list(shape)}" + (f" ({note})" if note else "")
    a = _get(tensors, name, form)
    _require((a.dtype.kind == "f" or a.dtype == BF16) and a.shape == shape, name, a, form)
    return a


def _e4m3_not_nan(name: str, a: np.ndarray, form: str) -> None:
    bad = (a.view(np.uint8) & 0x7F) == 0x7F  # e4m3fn's only NaN encodings
    _require(not bad.any(), name, a, form, f"{int(bad.sum())} NaN value(s)")


def _e8m0_bytes(name: str, a: np.ndarray, form: str) -> np.ndarray:
    b = a.view(np.uint8)
    _require(not (b == E8M0_NAN).any(), name, a, form, "contains byte 255 (E8M0 NaN)")
    return b


def load_fp8_block(tensors: Tensors, prefix: str = "") -> FP8BlockWeight:
    """DeepSeek-V3 style `{prefix}weight` float8_e4m3fn [N, K] + `{prefix}weight_scale_inv`
    float32 [ceil(N/128), ceil(K/128)] (float8_e8m0fnu scales, the ue8m0 storage, are accepted)."""
    wn, sn = prefix + "weight", prefix + "weight_scale_inv"
    wform = "float8_e4m3fn [N, K] (FP8 block-wise weight)"
    w = _get(tensors, wn, wform)
    _require(w.dtype == E4M3 and w.ndim == 2, wn, w, wform)
    _e4m3_not_nan(wn, w, wform)
    n, k = w.shape
    sform = f"float32 [{_cdiv(n, FP8_BLOCK)}, {_cdiv(k, FP8_BLOCK)}], finite > 0: one scale per 128x128 block of {wn}"
    s = _get(tensors, sn, sform)
    _require(s.dtype in (np.float32, E8M0) and s.shape == (_cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK)), sn, s, sform)
    s = s.astype(np.float32)  # E8M0 -> float32 is exact (2^-127 is a float32 subnormal)
    _require(bool(np.isfinite(s).all() and (s > 0).all()), sn, s, sform, "a NaN, Inf or non-positive scale")
    return FP8BlockWeight(w, s, bool((np.frexp(s)[0] == 0.5).all()))


def load_fp8_tensor(tensors: Tensors, prefix: str = "") -> FP8TensorWeight:
    """Per-tensor FP8: `{prefix}weight` float8_e4m3fn [N, K] + `weight_scale` float32 scalar
    (+ `input_scale` float32 scalar, optional)."""
    wn, wform = prefix + "weight", "float8_e4m3fn [N, K] (FP8 per-tensor weight)"
    w = _get(tensors, wn, wform)
    _require(w.dtype == E4M3 and w.ndim == 2, wn, w, wform)
    _e4m3_not_nan(wn, w, wform)
    inp = _scalar_f32(tensors, prefix + "input_scale") if prefix + "input_scale" in tensors else None
    return FP8TensorWeight(w, _scalar_f32(tensors, prefix + "weight_scale"), inp)


def load_nvfp4(tensors: Tensors, prefix: str = "") -> NVFP4Weight:
    """ModelOpt NVFP4: `{prefix}weight` uint8 [N, K/2] + `weight_scale` float8_e4m3fn [N, K/16]
    (linear layout) + `weight_scale_2` float32 scalar. K must be a multiple of 16."""
    wn, sn = prefix + "weight", prefix + "weight_scale"
    wform = "uint8 [N, K/2] with K a multiple of 16 (NVFP4: two e2m1 codes per byte)"
    w = _get(tensors, wn, wform)
    _require(w.dtype == np.uint8 and w.ndim == 2 and w.shape[1] % (NVFP4_BLOCK // 2) == 0, wn, w, wform)
    n, k = w.shape[0], 2 * w.shape[1]
    sform = f"float8_e4m3fn [{n}, {k // NVFP4_BLOCK}], >= 0: one scale per 16 along K of {wn} (linear, not swizzled)"
    s = _get(tensors, sn, sform)
    _require(s.dtype == E4M3 and s.shape == (n, k // NVFP4_BLOCK), sn, s, sform)
    _e4m3_not_nan(sn, s, sform)
    _require(not (s.view(np.uint8) & 0x80).any(), sn, s, sform, "a negative scale")
    s2 = _scalar_f32(tensors, prefix + "weight_scale_2")
    return NVFP4Weight(w, s, s2.reshape(1), (n,), k)


def load_nvfp4_gate_up(tensors: Tensors, gate_prefix: str, up_prefix: str) -> NVFP4Weight:
    """A fused gate+up [2I, K] from ModelOpt's separate w1 (gate) and w3 (up) matrices: bytes
    concatenated as stored, scale_2 = [gate's, up's], segments (I, I); nothing re-quantized."""
    gate, up = load_nvfp4(tensors, gate_prefix), load_nvfp4(tensors, up_prefix)
    if gate.packed.shape != up.packed.shape:
        raise QuantError(f"{up_prefix}weight: shape {list(up.packed.shape)}, expected {list(gate.packed.shape)} "
                         f"(as {gate_prefix}weight, its gate partner)")
    return fuse_rows(gate, up)


def _mx_pair(tensors: Tensors, base: str, rows: str, cols: str) -> tuple[np.ndarray, np.ndarray]:
    """GPT-OSS `{base}_blocks` uint8 [E, R, C/32, 16] and `{base}_scales` [E, R, C/32]."""
    bn, sn = base + "_blocks", base + "_scales"
    bform = f"uint8 [E, {rows}, {cols}/32, 16] (MXFP4: 32 e2m1 codes per block, two per byte)"
    b = _get(tensors, bn, bform)
    _require(b.dtype == np.uint8 and b.ndim == 4 and b.shape[-1] == MXFP4_BLOCK // 2, bn, b, bform)
    sform = f"uint8 (E8M0) {list(b.shape[:3])}: one scale byte per 32-block of {bn}"
    s = _get(tensors, sn, sform)
    _require(s.dtype in (np.uint8, E8M0) and s.shape == b.shape[:3], sn, s, sform)
    return b, _e8m0_bytes(sn, s, sform)


def load_gpt_oss_experts(tensors: Tensors, prefix: str = "", *, bias: bool = True) -> GptOssExperts:
    """GPT-OSS `{prefix}gate_up_proj_blocks` [E, 2I, H/32, 16] + `_scales` [E, 2I, H/32] with
    gate/up rows INTERLEAVED (even rows gate, odd rows up), `down_proj_blocks` [E, H, I/32, 16]
    + `_scales`, and (bias=True) `gate_up_proj_bias` [E, 2I] (interleaved too) + `down_proj_bias` [E, H]."""
    gb, gs = _mx_pair(tensors, prefix + "gate_up_proj", "2I", "H")
    db, ds = _mx_pair(tensors, prefix + "down_proj", "H", "I")
    e, i2, h = gb.shape[0], gb.shape[1], gb.shape[2] * MXFP4_BLOCK
    gn, dn = prefix + "gate_up_proj_blocks", prefix + "down_proj_blocks"
    _require(i2 % 2 == 0, gn, gb, "an even row count 2I (gate and up rows interleaved)")
    dform = f"uint8 [{e}, {h}, {i2 // 2 // MXFP4_BLOCK}, 16] (from {gn}: E={e}, H={h}, I={i2 // 2})"
    _require(db.shape == (e, h, i2 // 2 // MXFP4_BLOCK, 16) and (i2 // 2) % MXFP4_BLOCK == 0, dn, db, dform)

    def half(b: np.ndarray, s: np.ndarray, r: int) -> MXFP4Weight:  # r = 0: gate rows, 1: up rows
        return MXFP4Weight(np.ascontiguousarray(b[:, r::2].reshape(e, i2 // 2, h // 2)),
                           np.ascontiguousarray(s[:, r::2]), h)

    out = GptOssExperts(half(gb, gs, 0), half(gb, gs, 1),
                        MXFP4Weight(np.ascontiguousarray(db.reshape(e, h, -1)), np.ascontiguousarray(ds), i2 // 2))
    if not bias:
        return out
    gub = _float_tensor(tensors, prefix + "gate_up_proj_bias", (e, i2), "gate/up interleaved")
    dbias = _float_tensor(tensors, prefix + "down_proj_bias", (e, h), "")
    return GptOssExperts(out.gate, out.up, out.down, gub[:, 0::2].copy(), gub[:, 1::2].copy(), dbias)


def load_dsv4_fp4(tensors: Tensors, prefix: str = "", *, scale_name: str,
                  nibble_order: NibbleOrder = "low_even") -> MXFP4Weight:
    """DeepSeek-V4 FP4 experts: `{prefix}weight` int8 [N, K/2] packed e2m1 + `{prefix}{scale_name}`
    float8_e8m0fnu [N, K/32]; the math is MXFP4's (format c).

    UNVERIFIED (MODELS.md): the nibble order. The default "low_even" (low nibble = even element,
    as MXFP4/NVFP4) is an assumption; "high_even" swaps the nibbles, and the container is always
    stored low_even. The scale tensor's name is not recorded either, hence scale_name (DeepSeek-V3's
    Hugging Face checkpoints say weight_scale_inv; DeepSeek's own inference code says scale).
    """
    wn, sn = prefix + "weight", prefix + scale_name
    wform = "int8 [N, K/2] with K a multiple of 32 (DeepSeek-V4 FP4: two e2m1 codes per byte)"
    w = _get(tensors, wn, wform)
    _require(w.dtype in (np.int8, np.uint8) and w.ndim == 2 and w.shape[1] % (MXFP4_BLOCK // 2) == 0, wn, w, wform)
    n, k = w.shape[0], 2 * w.shape[1]
    sform = f"float8_e8m0fnu [{n}, {k // MXFP4_BLOCK}]: one scale per 32 along K of {wn}"
    s = _get(tensors, sn, sform)
    _require(s.dtype in (E8M0, np.uint8) and s.shape == (n, k // MXFP4_BLOCK), sn, s, sform)
    packed = pack_nibbles(unpack_nibbles(w.view(np.uint8), nibble_order))
    return MXFP4Weight(packed, _e8m0_bytes(sn, s, sform).copy(), k)
