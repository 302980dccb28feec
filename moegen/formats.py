"""The stored forms of quantized weights: element codecs (e4m3, e2m1, E8M0, FP4 nibble
packing) and one frozen container per block format of shared/MODELS.md ("Weight formats" a-e),
each with its exact dequantization. moegen/quant.py makes these containers (quantizers) and
reads them from checkpoints (loaders).

Containers hold the bytes as a checkpoint stores them. `dequantize()` returns float64 by
default: every product of stored values (e2m1 x e4m3 x float32, e4m3 x float32, e2m1 x 2^k) is
exact in float64. `tensors()` gives the checkpoint's tensors, which the matching loader reads
back bit for bit. Leading axes ([..., N, K], e.g. experts) are independent matrices.

Rounding: every encoder rounds a float32 value once, to nearest with ties to even, by the
ml_dtypes cast. Callers hand float32 (not float64) values on purpose: ml_dtypes casts float64
through float32, which would round twice; the published recipes (DeepSeek, ModelOpt, OCP MX)
all form the scaled values in float32 anyway. Values past the format's largest finite value
saturate to it (e4m3: 448, e2m1: 6) instead of becoming NaN.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar, Literal

import ml_dtypes
import numpy as np

from .spec import WeightFormat

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of e2m1's largest normal (6 = 1.5 * 2^2): OCP MX's emax_elem
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_BLOCK, NVFP4_BLOCK, MXFP4_BLOCK = 128, 16, 32

# The 16 e2m1 codes (sign in bit 3) as float32: [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ..., -6].
E2M1_VALUES = np.arange(16, dtype=np.uint8).view(E2M1).astype(np.float32)

NibbleOrder = Literal["low_even", "high_even"]


class QuantError(ValueError):
    """A quantized tensor is missing, malformed or does not match its partner; or a weight
    cannot be quantized. The message names the tensor and the expected form, on one line."""


def as_float32(w: np.ndarray, name: str) -> np.ndarray:
    """A weight as float32 (bf16/fp16/fp32 exactly; float64 rounded once). Rejects NaN/Inf:
    a scale computed from them would silently poison the whole block."""
    a = np.asarray(w)
    if a.dtype.kind != "f" and a.dtype != np.dtype(ml_dtypes.bfloat16):
        raise QuantError(f"{name}: dtype {a.dtype}, expected a floating type (bfloat16, float16, float32, float64)")
    a = a.astype(np.float32)
    if not np.isfinite(a).all():
        raise QuantError(f"{name}: contains NaN or Inf (or a value beyond float32), expected finite values")
    return a


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3fn, RNE, saturating at +-448 (the bare cast gives NaN past 464)."""
    return np.clip(np.asarray(x, np.float32), -E4M3_MAX, E4M3_MAX).astype(E4M3)


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> e2m1 codes (uint8 0..15), RNE, saturating at +-6.

    The sign bit is set iff x < 0, as ModelOpt's _cast_fp4 does: a negative value that rounds
    to zero becomes code 8 (-0) and an input -0.0 becomes code 0. (The bare ml_dtypes cast maps
    -0.0 to code 8; both decode to zero, this only makes the bytes match ModelOpt's.)
    """
    x = np.asarray(x, np.float32)
    codes = np.clip(x, -E2M1_MAX, E2M1_MAX).astype(E2M1).view(np.uint8) & np.uint8(7)
    return codes | np.where(x < 0, np.uint8(8), np.uint8(0))


# Decode tables for the float64 dequantizations: every e4m3 byte's value (NaN codes NaN), and
# every byte of packed e2m1 as its two values (low nibble first, the formats' nibble order). One
# gather per byte replaces unpacking, decoding and converting (large checkpoints dequantize in
# the reference expert by expert, and that is its cost).
E4M3_BYTE_F64 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
E2M1_BYTE_F64 = np.stack([E2M1_VALUES[np.arange(256) & 15], E2M1_VALUES[np.arange(256) >> 4]], -1).astype(np.float64)


def _block_scaled(vals: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """vals [..., N, K] (float64, modified in place) times scale [..., ceil(N/bn), ceil(K/bk)]
    repeated over its bn x bk blocks. Aligned shapes broadcast over a blocked view; others (a
    matrix not a multiple of the block) repeat the scales out to the matrix."""
    (bn, bk), (n, k) = block, vals.shape[-2:]
    s = scale.astype(np.float64)
    if n % bn or k % bk:
        vals *= np.repeat(np.repeat(s, bn, -2), bk, -1)[..., :n, :k]
        return vals
    blocked = vals.reshape(*vals.shape[:-2], n // bn, bn, k // bk, bk)
    blocked *= s[..., :, None, :, None]
    return vals


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """e2m1 codes (uint8 0..15) -> float32 values."""
    return E2M1_VALUES[np.asarray(codes) & 15]


def pack_nibbles(codes: np.ndarray, order: NibbleOrder = "low_even") -> np.ndarray:
    """[..., K] codes -> [..., K/2] bytes. "low_even": byte = (q[1::2] << 4) | q[0::2], the order
    of NVFP4 (ModelOpt) and MXFP4 (OCP MX / GPT-OSS); "high_even" swaps the two nibbles."""
    codes = np.asarray(codes, np.uint8)
    if codes.shape[-1] % 2:
        raise QuantError(f"codes: last axis {codes.shape[-1]} is odd, expected an even count to pack in pairs")
    even, odd = codes[..., 0::2], codes[..., 1::2]
    lo, hi = (even, odd) if order == "low_even" else (odd, even)
    return ((hi << 4) | (lo & 15)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, order: NibbleOrder = "low_even") -> np.ndarray:
    """[..., K/2] bytes -> [..., K] codes; the exact inverse of pack_nibbles."""
    packed = np.asarray(packed).view(np.uint8)
    lo, hi = packed & 15, packed >> 4
    even, odd = (lo, hi) if order == "low_even" else (hi, lo)
    out = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.uint8)
    out[..., 0::2], out[..., 1::2] = even, odd
    return out


def _e2m1_bytes(packed: np.ndarray) -> np.ndarray:
    """[..., K/2] packed e2m1 bytes -> [..., K] float64 values (low nibble = even element)."""
    packed = np.asarray(packed).view(np.uint8)
    return E2M1_BYTE_F64[packed].reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def e8m0_decode(b: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes -> float64 2^(b - 127); byte 255 is NaN."""
    b = np.asarray(b).view(np.uint8)
    return np.where(b == E8M0_NAN, np.nan, np.ldexp(1.0, b.astype(np.int32) - E8M0_BIAS))


def floor_log2(a: np.ndarray) -> np.ndarray:
    """floor(log2(a)) for a > 0, exactly (frexp, not a rounded log2): int32."""
    _, e = np.frexp(np.asarray(a, np.float32))
    return (e - 1).astype(np.int32)


def ceil_log2(a: np.ndarray) -> np.ndarray:
    """ceil(log2(a)) for a > 0, exactly: a = m * 2^e with m in [0.5, 1), a power of two iff m == 0.5."""
    m, e = np.frexp(np.asarray(a, np.float32))
    return np.where(m == 0.5, e - 1, e).astype(np.int32)


def ue8m0_ceil(s: np.ndarray) -> np.ndarray:
    """The smallest power of two >= s (s > 0), float32: the "ue8m0" scale rounding.

    Exact. DeepSeek's kernels compute exp2(ceil(log2(s))) with a float32 log2, which can round
    a scale a few ulps above a power of two down onto it (then x / s may exceed 448 slightly);
    this is the definition that code approximates: rounded UP to a power of two.
    """
    return np.ldexp(np.float32(1), ceil_log2(s)).astype(np.float32)


def pad_axis(a: np.ndarray, axis: int, multiple: int) -> np.ndarray:
    """Zero-pad `axis` up to a multiple of `multiple` (zeros never raise a block's amax)."""
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    width = [(0, 0)] * a.ndim
    width[axis] = (0, extra)
    return np.pad(a, width)


# ----------------------------------------------------------------------------- containers


@dataclass(frozen=True)
class FP8BlockWeight:
    """Format a. W[i, j] = q[i, j] * scale_inv[i // 128, j // 128] (DeepSeek's name: the scale
    that multiplies). q float8_e4m3fn [..., N, K]; scale_inv float32 [..., ceil(N/128), ceil(K/128)];
    ue8m0: every scale is a power of two."""

    q: np.ndarray
    scale_inv: np.ndarray
    ue8m0: bool = False
    format: ClassVar[WeightFormat] = WeightFormat.fp8_block

    def dequantize(self, dtype: type = np.float64) -> np.ndarray:
        vals = E4M3_BYTE_F64[np.asarray(self.q).view(np.uint8)]
        return _block_scaled(vals, self.scale_inv, (FP8_BLOCK, FP8_BLOCK)).astype(dtype, copy=False)

    def tensors(self) -> dict[str, np.ndarray]:
        return {"weight": self.q, "weight_scale_inv": self.scale_inv}


@dataclass(frozen=True)
class FP8TensorWeight:
    """Format d. W = q * scale. q float8_e4m3fn [..., N, K]; scale float32 [...] (0-d for one
    matrix); input_scale: the static float32 activation scale, when there is one."""

    q: np.ndarray
    scale: np.ndarray
    input_scale: np.ndarray | None = None
    format: ClassVar[WeightFormat] = WeightFormat.fp8_tensor

    def dequantize(self, dtype: type = np.float64) -> np.ndarray:
        return (self.q.astype(np.float64) * self.scale.astype(np.float64)[..., None, None]).astype(dtype)

    def tensors(self) -> dict[str, np.ndarray]:
        out = {"weight": self.q, "weight_scale": self.scale}
        return out if self.input_scale is None else {**out, "input_scale": self.input_scale}


@dataclass(frozen=True)
class NVFP4Weight:
    """Format b. packed uint8 [..., N, Kp/2] (low nibble = even element); scale float8_e4m3fn
    [..., N, Kp/16] (linear); Kp = k rounded up to 16, the padding is code 0.

    scale_2 float32 [..., S] holds one global scale per row SEGMENT: rows
    [sum(segments[:j]), sum(segments[:j+1])) use scale_2[..., j]. A plain matrix has one
    segment; a gate+up fusion (fuse_rows) has two, (I, I), so w1's and w3's scale_2 stay exact
    and nothing is re-quantized. w = e2m1 * (float(scale) * scale_2[segment of the row]).
    """

    packed: np.ndarray
    scale: np.ndarray
    scale_2: np.ndarray
    segments: tuple[int, ...]
    k: int
    format: ClassVar[WeightFormat] = WeightFormat.nvfp4

    def codes(self) -> np.ndarray:
        return unpack_nibbles(self.packed)[..., : self.k]

    def row_scale_2(self) -> np.ndarray:
        """[..., N] float32: each row's scale_2."""
        return np.repeat(self.scale_2, self.segments, axis=-1)

    def dequantize(self, dtype: type = np.float64) -> np.ndarray:
        # Exact product of the stored values; kernels that form scale * scale_2 in float32 first
        # differ from it by at most 2^-24 relative.
        vals = _e2m1_bytes(self.packed)
        s = self.scale.astype(np.float64) * self.row_scale_2()[..., None]
        return np.ascontiguousarray(_block_scaled(vals, s, (1, NVFP4_BLOCK))[..., : self.k], dtype=dtype)

    def split(self) -> list[NVFP4Weight]:
        """One NVFP4Weight per segment (each with its own scale_2): the inverse of fuse_rows."""
        edges = itertools.pairwise(np.cumsum((0, *self.segments)))
        return [NVFP4Weight(self.packed[..., a:b, :], self.scale[..., a:b, :], self.scale_2[..., j : j + 1],
                            (int(b - a),), self.k) for j, (a, b) in enumerate(edges)]

    def tensors(self) -> dict[str, np.ndarray]:
        if len(self.segments) != 1:
            raise QuantError(f"NVFP4 weight with {len(self.segments)} row segments: split() it into one "
                             "checkpoint matrix per segment first")
        return {"weight": self.packed, "weight_scale": self.scale, "weight_scale_2": self.scale_2[..., 0]}


@dataclass(frozen=True)
class MXFP4Weight:
    """Formats c and e. packed uint8 [..., N, Kp/2] (low nibble = even element); scale uint8
    [..., N, Kp/32], E8M0 bytes (2^(byte-127)); Kp = k rounded up to 32, the padding is code 0.
    GPT-OSS's *_blocks [..., K/32, 16] are the same bytes: blocks() is that view."""

    packed: np.ndarray
    scale: np.ndarray
    k: int
    format: ClassVar[WeightFormat] = WeightFormat.mxfp4

    def blocks(self) -> np.ndarray:
        return self.packed.reshape(*self.packed.shape[:-1], -1, MXFP4_BLOCK // 2)

    def codes(self) -> np.ndarray:
        return unpack_nibbles(self.packed)[..., : self.k]

    def dequantize(self, dtype: type = np.float64) -> np.ndarray:
        vals = _e2m1_bytes(self.packed)
        return np.ascontiguousarray(_block_scaled(vals, e8m0_decode(self.scale), (1, MXFP4_BLOCK))[..., : self.k],
                                    dtype=dtype)

    def tensors(self) -> dict[str, np.ndarray]:
        """GPT-OSS form: {"blocks": [..., K/32, 16], "scales": [..., K/32]}."""
        return {"blocks": self.blocks(), "scales": self.scale}


@dataclass(frozen=True)
class GptOssExperts:
    """One GPT-OSS MoE layer's experts, gate and up de-interleaved. gate, up: [E, I, H];
    down: [E, H, I]; biases (as stored, e.g. bf16) gate/up [E, I], down [E, H], or None."""

    gate: MXFP4Weight
    up: MXFP4Weight
    down: MXFP4Weight
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None
