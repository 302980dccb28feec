"""Weights: from Hugging Face tensors to the layouts the kernels read.

The GEMV kernels read each weight matrix as 16-row tiles in tensor-core fragment order
(see TileGemv in templates/common.cuh.j2): [tile][K/32 chunk][MATS][2 k-steps][32 lanes][8].
Lane (g, t) of k-step s holds rows g and g+8 and, inside its chunk, columns 8t+4s .. 8t+4s+3,
as the four registers of an m16n8k16 A fragment: (row g, cols 0-1), (row g+8, cols 0-1),
(row g, cols 2-3), (row g+8, cols 2-3). FP8 block codes with FP8 activations are laid out as
wgmma's core matrices instead (pack_fp8_core), which the prefill GEMMs read from shared memory by
descriptor and the GEMV kernels through ldmatrix: the same 512 bytes a chunk and matrix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .plan import PackedWeight, Plan

BF16 = np.dtype(ml_dtypes.bfloat16)
# Small fp32 weights copied as they are, by their device buffer name.
RAW_SOURCES = {"corr_bias": "gate.e_score_correction_bias", "router_bias": "gate.bias",
               "b_gate": "experts.gate_proj_bias", "b_up": "experts.up_proj_bias", "b_down": "experts.down_proj_bias",
               "tid2eid": "tid2eid", "rnorm_w": "router_norm.weight", "enorm_w": "pre_expert_norm.weight"}


class WeightError(ValueError):
    """A weight tensor is missing or has the wrong shape or dtype; the message names it."""


def bf16_bits(a: np.ndarray, name: str) -> np.ndarray:
    """bfloat16 values as uint16 bits. float32/float64 input is rounded to nearest even."""
    a = np.asarray(a)
    if a.dtype == BF16:
        return np.ascontiguousarray(a).view(np.uint16)
    if a.dtype in (np.float32, np.float64, np.float16):
        return np.ascontiguousarray(a.astype(BF16)).view(np.uint16)
    raise WeightError(f"{name}: dtype {a.dtype} is not a floating type (expected bfloat16)")


def pack_tiles(mats: Sequence[np.ndarray], rows_padded: int, fp8: bool = False) -> np.ndarray:
    """Pack MATS matrices [..., R, K] (bf16 bits) into the tile layout; rows padded with zeros.
    fp8: one-byte codes in the FP8 layout instead, in the same single copy: each lane's two
    k-steps side by side ([..., T, KC, MATS, 32 lanes, 2, 8]) and each 4-byte word's middle
    elements swapped (FP8_WORD_ORDER)."""
    lead = mats[0].shape[:-2]
    r, k = mats[0].shape[-2:]
    if k % 32 or rows_padded % 16 or rows_padded < r:
        raise WeightError(f"cannot tile a [{r}, {k}] matrix into {rows_padded} rows of 32-wide chunks")
    packed = []
    for m in mats:
        if m.shape != mats[0].shape:
            raise WeightError(f"matrices packed together differ in shape: {m.shape} vs {mats[0].shape}")
        p = np.zeros((*lead, rows_padded, k), m.dtype)
        p[..., :r, :] = m
        # rows -> (tile, h, g); cols -> (chunk, t, s, q, jj) with col = 32*chunk + 8t + 4s + 2q + jj
        p = p.reshape(*lead, rows_padded // 16, 2, 8, k // 32, 4, 2, 2, 2)
        nl = len(lead)
        tile, h, g, chunk, t, s, q, jj = range(nl, nl + 8)
        if fp8:  # lanes before k-steps; within a word h after jj: e0, e2, e1, e3
            p = p.transpose(*range(nl), tile, chunk, g, t, s, q, jj, h)
            packed.append(p.reshape(*lead, rows_padded // 16, k // 32, 32, 2, 8))
        else:
            p = p.transpose(*range(nl), tile, chunk, s, g, t, q, h, jj)
            packed.append(p.reshape(*lead, rows_padded // 16, k // 32, 2, 32, 8))
    out = np.stack(packed, axis=len(lead) + 2)  # [..., T, KC, MATS, 2, 32, 8]
    return np.ascontiguousarray(out)


def unpack_tiles(packed: np.ndarray, mats: int, rows: int) -> list[np.ndarray]:
    """Inverse of pack_tiles: the MATS matrices [..., rows, K]."""
    lead = packed.shape[:-6]
    t_, kc = packed.shape[-6:-4]
    nl = len(lead)
    out = []
    for mt in range(mats):
        p = packed[..., mt, :, :, :].reshape(*lead, t_, kc, 2, 8, 4, 2, 2, 2)
        tile, chunk, s, g, t, q, h, jj = range(nl, nl + 8)
        p = p.transpose(*range(nl), tile, h, g, chunk, t, s, q, jj)
        out.append(np.ascontiguousarray(p.reshape(*lead, t_ * 16, kc * 32)[..., :rows, :]))
    return out


def expected(plan: Plan) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape, for every tensor the plan's packed weights are made from."""
    return {name: shape for name, (shape, _) in tensors(plan).items()}


def tensors(plan: Plan) -> dict[str, tuple[tuple[int, ...], str]]:
    """Hugging Face name -> (shape, dtype) of every input tensor. FP8 block weights come as
    e4m3 codes with their fp32 `<name>_scale_inv` [..., ceil(R/128), ceil(K/128)] (DeepSeek's form);
    MXFP4 weights as uint8 `<name>` [..., R, K/2] (two e2m1 codes a byte, the low nibble the even
    element) with uint8 E8M0 `<name>_scale` [..., R, K/32] (GPT-OSS's `_blocks`, flattened, and `_scales`);
    NVFP4 weights as the same uint8 `<name>` with e4m3 `<name>_scale` [..., R, K/16] and fp32
    `<name>_scale_2` [...] (ModelOpt's `weight`, `weight_scale`, `weight_scale_2`); FP8 per-tensor
    weights as e4m3 `<name>` with fp32 `<name>_scale` and `<name>_input_scale` [...] (ModelOpt's
    `weight`, `weight_scale`, `input_scale`)."""
    h, e, i, si = plan.hidden, plan.local_experts, plan.inter, plan.shared_inter
    shapes = {"gate.weight": (plan.scored, h), "experts.gate_proj": (e, i, h), "experts.up_proj": (e, i, h),
              "experts.down_proj": (e, h, i)}
    if plan.shared_gate:
        shapes["shared_expert_gate.weight"] = (1, h)
    if si:
        shapes.update({"shared_expert.gate_proj": (si, h), "shared_expert.up_proj": (si, h),
                       "shared_expert.down_proj": (h, si)})
    for buf in plan.raw:
        shapes[RAW_SOURCES[buf.name]] = buf.shape
    fmt = {src: pw.format for pw in plan.weights for src in pw.sources}
    fmt.update({RAW_SOURCES[b.name]: b.dtype for b in plan.raw})
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shape in shapes.items():
        if fmt.get(name) in ("float32", "int32"):
            out[name] = (shape, fmt[name])
        elif fmt.get(name, "bf16") == "fp8_block":
            out[name] = (shape, "float8_e4m3fn")
            out[f"{name}_scale_inv"] = ((*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128)), "float32")
        elif fmt.get(name) == "fp8_tensor":  # e4m3 codes; fp32 weight and static input scale per matrix
            out[name] = (shape, "float8_e4m3fn")
            out[f"{name}_scale"] = (shape[:-2], "float32")
            out[f"{name}_input_scale"] = (shape[:-2], "float32")
        elif fmt.get(name) == "mxfp4":  # e2m1 pairs, low nibble = even element; E8M0 per 32 along K
            out[name] = ((*shape[:-1], shape[-1] // 2), "uint8")
            out[f"{name}_scale"] = ((*shape[:-1], shape[-1] // 32), "uint8")
        elif fmt.get(name) == "nvfp4":  # e2m1 pairs; e4m3 per 16 along K; fp32 scale_2 per matrix
            out[name] = ((*shape[:-1], shape[-1] // 2), "uint8")
            out[f"{name}_scale"] = ((*shape[:-1], shape[-1] // 16), "float8_e4m3fn")
            out[f"{name}_scale_2"] = (shape[:-2], "float32")
        else:
            out[name] = (shape, "bfloat16")
    return out


def collect(weights: Mapping[str, Any], plan: Plan, describe: Any) -> dict[str, list[tuple[str, Any]]]:
    """Check every tensor the plan needs; return, per Hugging Face name, its pieces in order.

    Experts may be given stacked (`experts.gate_proj` [E, I, H]) or one per expert
    (`experts.0.gate_proj` [I, H], ...). `describe(obj, name)` returns (shape, dtype, on_device).
    Device tensors must be bfloat16; host tensors may be bfloat16 or float (rounded to bf16).
    """
    out: dict[str, list[tuple[str, Any]]] = {}
    for name, (shape, want) in tensors(plan).items():
        if name in weights:
            pieces, piece_shape = [(name, weights[name])], shape
        elif name.startswith("experts.") and f"experts.0.{name.split('.', 1)[1]}" in weights:
            proj = name.split(".", 1)[1]
            keys = [f"experts.{x}.{proj}" for x in range(plan.local_experts)]
            missing = [k for k in keys if k not in weights]
            if missing:
                raise WeightError(f"missing weight {missing[0]}: expected {list(shape[1:])} (one per expert)")
            pieces, piece_shape = [(k, weights[k]) for k in keys], shape[1:]
        else:
            alt = f" (or per expert: experts.<e>.{name.split('.', 1)[1]})" if name.startswith("experts.") else ""
            raise WeightError(f"missing weight {name}: expected {list(shape)} {want}{alt}")
        for key, obj in pieces:
            got_shape, dtype, on_device = describe(obj, key)
            if tuple(got_shape) != piece_shape:
                raise WeightError(f"{key}: shape {list(got_shape)}, expected {list(piece_shape)}")
            floats = ("float32", "float64", "float16", "bfloat16")
            ok = dtype == want or (want in ("bfloat16", "float32") and not on_device and dtype in floats)
            if not ok:
                raise WeightError(f"{key}: dtype {dtype}, expected {want}")
        out[name] = pieces
    unknown = sorted(k for k in weights if k not in out and not _is_per_expert(k, plan))
    if unknown:
        raise WeightError(f"unexpected weight {unknown[0]}: this layer takes {sorted(out)}")
    return out


def _is_per_expert(key: str, plan: Plan) -> bool:
    parts = key.split(".")
    return len(parts) == 3 and parts[0] == "experts" and parts[1].isdigit() and int(parts[1]) < plan.local_experts


def packed_nbytes(pw: PackedWeight) -> int:
    """Bytes of a packed weight: every 16-row tile of every source matrix, rows padded."""
    per_matrix = max(pw.experts, 1) * pw.rows_padded * pw.cols * {"fp8_block": 2, "mxfp4": 1, "nvfp4": 1}.get(pw.format, 4) // 2
    return per_matrix if pw.interleaved else per_matrix * pw.mats


def _tile_sources(pw: PackedWeight, sources: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray], int]:
    """The MATS matrices whose 16-row tiles are packed side by side, and the rows each is padded to."""
    if pw.interleaved:  # the MATS matrices of a group are its consecutive 16-row tiles
        w = sources[pw.sources[0]]
        lead, (r, k) = w.shape[:-2], w.shape[-2:]
        p = np.zeros((*lead, pw.rows_padded, k), w.dtype)
        p[..., :r, :] = w
        p = p.reshape(*lead, pw.rows_padded // (16 * pw.mats), pw.mats, 16, k)
        return [p[..., m, :, :].reshape(*lead, pw.rows_padded // pw.mats, k) for m in range(pw.mats)], \
            pw.rows_padded // pw.mats
    if pw.mats == 1 and len(pw.sources) > 1:  # e.g. router rows then the shared-expert gate row
        return [np.concatenate([sources[s] for s in pw.sources], axis=0)], pw.rows_padded
    return [sources[s] for s in pw.sources], pw.rows_padded


def _pack_one(pw: PackedWeight, sources: Mapping[str, np.ndarray], fp8: bool = False) -> np.ndarray:
    mats, rows = _tile_sources(pw, sources)
    return pack_tiles(mats, rows, fp8)


# Byte order of an FP8 fragment word: elements e0, e2, e1, e3 (the kernels' e4m3x4_to_bf16x4
# makes register (e0, e1) from bytes 0 and 2, and (e2, e3) from bytes 1 and 3).
FP8_WORD_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)


def pack_fp8(pw: PackedWeight, codes: Mapping[str, np.ndarray]) -> np.ndarray:
    """FP8 codes (uint8) in the kernels' layout: the bf16 fragment order with each 4-byte word's
    middle bytes swapped (FP8_WORD_ORDER), then each lane's two k-steps side by side, so one
    16-byte load per lane brings a whole 16x32 chunk. The e4m3 NaN codes are refused: the kernels
    read every code as a finite value."""
    for name, c in codes.items():
        if ((np.asarray(c).view(np.uint8) & 0x7F) == 0x7F).any():
            raise WeightError(f"{name}: e4m3 NaN codes (0x7F, 0xFF); FP8 weights must be finite")
    return _pack_one(pw, codes, fp8=True)  # [..., T, KC, MATS, 32 lanes, 2 k-steps, 8]


def _core_order(k: int) -> np.ndarray:
    """The column each packed K position of the core-matrix layout holds: A8_ORDER inside every
    32-wide chunk (the FP8 activations' codes are stored in that order)."""
    from .prefill import A8_ORDER

    return np.array([c - c % 32 + A8_ORDER[c % 32] for c in range(k)])


def pack_fp8_core(pw: PackedWeight, codes: Mapping[str, np.ndarray]) -> np.ndarray:
    """FP8 block codes with FP8 activations, in wgmma's core-matrix layout (one copy for every path):
    per group of the MATS matrices' 16-row tiles (as pack_tiles groups them), 32-wide K chunk and
    matrix, the chunk's four 8-row x 16-byte core matrices (512 contiguous bytes, as pack_fp8's
    fragments of a chunk) in ldmatrix.x4's order: K 0-15 rows 0-7, K 0-15 rows 8-15, K 16-31 rows
    0-7, K 16-31 rows 8-15; K in A8_ORDER inside each chunk. A GEMV lane copies 16 bytes, row
    l % 8 of core matrix l / 8, which ldmatrix.x4 hands back as the chunk's e4m3 A fragment; the
    prefill GEMMs copy a K tile of a block's groups with one TMA box that puts the core matrices of
    each (chunk, matrix, K half) of every group's two row halves side by side, what a wgmma
    descriptor without swizzle reads as 64 rows (moegen.prefill_plan.a8_tensor_maps).
    [..., T, K/32, MATS, 2, 2, 8, 16] bytes. NaN codes are refused as in pack_fp8."""
    for name, c in codes.items():
        if ((np.asarray(c).view(np.uint8) & 0x7F) == 0x7F).any():
            raise WeightError(f"{name}: e4m3 NaN codes (0x7F, 0xFF); FP8 weights must be finite")
    mats, rows = _tile_sources(pw, codes)
    lead = mats[0].shape[:-2]
    k = mats[0].shape[-1]
    if k % 32 or rows % 16:
        raise WeightError(f"{pw.name}: cannot lay out [{rows}, {k}] in 16-row tiles of 32-wide K chunks")
    nl = len(lead)
    out = []
    for m in mats:
        p = np.zeros((*lead, rows, k), np.uint8)
        p[..., : m.shape[-2], :] = m
        p = p[..., _core_order(k)].reshape(*lead, rows // 16, 2, 8, k // 32, 2, 16)  # [.., T, h, row, KC, kh, 16]
        out.append(p.transpose(*range(nl), nl, nl + 3, nl + 4, nl + 1, nl + 2, nl + 5))  # [.., T, KC, kh, h, row, 16]
    return np.ascontiguousarray(np.stack(out, axis=nl + 2))  # [.., T, KC, MATS, kh, h, row, 16]


def unpack_fp8_core(pw: PackedWeight, packed: np.ndarray) -> list[np.ndarray]:
    """Inverse of pack_fp8_core: the codes of each source matrix [..., rows, K]."""
    lead = packed.shape[:-7]
    t_, kc, mats = packed.shape[-7:-4]
    nl = len(lead)
    inv = np.argsort(_core_order(kc * 32))
    ms = [packed[..., m, :, :, :, :].transpose(*range(nl), nl, nl + 3, nl + 4, nl + 1, nl + 2, nl + 5)
          .reshape(*lead, t_ * 16, kc * 32)[..., inv] for m in range(mats)]
    if pw.interleaved:  # the MATS tiles are consecutive 16-row tiles of the one source
        full = np.stack([m.reshape(*lead, t_, 16, kc * 32) for m in ms], axis=-3)
        return [full.reshape(*lead, -1, kc * 32)[..., : pw.rows, :]]
    return [m[..., : pw.rows, :] for m in ms]


def fp8_scales(pw: PackedWeight, scales: Mapping[str, np.ndarray]) -> np.ndarray:
    """The fp32 block scales of a packed FP8 weight: [MATS sources][E][R/128][K/128]."""
    return np.ascontiguousarray(np.stack([np.asarray(scales[f"{s}_scale_inv"], np.float32) for s in pw.sources]))


def fp8_tensor_scales(pw: PackedWeight, scales: Mapping[str, np.ndarray]) -> np.ndarray:
    """The scales of a packed FP8 per-tensor weight: [..., sources, 2] fp32, each source's weight
    scale then its static input scale (the kernel multiplies the code sums by both). The sources'
    input scales must be equal (gate's and up's: the kernels quantize a token row once for both, as
    ModelOpt's max calibration of both on the same tokens gives)."""
    pairs = [np.stack([np.asarray(scales[f"{s}_scale"], np.float32), np.asarray(scales[f"{s}_input_scale"], np.float32)],
                      axis=-1) for s in pw.sources]
    for s, p in zip(pw.sources, pairs):
        if not (np.isfinite(p).all() and (p > 0).all()):
            raise WeightError(f"{s}_scale / {s}_input_scale: expected finite positive float32 values")
    for s, p in zip(pw.sources[1:], pairs[1:]):
        differ = np.argwhere(p[..., 1] != pairs[0][..., 1])
        if differ.size:
            at = tuple(int(v) for v in differ[0])
            raise WeightError(f"{s}_input_scale{list(at)} = {float(p[..., 1][at]):.9g} differs from "
                              f"{pw.sources[0]}_input_scale{list(at)} = {float(pairs[0][..., 1][at]):.9g}: the "
                              "kernels quantize a token row once for both")
    return np.ascontiguousarray(np.stack(pairs, axis=-2))


def pack_fp4(pw: PackedWeight, codes: Mapping[str, np.ndarray]) -> np.ndarray:
    """FP4 (MXFP4, NVFP4) codes (uint8 0-15, one per element) in the kernels' layout, as bytes: the bf16
    fragment order, each lane's k-step as 4 bytes (nibble i = fragment element i, low nibble
    first), and the matrices of a tile paired so one 16-byte load per lane brings two:
    [..., T, KC, MATS/2, 32 lanes, 2 matrices, 2 k-steps, 4 bytes]."""
    p = _pack_one(pw, codes)  # [..., T, KC, MATS, 2 k-steps, 32 lanes, 8]
    if p.shape[-4] % 2:
        raise WeightError(f"{pw.name}: MXFP4 tiles pair their matrices; {p.shape[-4]} is odd")
    p = (p[..., 0::2] | (p[..., 1::2] << 4)).astype(np.uint8)  # [..., MATS, 2, 32, 4 bytes]
    lead = p.shape[:-4]
    p = p.reshape(*lead, p.shape[-4] // 2, 2, 2, 32, 4)  # [..., pair, matrix, k-step, lane, 4]
    return np.ascontiguousarray(np.moveaxis(p, -2, -4))  # [..., pair, lane, matrix, k-step, 4]


def unpack_fp4(pw: PackedWeight, packed: np.ndarray) -> list[np.ndarray]:
    """Inverse of pack_fp4: the codes of each source matrix [..., rows, K] (uint8 0-15)."""
    p = np.moveaxis(packed, -4, -2)  # [..., pair, matrix, k-step, lane, 4]
    lead = p.shape[:-5]
    p = p.reshape(*lead, p.shape[-5] * 2, 2, 32, 4)
    nib = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*lead, p.shape[-4], 2, 32, 8)  # [..., MATS, 2, 32, 8]
    mats = unpack_tiles(nib, pw.mats, pw.rows_padded if pw.interleaved else pw.rows)
    if pw.interleaved:  # the MATS tiles are consecutive 16-row tiles of the one source
        full = np.stack([m.reshape(*m.shape[:-2], -1, 16, m.shape[-1]) for m in mats], axis=-3)
        return [full.reshape(*full.shape[:-4], -1, full.shape[-1])[..., : pw.rows, :]]
    return mats


def _row_scale_tiles(pw: PackedWeight, src: Sequence[np.ndarray], pad: int, per_chunk: int) -> np.ndarray:
    """Per-row scale bytes [..., R, KC * per_chunk] of each source, by tile and chunk:
    [..., T, KC, MATS, per_chunk, 16]; padding rows get `pad` (their codes are zero)."""
    r, nb = src[0].shape[-2:]
    lead = src[0].shape[:-2]
    padded = []
    for a in src:
        p = np.full((*lead, pw.rows_padded, nb), pad, np.uint8)
        p[..., :r, :] = a
        padded.append(p.reshape(*lead, pw.rows_padded, nb // per_chunk, per_chunk))
    if pw.interleaved:  # one source; its consecutive 16-row tiles are the MATS matrices
        t = padded[0].reshape(*lead, pw.rows_padded // (16 * pw.mats), pw.mats, 16, nb // per_chunk, per_chunk)
    else:
        t = np.stack(padded, axis=-4).reshape(*lead, pw.mats, pw.rows_padded // 16, 16, nb // per_chunk, per_chunk)
        t = np.moveaxis(t, -5, -4)  # [..., T, MATS, 16, KC, per_chunk]
    nl = t.ndim - 5  # t: [..., T, MATS, 16, KC, per_chunk] -> [..., T, KC, MATS, per_chunk, 16]
    return np.ascontiguousarray(t.transpose(*range(nl), nl, nl + 3, nl + 1, nl + 4, nl + 2))


# The largest E8M0 scale byte the prefill GEMMs take: they multiply each e2m1 code by its scale in
# bf16, and 6 x 2^125 is the largest such product below bf16's overflow (6 x 2^126 is not).
MX_PREFILL_MAX_SCALE = 252


def mx_scale_tiles(pw: PackedWeight, scales: Mapping[str, np.ndarray], prefill: bool = False) -> np.ndarray:
    """The E8M0 row scales of a packed MXFP4 weight, by tile and chunk as the kernels read them:
    [..., T, KC, MATS, 16] bytes. Padding rows get 127 (2^0). prefill: the layer has prefill
    buckets, whose GEMMs take scale bytes up to MX_PREFILL_MAX_SCALE."""
    src = [np.asarray(scales[f"{s}_scale"], np.uint8) for s in pw.sources]
    for name, a in zip(pw.sources, src):
        if prefill and a.size and int(a.max()) > MX_PREFILL_MAX_SCALE:
            raise WeightError(f"{name}_scale: E8M0 byte {int(a.max())} (2^{int(a.max()) - 127}); this layer's prefill "
                              f"GEMMs take scales up to {MX_PREFILL_MAX_SCALE} (2^{MX_PREFILL_MAX_SCALE - 127}: each "
                              "code times its scale must stay a finite bf16)")
    return _row_scale_tiles(pw, src, 127, 1)[..., 0, :]


def nv_scale_tiles(pw: PackedWeight, scales: Mapping[str, np.ndarray]) -> np.ndarray:
    """The scales of a packed NVFP4 weight as the kernels read them, one record per tile: the e4m3
    row scales [KC][MATS][2 blocks of 16 along K][16 rows] (bytes), then the MATS fp32 scale_2 of
    the tile's matrices in 16 bytes: uint8 [..., T, KC * MATS * 32 + 16]."""
    src = [np.ascontiguousarray(scales[f"{s}_scale"]).view(np.uint8) for s in pw.sources]
    tiles = _row_scale_tiles(pw, src, 0, 2)  # [..., T, KC, MATS, 2, 16]
    lead = tiles.shape[:-4]  # [..., T]
    s2 = [np.asarray(scales[f"{s}_scale_2"], np.float32) for s in pw.sources]
    head = np.zeros((*lead, 4), np.float32)  # [..., T, 4]: MATS values, zero padding
    for mt in range(pw.mats):
        v = s2[0 if pw.interleaved else mt]
        head[..., mt] = v[..., None] if v.ndim else v
    flat = tiles.reshape(*lead, -1)
    return np.ascontiguousarray(np.concatenate([flat, head.view(np.uint8)], axis=-1))
