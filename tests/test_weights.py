"""Packing into the kernels' tile layout: round trip, and the fragment arithmetic it encodes."""

import ml_dtypes
import numpy as np
import pytest

from moegen import weights as W
from moegen.weights import WeightError, bf16_bits, pack_tiles, unpack_tiles


def _rand_bits(rng, *shape):
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16).view(np.uint16)


@pytest.mark.parametrize("lead,rows,pad,k,mats", [((), 48, 48, 64, 1), ((3,), 20, 32, 96, 2), ((), 129, 144, 32, 1)])
def test_pack_roundtrip(lead, rows, pad, k, mats):
    rng = np.random.default_rng()
    ms = [_rand_bits(rng, *lead, rows, k) for _ in range(mats)]
    packed = pack_tiles(ms, pad)
    assert packed.shape == (*lead, pad // 16, k // 32, mats, 2, 32, 8)
    for a, b in zip(ms, unpack_tiles(packed, mats, rows)):
        assert np.array_equal(a, b)
    # padding rows are zero
    full = unpack_tiles(packed, mats, pad)[0]
    assert not full[..., rows:, :].any()


def _mma_emulation(packed_tile, x):
    """What TileGemv computes for one tile: m16n8k16 fragments as the PTX ISA defines them."""
    kc = packed_tile.shape[0]
    a_bits = packed_tile.view(ml_dtypes.bfloat16).astype(np.float64)  # [KC, 1, 2, 32, 8]
    n = x.shape[0]
    d = np.zeros((16, n))
    for c in range(kc):
        for s in range(2):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                a = a_bits[c, 0, s, lane]  # a0..a7
                # A fragment: a0,a1 (row g, k 2t..2t+1); a2,a3 (row g+8, same k); a4,a5 (row g, k 2t+8..);
                # a6,a7 (row g+8, k 2t+8..). B: b0,b1 (k 2t..2t+1, col g); b2,b3 (k 2t+8.., col g).
                # The kernel feeds B from 16 contiguous bytes of x at column 32c + 8t + 4s.
                for col in range(n):
                    b = x[col, 32 * c + 8 * t + 4 * s: 32 * c + 8 * t + 4 * s + 4]
                    # each lane's contribution: its own k indices only
                    d[g, col] += a[0] * b[0] + a[1] * b[1] + a[4] * b[2] + a[5] * b[3]
                    d[g + 8, col] += a[2] * b[0] + a[3] * b[1] + a[6] * b[2] + a[7] * b[3]
    return d


def test_fragment_order_computes_the_product():
    rng = np.random.default_rng()
    w = rng.standard_normal((16, 64)).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((3, 64))
    packed = pack_tiles([w.view(np.uint16)], 16)[0]
    got = _mma_emulation(packed, x)
    assert np.allclose(got, w.astype(np.float64) @ x.T, rtol=1e-12, atol=1e-12)


def test_bf16_bits_rejects_integers():
    with pytest.raises(WeightError, match="gate.weight"):
        bf16_bits(np.zeros((2, 2), np.int32), "gate.weight")
    x = np.array([1.0, -2.5], np.float32)
    assert np.array_equal(bf16_bits(x, "x").view(ml_dtypes.bfloat16).astype(np.float32), x)


def test_interleaved_packing_groups_consecutive_tiles():
    """Down weights: the MATS matrices of a row group are its consecutive 16-row tiles."""
    from moegen.plan import PackedWeight
    from moegen.weights import _pack_one

    rng = np.random.default_rng()
    w = _rand_bits(rng, 3, 64, 96)  # [E, H, I]
    pw = PackedWeight("w2", ("experts.down_proj",), 2, True, 3, 64, 64, 96)
    packed = _pack_one(pw, {"experts.down_proj": w})
    assert packed.shape == (3, 2, 3, 2, 2, 32, 8)  # [E, H/32, I/32, tiles, 2, 32, 8]
    even, odd = unpack_tiles(packed, 2, 32)
    got = np.stack([even.reshape(3, 2, 16, 96), odd.reshape(3, 2, 16, 96)], axis=2).reshape(3, 64, 96)
    assert np.array_equal(got, w)


# ----------------------------------------------------------------------------- MXFP4


def _mx_pw(name: str, mats: int, interleaved: bool, experts: int, rows: int, pad: int, k: int):
    from moegen.plan import PackedWeight

    srcs = ("experts.gate_proj", "experts.up_proj") if not interleaved else ("experts.down_proj",)
    return PackedWeight(name, srcs, mats, interleaved, experts, rows, pad, k, "mxfp4", "s")


@pytest.mark.parametrize("interleaved", [False, True])
def test_mxfp4_pack_roundtrip(interleaved):
    from moegen.weights import mx_scale_tiles, pack_fp4, unpack_fp4

    rng = np.random.default_rng()
    e, rows, k = 3, (40 if not interleaved else 64), 96
    pw = _mx_pw("w", 2, interleaved, e, rows, 48 if not interleaved else 64, k)
    codes = {s: rng.integers(0, 16, (e, rows, k), dtype=np.uint8) for s in pw.sources}
    packed = pack_fp4(pw, codes)
    tiles_ = pw.rows_padded // 16 // (2 if interleaved else 1)
    assert packed.dtype == np.uint8 and packed.shape == (e, tiles_, k // 32, 1, 32, 2, 2, 4)
    for src, back in zip(pw.sources, unpack_fp4(pw, packed)):
        assert np.array_equal(back, codes[src])
    scales = {f"{s}_scale": rng.integers(100, 140, (e, rows, k // 32), dtype=np.uint8) for s in pw.sources}
    tiles = mx_scale_tiles(pw, scales)
    assert tiles.shape == (e, pw.rows_padded // 16 // (2 if interleaved else 1), k // 32, 2, 16)


def test_mxfp4_scales_past_the_prefill_limit_are_refused_by_name():
    """The prefill GEMMs multiply each e2m1 code by its E8M0 scale in bf16: 6 x 2^125 (byte 252) is
    finite there, 6 x 2^126 is not. A layer with prefill buckets refuses larger scale bytes, naming
    the tensor; the GEMV path (no prefill) takes every byte."""
    from moegen.weights import MX_PREFILL_MAX_SCALE, WeightError, mx_scale_tiles

    assert MX_PREFILL_MAX_SCALE == 252
    assert float(ml_dtypes.bfloat16(6.0 * 2.0 ** (MX_PREFILL_MAX_SCALE - 127))) == 6.0 * 2.0 ** 125
    assert not np.isfinite(float(ml_dtypes.bfloat16(6.0 * 2.0 ** (MX_PREFILL_MAX_SCALE + 1 - 127))))
    pw = _mx_pw("w13", 2, False, 2, 16, 16, 64)
    scales = {f"{s}_scale": np.full((2, 16, 2), 127, np.uint8) for s in pw.sources}
    scales["experts.up_proj_scale"][1, 3, 1] = MX_PREFILL_MAX_SCALE
    mx_scale_tiles(pw, scales, prefill=True)
    scales["experts.up_proj_scale"][1, 3, 1] = MX_PREFILL_MAX_SCALE + 1
    mx_scale_tiles(pw, scales)  # (no prefill buckets)
    with pytest.raises(WeightError, match=r"^experts\.up_proj_scale: E8M0 byte 253 \(2\^126\)"):
        mx_scale_tiles(pw, scales, prefill=True)


def _fp4_fragment(word: int) -> list[float]:
    """The 8 bf16 values of one lane's k-step, as the kernel converts its 4 bytes."""
    return [v for r in _e2m1x8_to_bf16x8(int(word)) for v in _bf16x2(r)]


def _lane_dot(a: list[float], b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One lane's m16n8k16 contribution for its k-step: to row g (a0, a1, a4, a5) and to row g+8
    (a2, a3, a6, a7), against its 4 columns of x (b: [tokens, 4])."""
    return (a[0] * b[:, 0] + a[1] * b[:, 1] + a[4] * b[:, 2] + a[5] * b[:, 3],
            a[2] * b[:, 0] + a[3] * b[:, 1] + a[6] * b[:, 2] + a[7] * b[:, 3])


def _check_tile(got: np.ndarray, w: np.ndarray, r0: int, rows: int, x: np.ndarray) -> None:
    """A 16-row tile's product against rows r0.. of the dequantized matrix w (zero past `rows`)."""
    r1 = max(min(r0 + 16, rows), r0)
    want, scale = np.zeros((16, len(x))), np.zeros((16, len(x)))
    want[: r1 - r0], scale[: r1 - r0] = w[r0:r1] @ x.T, np.abs(w[r0:r1]) @ np.abs(x).T
    _close(got, want, scale)


def _close(got: np.ndarray, want: np.ndarray, scale: np.ndarray) -> None:
    """Equal up to float64 rounding of the sums: 1e-12 of the sum of the terms' magnitudes (a
    relative test alone fails where the terms cancel)."""
    bad = np.abs(got - want) > 1e-12 * scale
    assert not bad.any(), f"{got[bad][:3]} vs {want[bad][:3]}"


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte sel[4i+2:4i] of {b, a}, or with
    sel bit 4i+3 set, that byte's top bit replicated."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        s = (sel >> 4 * i) & 0xF
        v = src[s & 7]
        if s & 8:
            v = 0xFF if v & 0x80 else 0
        out |= v << 8 * i
    return out


def _e2m1x8_to_bf16x8(w: int) -> list[int]:
    """A transcription of e2m1x8_to_bf16x8 in templates/common.cuh.j2, operation by operation."""
    m = 0xFFFFFFFF
    hi0, hi1, lo0, lo1 = 0x3F3F3F00, 0x40404040, 0xC0800000, 0xC0804000
    sel0, sel1 = w & 0x7777, (w >> 16) & 0x7777
    hb0, lb0, hb1, lb1 = _prmt(hi0, hi1, sel0), _prmt(lo0, lo1, sel0), _prmt(hi0, hi1, sel1), _prmt(lo0, lo1, sel1)
    w4 = (w << 4) & m
    return [_prmt(lb0, hb0, 0x5140) | (_prmt(w4, w, 0xCC88) & 0x80008000),
            _prmt(lb0, hb0, 0x7362) | (_prmt(w4, w, 0xDD99) & 0x80008000),
            _prmt(lb1, hb1, 0x5140) | (_prmt(w4, w, 0xEEAA) & 0x80008000),
            _prmt(lb1, hb1, 0x7362) | (_prmt(w4, w, 0xFFBB) & 0x80008000)]


def _bf16x2(r: int) -> tuple[float, float]:
    h = np.array([r & 0xFFFF, r >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    return float(h[0]), float(h[1])


def test_e2m1_register_conversion_is_exact_for_every_code_in_every_position():
    """Every e2m1 code (both zeros, both signs) in each of the 8 nibbles, among random others,
    comes out as its ml_dtypes value in the right half of the right register."""
    from moegen.formats import E2M1_VALUES

    rng = np.random.default_rng()
    for pos in range(8):
        for code in range(16):
            nib = rng.integers(0, 16, 8)
            nib[pos] = code
            w = int(sum(int(v) << 4 * i for i, v in enumerate(nib)))
            vals = [v for r in _e2m1x8_to_bf16x8(w) for v in _bf16x2(r)]
            want = E2M1_VALUES[nib].astype(np.float64)
            assert np.array_equal(vals, want) and np.array_equal(np.signbit(vals), np.signbit(want)), (pos, code)


def test_mxfp4_tile_product_as_the_kernel_reads_it():
    """The packed bytes and scale tiles, read lane by lane as TileGemv does for MXFP4 (pairs of
    matrices per 16-byte fragment, register conversion, m16n8k16 fragments, the row's E8M0 scale
    per chunk), give the dequantized weights times x: blocks not aligned to 128, scales at the
    extremes of their useful range, every code."""
    from moegen.formats import E2M1_VALUES, e8m0_decode
    from moegen.weights import mx_scale_tiles, pack_fp4

    rng = np.random.default_rng()
    e, rows, pad, k = 2, 24, 32, 96  # K: three 32-blocks, not a multiple of 128; rows padded
    pw = _mx_pw("w13", 2, False, e, rows, pad, k)
    codes = {s: rng.integers(0, 16, (e, rows, k), dtype=np.uint8) for s in pw.sources}
    sc = {f"{s}_scale": rng.integers(120, 134, (e, rows, k // 32), dtype=np.uint8) for s in pw.sources}
    sc["experts.gate_proj_scale"][0, 0, 0], sc["experts.up_proj_scale"][1, 3, 2] = 1, 250  # 2^-126, 2^123
    packed, tiles = pack_fp4(pw, codes), mx_scale_tiles(pw, sc)
    x = rng.standard_normal((3, k))
    words = packed.view("<u4")[..., 0]  # [E, T, KC, pair, lane, matrix, k-step]: nibble i = element i
    for ex in range(e):
        for tile in range(pad // 16):
            d = np.zeros((2, 16, 3))
            for c in range(k // 32):
                for mt in range(2):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        s_lo, s_hi = e8m0_decode(tiles[ex, tile, c, mt, [g, g + 8]]).astype(np.float64)
                        for s in range(2):
                            a = _fp4_fragment(words[ex, tile, c, 0, lane, mt, s])
                            lo, hi = _lane_dot(a, x[:, 32 * c + 8 * t + 4 * s: 32 * c + 8 * t + 4 * s + 4])
                            d[mt, g] += s_lo * lo
                            d[mt, g + 8] += s_hi * hi
            for mt, src in enumerate(pw.sources):
                w = E2M1_VALUES[codes[src][ex]].astype(np.float64)
                w *= np.repeat(e8m0_decode(sc[f"{src}_scale"][ex]).astype(np.float64), 32, axis=-1)
                _check_tile(d[mt], w, tile * 16, rows, x)


def _e4m3(b: np.ndarray) -> np.ndarray:
    return np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


@pytest.mark.parametrize("interleaved", [False, True])
def test_nvfp4_tile_product_as_the_kernel_reads_it(interleaved):
    """NVFP4 as TileGemv reads it: codes as for MXFP4, then per tile the e4m3 row scales of each
    16-wide block and the tile's scale_2 values after them. A lane's columns of a k-step lie in
    block t // 2 of its chunk: each of its codes is scaled by that block's row scale in bf16
    (exact), the sums then times scale_2 (gate and up, or every expert, with its own). Down
    weights pair consecutive tiles of one matrix."""
    from moegen.formats import E2M1_VALUES
    from moegen.weights import nv_scale_tiles, pack_fp4

    rng = np.random.default_rng()
    e, k = 2, 64
    rows, pad = (24, 32) if not interleaved else (64, 64)
    pw = _mx_pw("w", 2, interleaved, e, rows, pad, k)
    codes = {s: rng.integers(0, 16, (e, rows, k), dtype=np.uint8) for s in pw.sources}
    sc = {}
    for s in pw.sources:  # positive e4m3 scales, some subnormal (codes 1-7) and the largest (0x7E = 448)
        b = rng.integers(1, 0x7E, (e, rows, k // 16), dtype=np.uint8)
        b[0, 0, 0], b[-1, -1, -1] = 0x01, 0x7E
        sc[f"{s}_scale"] = b.view(ml_dtypes.float8_e4m3fn)
        sc[f"{s}_scale_2"] = rng.uniform(0.5, 2.0, e).astype(np.float32)
    packed, rec = pack_fp4(pw, codes), nv_scale_tiles(pw, sc)
    t_count = pad // 16 // (2 if interleaved else 1)
    assert rec.shape == (e, t_count, (k // 32) * 2 * 32 + 16)
    x = rng.standard_normal((3, k))
    words = packed.view("<u4")[..., 0]  # [E, T, KC, pair, lane, matrix, k-step]
    for ex in range(e):
        for tile in range(t_count):
            tb = rec[ex, tile]
            s2 = tb[(k // 32) * 64:].view(np.float32)[:2].astype(np.float64)
            d = np.zeros((2, 16, 3))
            for c in range(k // 32):
                for mt in range(2):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        base = (c * 2 + mt) * 32 + (t // 2) * 16
                        f_lo, f_hi = _e4m3(tb[[base + g, base + g + 8]])
                        for s in range(2):
                            a = _fp4_fragment(words[ex, tile, c, 0, lane, mt, s])
                            a = [v * (f_lo if i in (0, 1, 4, 5) else f_hi) for i, v in enumerate(a)]
                            assert all(float(np.float64(v).astype(ml_dtypes.bfloat16)) == v for v in a)  # exact
                            lo, hi = _lane_dot(a, x[:, 32 * c + 8 * t + 4 * s: 32 * c + 8 * t + 4 * s + 4])
                            d[mt, g] += lo
                            d[mt, g + 8] += hi
            d *= s2[:, None, None]
            for mt in range(2):
                src = pw.sources[0 if interleaved else mt]
                w = E2M1_VALUES[codes[src][ex]].astype(np.float64)
                scale = np.repeat(_e4m3(sc[f"{src}_scale"][ex].view(np.uint8)), 16, axis=-1)
                w *= scale * float(sc[f"{src}_scale_2"][ex])
                _check_tile(d[mt], w, (tile * 2 + mt) * 16 if interleaved else tile * 16, rows, x)


# ----------------------------------------------------------------------------- FP8


def _e4m3x4_to_bf16x4(q: int) -> list[int]:
    """templates/common.cuh.j2 e4m3x4_to_bf16x4, operation for operation: the two registers'
    bits before the bf16 multiply by 2^120 (bf16_value() applies it)."""
    sign, bits = 0x80008000, 0x07F007F0
    lo = (((q << 8) & 0xFFFFFFFF) & sign) | (((q << 4) & 0xFFFFFFFF) & bits)
    hi = (q & sign) | ((q >> 4) & bits)
    return [lo, hi]


def _times_2_120(r: int) -> tuple[float, float]:
    """mul.rn.bf16x2 by 2^120 of a register holding a code's value times 2^-120: exact (the
    product is an e4m3 value, a bf16 value; float64 holds every bf16, subnormals included)."""
    vals = tuple(v * 2.0**120 for v in _bf16x2(r))
    assert all(float(np.float64(v).astype(ml_dtypes.bfloat16)) == v for v in vals)
    return vals


def test_e4m3_register_conversion_is_exact_for_every_code_in_every_position():
    """Every finite e4m3 code (both zeros, the subnormals, +-448) in each byte of a word, among
    random others, comes out as its ml_dtypes value in the element the packer put it at."""
    from moegen.weights import FP8_WORD_ORDER

    rng = np.random.default_rng()
    finite = [c for c in range(256) if c & 0x7F != 0x7F]
    for pos in range(4):
        for code in finite:
            elems = rng.choice(finite, 4)
            elems[pos] = code  # fragment elements e0..e3, stored in FP8_WORD_ORDER
            stored = [int(elems[FP8_WORD_ORDER[i]]) for i in range(4)]
            q = sum(b << 8 * i for i, b in enumerate(stored))
            got = [v for r in _e4m3x4_to_bf16x4(q) for v in _times_2_120(r)]
            want = _e4m3(np.array(elems, np.uint8))
            assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want)), (pos, code)


def test_fp8_tile_product_as_the_kernel_reads_it():
    """FP8 block codes packed by pack_fp8 and read lane by lane as TileGemv does (a lane's 16
    bytes: two k-steps of two words, each word converted by e4m3x4_to_bf16x4; m16n8k16
    fragments; the 128x128 block scale per chunk) give the dequantized weights times x: rows
    padded, gate and up side by side, every finite code."""
    from moegen.plan import PackedWeight
    from moegen.weights import pack_fp8

    rng = np.random.default_rng()
    e, rows, pad, k = 2, 24, 32, 128
    pw = PackedWeight("w13", ("experts.gate_proj", "experts.up_proj"), 2, False, e, rows, pad, k, "fp8_block", "s")
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    codes = {s: rng.choice(finite, (e, rows, k)) for s in pw.sources}
    codes["experts.gate_proj"][0, 0, :len(finite) // 2] = finite[: len(finite) // 2]
    codes["experts.up_proj"][1, 1, :len(finite) // 2] = finite[len(finite) // 2:]
    scale = {s: rng.uniform(0.5, 2.0, (e, 1, 1)) for s in pw.sources}  # one 128x128 block here
    packed = pack_fp8(pw, codes)
    assert packed.shape == (e, pad // 16, k // 32, 2, 32, 2, 8)
    words = packed.view("<u4")  # [E, T, KC, MATS, lane, k-step, 2 words]
    x = rng.standard_normal((3, k))
    with pytest.raises(WeightError, match="experts.up_proj: e4m3 NaN codes"):
        pack_fp8(pw, {**codes, "experts.up_proj": np.full((e, rows, k), 0xFF, np.uint8)})
    for ex in range(e):
        for tile in range(pad // 16):
            d = np.zeros((2, 16, 3))
            for c in range(k // 32):
                for mt in range(2):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        for s in range(2):
                            a = [v for wd in words[ex, tile, c, mt, lane, s] for r in _e4m3x4_to_bf16x4(int(wd))
                                 for v in _times_2_120(r)]
                            lo, hi = _lane_dot(a, x[:, 32 * c + 8 * t + 4 * s: 32 * c + 8 * t + 4 * s + 4])
                            d[mt, g] += lo
                            d[mt, g + 8] += hi
            for mt, src in enumerate(pw.sources):
                d[mt] *= scale[src][ex, 0, 0]
                _check_tile(d[mt], _e4m3(codes[src][ex]) * scale[src][ex, 0, 0], tile * 16, rows, x)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte i is byte (sel >> 4i) & 7 of the pool b:a."""
    pool = a | (b << 32)
    return sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _ldmatrix_x4(slots: np.ndarray) -> list[list[int]]:
    """PTX ldmatrix.sync.aligned.m8n8.x4.b16 over the 16-byte rows `slots` [32, 16] (lane l's address:
    row l % 8 of matrix l / 8): register j of lane i is matrix j's row i / 4, bytes 4 (i % 4) .. + 3."""
    return [[int.from_bytes(bytes(slots[8 * j + i // 4, 4 * (i % 4): 4 * (i % 4) + 4]), "little") for j in range(4)]
            for i in range(32)]


def _tma_box(src: np.ndarray, dims: tuple, strides: tuple, box: tuple, at: tuple) -> np.ndarray:
    """A TMA tile copy (cp.async.bulk.tensor, 32-bit elements) of one box at coordinates `at` (dims
    innermost first, strides in bytes for dims 1..), as the bytes it lands in shared memory: the
    box's elements in order, innermost dim fastest."""
    words = src.view("<u4")
    out = []
    for idx in np.ndindex(*reversed(box)):
        c = [a + i for a, i in zip(at, reversed(idx))]
        assert all(0 <= v < d for v, d in zip(c, dims))
        out.append(words[(c[0] * 4 + sum(v * st for v, st in zip(c[1:], strides))) // 4])
    return np.array(out, "<u4").view(np.uint8)


@pytest.mark.parametrize("interleaved", [False, True], ids=["gate_up", "down_pairs"])
def test_fp8_core_layout_as_the_gemv_and_the_e4m3_wgmma_read_it(interleaved):
    """FP8 block codes with FP8 activations (pack_fp8_core), read both ways the kernels read them:
    TileGemv's lane copies the 16 bytes at its place in the chunk's 512 (as for pack_fp8), ldmatrix.x4
    hands the e4m3 fragment back and a8_frags converts it into the bf16 m16n8k16 fragments of a
    k-step (columns 8t + 4s .. + 3 of lane t, as pack_fp8's); and the prefill GEMMs' TMA box
    (prefill_plan.a8_tensor_maps) lands a block's k-tile where wgmma reads B (the block's 128 weight
    rows x 32 K of k-step kk: each group's matrix 0 rows, then matrix 1's) by a descriptor without
    swizzle (core matrices 128 bytes apart along the rows, the K halves 2048 bytes apart), K in
    A8_ORDER. Rows padded, every finite code; unpack_fp8_core inverts the packing. The quantization
    kernel's lane l writes logical positions 4l .. 4l + 3 of a 128-wide block from its columns
    col(l) + 0, 2, 1, 3."""
    from moegen.plan import PackedWeight
    from moegen.prefill import A8_ORDER
    from moegen.weights import pack_fp8_core, unpack_fp8_core

    assert sorted(A8_ORDER) == list(range(32))
    rng = np.random.default_rng()
    e, k = 2, 256
    if interleaved:  # a down weight: row groups of two consecutive 16-row tiles of one source
        pw = PackedWeight("w2", ("experts.down_proj",), 2, True, e, 248, 256, k, "fp8_block", "s", True)
    else:
        pw = PackedWeight("w13", ("experts.gate_proj", "experts.up_proj"), 2, False, e, 120, 128, k, "fp8_block", "s",
                          True)
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    codes = {s: rng.choice(finite, (e, pw.rows, k)) for s in pw.sources}
    codes[pw.sources[0]][0, 0, : len(finite) // 2] = finite[: len(finite) // 2]
    codes[pw.sources[-1]][1, 1, : len(finite) // 2] = finite[len(finite) // 2:]
    packed = pack_fp8_core(pw, codes)
    assert packed.nbytes == W.packed_nbytes(pw)
    for src, back in zip(pw.sources, unpack_fp8_core(pw, packed)):
        assert np.array_equal(back, codes[src])
    with pytest.raises(WeightError, match="e4m3 NaN codes"):
        pack_fp8_core(pw, {s: np.full((e, pw.rows, k), 0xFF, np.uint8) for s in pw.sources})
    mats, kc = pw.mats, k // 32
    groups = pw.rows_padded // 16 // (mats if interleaved else 1)
    flat = packed.reshape(e, -1, 16)  # an expert's 16-byte units

    def matrix(ex: int, a: int) -> np.ndarray:  # matrix a of the groups, [groups * 16, K], padded rows zero
        full = np.zeros((pw.rows_padded, k), np.uint8)
        full[: pw.rows] = codes[pw.sources[0 if interleaved else a]][ex]
        if interleaved:
            return full.reshape(groups, mats, 16, k)[:, a].reshape(-1, k)
        return full

    for ex in range(e):
        ms = [matrix(ex, a) for a in range(mats)]
        for grp in range(groups):
            for c in range(kc):
                for f in range(mats):  # common.cuh.j2 TileGemv: a + (c * AU + f) * 32 + lane
                    regs = _ldmatrix_x4(flat[ex, grp * kc * mats * 32 + (c * mats + f) * 32 + np.arange(32)])
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        r = regs[lane]
                        for s_ in range(2):  # a8_frags: (row g's lo, row g + 8's lo, row g's hi, row g + 8's hi)
                            c0, c1 = _e4m3x4_to_bf16x4(r[2 * s_]), _e4m3x4_to_bf16x4(r[2 * s_ + 1])
                            got = [v for rr in (c0[0], c1[0], c0[1], c1[1]) for v in _times_2_120(rr)]
                            col, rows_ = 32 * c + 8 * t + 4 * s_, (grp * 16 + g, grp * 16 + g + 8)
                            want = [ms[f][rows_[h], col + 2 * hi + j] for hi in (0, 1) for h in (0, 1) for j in (0, 1)]
                            assert np.array_equal(got, _e4m3(np.array(want, np.uint8))), (ex, grp, c, f, lane, s_)
    # the prefill GEMMs: the map over every expert's groups (prefill_plan.a8_tensor_maps), one box a k-tile
    dims, strides, box = (64, 2, e * groups, 2, kc), (512, kc * 2 * 512, 256, 2 * 512), (64, 2, 4, 2, 4)
    src = packed.reshape(-1)
    for ex in range(e):
        ms = [matrix(ex, a) for a in range(mats)]
        for g0 in (0, groups - 4):  # a block's first group (the last block overlapping the one before)
            for kt in range(k // 128):
                smem = _tma_box(src, dims, strides, box, (0, 0, ex * groups + g0, 0, kt * 4))
                for kk in range(4):  # grouped_gemm.cu.j2 prefill_gemm_a8: core_desc(w, 2048, 128) + kk * 4096
                    lbo, sbo = 2048, 128
                    n, kx = np.meshgrid(range(128), range(32), indexing="ij")
                    got = smem[kk * 4096 + (n // 8) * sbo + (kx // 16) * lbo + (n % 8) * 16 + kx % 16]
                    # N row n: group n / 32, matrix (n / 16) % 2, row n % 16 of it
                    for a in range(mats):
                        sel = (n // 16) % 2 == a
                        want = ms[a][(g0 + n // 32) * 16 + n % 16, kt * 128 + kk * 32 + np.array(A8_ORDER)[kx]]
                        assert np.array_equal(got[sel], want[sel]), (ex, g0, kt, kk, a)
    for lane in range(32):  # prefill_quant_rows: col = (l / 8) * 32 + 8 (l % 4) + 4 ((l / 4) % 2), bytes 0, 2, 1, 3
        col = (lane >> 3) * 32 + 8 * (lane & 3) + 4 * ((lane >> 2) & 1)
        assert [col + b for b in (0, 2, 1, 3)] == [32 * (lane // 8) + A8_ORDER[(4 * lane + b) % 32] for b in range(4)]


def test_fp8_tensor_scales_where_the_kernels_read_them():
    """FP8 per-tensor: gate/up blocks read matrix mt's weight and input scales at s13[e * 4 + mt * 2]
    and [+ 1], down blocks at s2[e * 2] and [+ 1] (the shared expert's without e); the packed
    record puts each source's pair there."""
    from moegen.plan import make_plan
    from moegen.spec import parse_spec
    from moegen.weights import fp8_tensor_scales, tensors

    spec = parse_spec({"name": "t", "model": "t", "hidden_size": 256, "experts": {
        "count": 5, "top_k": 2, "intermediate_size": 128, "format": "fp8_tensor"},
        "shared_expert": {"intermediate_size": 96, "format": "fp8_tensor"}}, check_generated=False)
    plan = make_plan(spec)
    rng = np.random.default_rng()
    given = {n: rng.uniform(0.1, 1.0, shape).astype(np.float32) for n, (shape, dt) in tensors(plan).items()
             if n.endswith(("_scale", "_input_scale"))}
    for p in ("experts", "shared_expert"):  # gate's and up's input scales equal (the kernels quantize x once for both)
        given[f"{p}.up_proj_input_scale"] = given[f"{p}.gate_proj_input_scale"]
    for pw in plan.weights:
        if pw.format != "fp8_tensor":
            continue
        flat = fp8_tensor_scales(pw, given).reshape(-1)
        experts = range(5) if pw.experts else [None]
        for e in experts:
            for mt, src in enumerate(pw.sources):
                at = ((e or 0) * len(pw.sources) + mt) * 2
                ws, ins = given[f"{src}_scale"], given[f"{src}_input_scale"]
                assert flat[at] == (ws[e] if e is not None else ws) and flat[at + 1] == (ins[e] if e is not None else ins)
    assert {pw.name: len(pw.sources) for pw in plan.weights if pw.format == "fp8_tensor"} == {
        "w13": 2, "w2": 1, "ws13": 2, "ws2": 1}  # the strides the templates use: 4 and 2 per expert
    # unequal gate and up input scales: the first expert whose differ is named
    w13 = next(pw for pw in plan.weights if pw.name == "w13")
    bad = {**given, "experts.up_proj_input_scale": given["experts.up_proj_input_scale"].copy()}
    bad["experts.up_proj_input_scale"][3] *= 2
    with pytest.raises(WeightError, match=r"experts\.up_proj_input_scale\[3\] = .* differs from experts\.gate_proj_input_scale\[3\]"):
        fp8_tensor_scales(w13, bad)
