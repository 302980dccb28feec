"""Quantized weight formats (shared/MODELS.md "Weight formats" a-e).

Each quantizer is checked against a SEPARATE transcription of its published definition written
here with Python loops and explicit bit fields (no moegen code, no ml_dtypes casts): the e2m1
table built from sign/exponent/mantissa bits, e4m3 from its bit fields, E8M0 as 2^(byte-127).
Plus: round trips through the checkpoint form, error bounds, planted extremes, and the loaders'
layouts (GPT-OSS interleave, NVFP4 gate/up scale_2) and refusals.
"""

from __future__ import annotations

import bisect
import math

import ml_dtypes
import numpy as np
import pytest

from moegen import quant as Q
from moegen.formats import E2M1_VALUES, e2m1_decode, e2m1_encode, e4m3_encode, e8m0_decode, pack_nibbles, unpack_nibbles

f32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu

# ----------------------------------------------------------------------------- the transcription


def e2m1_value(code: int) -> float:
    """OCP e2m1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_round(x: float) -> int:
    """Nearest e2m1 magnitude (ties to the even mantissa bit), saturating at 6; sign bit iff x < 0."""
    mag = min(abs(x), 6.0)
    code = min(range(8), key=lambda c: (abs(E2M1_TABLE[c] - mag), c & 1))
    return code | (8 if x < 0 else 0)


def e4m3_value(byte: int) -> float:
    """OCP e4m3fn: bit 7 sign, bits 6-3 exponent (bias 7), bits 2-0 mantissa; S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


E4M3_POS = [e4m3_value(b) for b in range(0x7F)]  # bytes 0x00..0x7E: every finite value >= 0, ascending


def e4m3_round(x: float) -> int:
    """Nearest e4m3 value (ties to the even mantissa bit), saturating at 448; sign from the float's sign bit."""
    mag = min(abs(x), 448.0)
    i = bisect.bisect_left(E4M3_POS, mag)
    cands = [b for b in (i - 1, i) if 0 <= b < len(E4M3_POS)]
    byte = min(cands, key=lambda b: (abs(E4M3_POS[b] - mag), b & 1))
    return byte | (0x80 if math.copysign(1.0, x) < 0 else 0)


def e8m0_value(byte: int) -> float:
    return 2.0 ** (byte - 127)


def pack_pairs(codes: list[int]) -> list[int]:
    """Byte j = code[2j] in the low nibble, code[2j+1] in the high nibble."""
    return [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(len(codes) // 2)]


def padded_row(row: np.ndarray, block: int) -> list[float]:
    vals = [float(v) for v in row]
    return vals + [0.0] * (-len(vals) % block)


def ref_fp8_block(w: np.ndarray, ue8m0: bool) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek format a: s = max(amax, 1e-4) / 448 in fp32 (ue8m0: 2^ceil(log2 s)), q = e4m3(w / s)."""
    n, k = w.shape
    q = np.zeros((n, k), np.uint8)
    s = np.zeros((-(-n // 128), -(-k // 128)), np.float32)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rows, cols = range(bi * 128, min(n, bi * 128 + 128)), range(bj * 128, min(k, bj * 128 + 128))
            amax = max(abs(float(w[i, j])) for i in rows for j in cols)
            sc = max(f32(amax), f32(1e-4)) / f32(448.0)
            if ue8m0:
                sc = f32(2.0 ** math.ceil(math.log2(sc)))
            s[bi, bj] = sc
            for i in rows:
                for j in cols:
                    q[i, j] = e4m3_round(float(f32(w[i, j]) / sc))
    return q, s


def ref_nvfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """ModelOpt NVFP4: scale_2 = amax / (6 * 448); block scale = e4m3(amax_b / (6 * scale_2)), 1 for a
    zero block; codes = e2m1(w / (scale * scale_2)) (0 where that product is 0); packed low nibble first."""
    gamax = max(abs(float(v)) for v in w.flat)
    s2 = f32(gamax) / f32(2688.0) if gamax else f32(1.0)
    packed, scales = [], []
    for row in w:
        vals, codes, srow = padded_row(row, 16), [], []
        for b in range(0, len(vals), 16):
            blk = vals[b : b + 16]
            bs = f32(max(abs(v) for v in blk)) / (f32(6.0) * s2)
            sbyte = e4m3_round(float(bs if bs != 0 else f32(1.0)))
            denom = f32(e4m3_value(sbyte)) * s2
            codes += [e2m1_round(float(f32(v) / denom)) if denom > 0 else 0 for v in blk]
            srow.append(sbyte)
        packed.append(pack_pairs(codes))
        scales.append(srow)
    return np.array(packed, np.uint8), np.array(scales, np.uint8), s2


def ref_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX: X = floor(log2(amax)) - 2, clamped to [-127, 127] (-127 for a zero block); codes = e2m1(v / 2^X)."""
    packed, scales = [], []
    for row in w:
        vals, codes, srow = padded_row(row, 32), [], []
        for b in range(0, len(vals), 32):
            blk = vals[b : b + 32]
            amax = max(abs(v) for v in blk)
            x = max(-127, min(127, math.floor(math.log2(amax)) - 2)) if amax else -127
            codes += [e2m1_round(v / 2.0**x) for v in blk]
            srow.append(x + 127)
        packed.append(pack_pairs(codes))
        scales.append(srow)
    return np.array(packed, np.uint8), np.array(scales, np.uint8)


def hf_gpt_oss_dequant(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' convert_moe_packed_tensors, as loops: LUT[low nibble] -> even, LUT[high] -> odd, ldexp."""
    out = np.zeros((*blocks.shape[:-2], blocks.shape[-2] * 32))
    for idx in np.ndindex(*blocks.shape[:-2]):
        for g in range(blocks.shape[-2]):
            for j in range(16):
                byte = int(blocks[(*idx, g, j)])
                for half, code in ((0, byte & 15), (1, byte >> 4)):
                    out[(*idx, g * 32 + 2 * j + half)] = math.ldexp(e2m1_value(code), int(scales[(*idx, g)]) - 127)
    return out


def bf16(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------------------- element codecs


def test_e2m1_table_from_bit_fields():
    assert [e2m1_value(c) for c in range(8)] == E2M1_TABLE
    assert [e2m1_value(c) for c in range(8, 16)] == [-v for v in E2M1_TABLE]
    assert E2M1_VALUES.tolist() == [e2m1_value(c) for c in range(16)]
    codes = np.arange(16, dtype=np.uint8)
    assert e2m1_decode(codes).tolist() == [e2m1_value(c) for c in range(16)]
    # every code from its value; -0 comes from a negative value that rounds to zero
    vals = np.array([e2m1_value(c) for c in range(16)], np.float32)
    vals[8] = -0.1
    assert e2m1_encode(vals).tolist() == list(range(16))
    assert e2m1_encode(np.array([-0.0, 0.0], np.float32)).tolist() == [0, 0]  # ModelOpt: sign iff x < 0


def test_e2m1_rounding_matches_transcription():
    rng = np.random.default_rng()
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # every tie, both signs, and past saturation
    x = np.concatenate([mids, [-m for m in mids], [6.0, 6.5, 7.0, 8.0, 1e30, -7.5, -1e30, 0.2, -0.2],
                        rng.uniform(-8, 8, 500)]).astype(np.float32)
    assert e2m1_encode(x).tolist() == [e2m1_round(float(v)) for v in x]


def test_e4m3_matches_transcription():
    rng = np.random.default_rng()
    everything = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
    by_hand = np.array([e4m3_value(b) for b in range(256)])
    assert np.array_equal(everything, by_hand, equal_nan=True)
    planted = [448.0, 464.0, 465.0, 500.0, 1e20, -1e20, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-6, 7 * 2.0**-9,
               2.0**-11, 1.0625, 1.1875, -0.0]
    x = np.concatenate([planted, rng.standard_normal(300) * 100, rng.standard_normal(300) * 2.0**-7]).astype(np.float32)
    assert e4m3_encode(x).view(np.uint8).tolist() == [e4m3_round(float(v)) for v in x]


def test_nibble_packing_matches_transcription_and_round_trips():
    rng = np.random.default_rng()
    codes = rng.integers(0, 16, (5, 64), dtype=np.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [pack_pairs(r.tolist()) for r in codes]
    assert np.array_equal(unpack_nibbles(packed), codes)
    swapped = pack_nibbles(codes, "high_even")
    assert np.array_equal(swapped, (packed << 4) | (packed >> 4))
    assert np.array_equal(unpack_nibbles(swapped, "high_even"), codes)
    with pytest.raises(Q.QuantError):
        pack_nibbles(codes[:, :3])


def test_e8m0_decode():
    b = np.array([0, 1, 126, 127, 128, 254, 255], np.uint8)
    got = e8m0_decode(b)
    assert got[:-1].tolist() == [e8m0_value(int(v)) for v in b[:-1]]
    assert np.isnan(got[-1])
    assert np.array_equal(e8m0_decode(b.view(E8M0))[:-1], got[:-1])


# ----------------------------------------------------------------------------- a. FP8 block 128x128


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(130, 20), (128, 256), (3, 5)])
def test_fp8_block_matches_transcription(shape, ue8m0):
    rng = np.random.default_rng()
    w = bf16(rng, *shape)
    got = Q.quantize_fp8_block(w, ue8m0=ue8m0)
    q, s = ref_fp8_block(w, ue8m0)
    assert got.q.shape == shape and got.scale_inv.shape == s.shape
    assert np.array_equal(got.q.view(np.uint8), q)
    assert np.array_equal(got.scale_inv.view(np.uint32), s.view(np.uint32))
    exact = [[e4m3_value(int(q[i, j])) * float(s[i // 128, j // 128]) for j in range(shape[1])] for i in range(shape[0])]
    assert np.array_equal(got.dequantize(), np.array(exact))  # W = q * s, exactly
    if ue8m0:
        assert (np.frexp(got.scale_inv)[0] == 0.5).all()
    else:  # each block's amax element lands exactly on e4m3's max
        for bi in range(s.shape[0]):
            blk = got.q.astype(np.float64)[bi * 128 : bi * 128 + 128, :128]
            assert np.abs(blk).max() == 448.0


def test_fp8_block_stacked_and_error_bound():
    rng = np.random.default_rng()
    w = bf16(rng, 3, 200, 130, scale=0.02)
    got = Q.quantize_fp8_block(w)
    assert got.q.shape == (3, 200, 130) and got.scale_inv.shape == (3, 2, 2)
    q, s = ref_fp8_block(w[1], False)
    assert np.array_equal(got.q[1].view(np.uint8), q) and np.array_equal(got.scale_inv[1], s)
    wf = w.astype(np.float64)
    s_el = np.repeat(np.repeat(got.scale_inv.astype(np.float64), 128, 1), 128, 2)[:, :200, :130]
    err = np.abs(got.dequantize() - wf)
    assert (err <= (2.0**-4 + 2.0**-23) * np.abs(wf) + 2.0**-10 * s_el).all()
    assert np.array_equal(got.dequantize(np.float32), got.dequantize().astype(np.float32))


def test_fp8_block_planted_blocks():
    w = np.zeros((130, 260), np.float32)
    c = 2.0**-3  # a power of two: s = 448c / 448 = c exactly, so q = w / c
    w[:128, :128] = c  # block (0, 0): max 448 and every positive subnormal
    w[0, 0] = 448 * c
    w[1, :7] = [m * 2.0**-9 * c for m in range(1, 8)]
    w[128:, 128:256] = 1e-7  # block (1, 1): amax below the 1e-4 floor
    got = Q.quantize_fp8_block(w)
    assert got.scale_inv[0, 0] == c
    assert got.q.view(np.uint8)[0, 0] == 0x7E and got.q.view(np.uint8)[1, :7].tolist() == list(range(1, 8))
    zero_s = f32(1e-4) / f32(448.0)
    assert got.scale_inv[0, 1] == zero_s and not got.q[:128, 128:256].view(np.uint8).any()  # all-zero block
    assert got.scale_inv[1, 1] == zero_s  # the floor, not amax / 448
    assert got.scale_inv[1, 2] == zero_s and got.q.shape == (130, 260)  # the 4-column tail block
    q, s = ref_fp8_block(w, False)
    assert np.array_equal(got.q.view(np.uint8), q) and np.array_equal(got.scale_inv, s)
    pow2 = Q.quantize_fp8_block(w, ue8m0=True)  # a scale that is already a power of two stays put
    assert pow2.scale_inv[0, 0] == c and pow2.scale_inv[1, 1] == 2.0**-22  # 1e-4 / 448 rounded up


# ----------------------------------------------------------------------------- d. FP8 per tensor


def test_fp8_tensor_matches_transcription_and_activations_saturate():
    rng = np.random.default_rng()
    w = bf16(rng, 33, 70)
    got = Q.quantize_fp8_tensor(w, input_scale=0.05)
    s = f32(max(abs(float(v)) for v in w.flat)) / f32(448.0)
    assert got.scale == s and got.scale.shape == ()
    assert got.q.view(np.uint8).tolist() == [[e4m3_round(float(f32(v) / s)) for v in r] for r in w]
    wf = w.astype(np.float64)
    assert (np.abs(got.dequantize() - wf) <= (2.0**-4 + 2.0**-23) * np.abs(wf) + 2.0**-10 * float(s)).all()
    assert Q.quantize_fp8_tensor(np.zeros((4, 4), np.float32)).scale == 1.0
    x = rng.standard_normal((4, 40)).astype(np.float32)
    xs = Q.fp8_input_scale(x)
    assert xs == f32(np.abs(x).max()) / f32(448.0)
    x[0, 0] = 1000.0 * xs  # past the calibrated range: clamps to 448 * s, never NaN
    deq = Q.fp8_tensor_activations(x, xs)
    assert deq[0, 0] == 448.0 * np.float64(xs)
    ref = [[e4m3_value(e4m3_round(float(f32(v) / xs))) * float(xs) for v in r] for r in x]
    assert np.array_equal(deq, np.array(ref))


# ----------------------------------------------------------------------------- b. NVFP4


@pytest.mark.parametrize("shape", [(6, 40), (4, 64)])
def test_nvfp4_matches_transcription(shape):
    rng = np.random.default_rng()
    w = bf16(rng, *shape, scale=0.03)
    got = Q.quantize_nvfp4(w)
    packed, scales, s2 = ref_nvfp4(w)
    assert got.k == shape[1] and got.packed.shape == packed.shape and got.segments == (shape[0],)
    assert np.array_equal(got.packed, packed)
    assert np.array_equal(got.scale.view(np.uint8), scales)
    assert got.scale_2.shape == (1,) and got.scale_2[0] == s2
    assert not unpack_nibbles(got.packed)[:, shape[1] :].any()  # the zero padding
    exact = [[e2m1_value((int(packed[i, j // 2]) >> (4 * (j % 2))) & 15) * e4m3_value(int(scales[i, j // 16]))
              * float(s2) for j in range(shape[1])] for i in range(shape[0])]
    assert np.array_equal(got.dequantize(), np.array(exact))  # e2m1 * (scale * scale_2), exactly


def test_nvfp4_planted_codes_zero_and_underflowing_blocks():
    w = np.zeros((2, 40), np.float32)
    vals = [e2m1_value(c) * 0.25 for c in range(16)]
    vals[8] = -0.01  # -0: a negative value that rounds to zero
    w[0, :16] = vals  # the tensor's amax block: its scale is e4m3 448
    w[1, 16:32] = 1e-9  # scale 1e-9 / (6 * 1.5 / 2688) underflows e4m3 -> 0: codes 0
    got = Q.quantize_nvfp4(w)
    assert got.scale.view(np.uint8)[0, 0] == 0x7E  # 448
    assert got.codes()[0, :16].tolist() == list(range(16))
    assert got.scale.astype(np.float32)[1, 0] == 1.0  # all-zero block: ModelOpt's scale 1.0
    assert got.scale.view(np.uint8)[1, 1] == 0 and not got.codes()[1, 16:32].any()
    packed, scales, s2 = ref_nvfp4(w)
    assert np.array_equal(got.packed, packed) and np.array_equal(got.scale.view(np.uint8), scales)
    assert got.scale_2[0] == s2 == f32(1.5) / f32(2688.0)
    deq = got.dequantize()
    assert deq[1].max() == 0 and np.allclose(deq[0, :16], w[0, :16], rtol=1e-6, atol=0.02)


def test_nvfp4_error_bound_and_stacked():
    rng = np.random.default_rng()
    w = bf16(rng, 3, 24, 48)
    got = Q.quantize_nvfp4(w)
    assert got.scale_2.shape == (3, 1)
    packed, scales, s2 = ref_nvfp4(w[2])
    assert np.array_equal(got.packed[2], packed) and got.scale_2[2, 0] == s2
    assert np.array_equal(got.scale[2].view(np.uint8), scales)
    wf = w.astype(np.float64)
    d = np.repeat(got.scale.astype(np.float64), 16, -1) * got.scale_2[..., None].astype(np.float64)
    bound = np.maximum(np.abs(wf), d) * 0.25 * (1 + 2.0**-20)
    assert (np.abs(got.dequantize() - wf) <= bound).all()


# ----------------------------------------------------------------------------- c/e. MXFP4


def test_mxfp4_matches_transcription_across_scale_extremes():
    rng = np.random.default_rng()
    w = rng.standard_normal((5, 70)).astype(np.float32)
    w[0] *= 1e-30
    w[1] *= 1e30
    w[2, :32] = 0.0
    got = Q.quantize_mxfp4(w)
    packed, scales = ref_mxfp4(w)
    assert got.k == 70 and got.packed.shape == (5, 48) and got.scale.shape == (5, 3)
    assert np.array_equal(got.packed, packed) and np.array_equal(got.scale, scales)
    assert got.scale[2, 0] == 0 and got.scale[0].max() < 40 and got.scale[1].min() > 200


def test_mxfp4_planted_codes_bytes_and_saturation():
    w = np.zeros((5, 64), np.float32)
    x = -3  # every code exactly: amax 6 * 2^x, so X = x
    w[0, :16] = [e2m1_value(c) * 2.0**x for c in range(16)]
    w[0, 8] = -0.1 * 2.0**x
    w[1, :32] = 2.0**-126  # floor(log2) - 2 = -128: clamped to byte 0
    w[2, :32] = np.linspace(-5, 7.9, 32)  # amax in [4, 8): byte 127; (6, 8) saturates to 6
    w[3, :32] = 3e38  # byte 125 + 127 = 252
    got = Q.quantize_mxfp4(w)
    assert got.scale[0, 0] == x + 127 and got.codes()[0, :16].tolist() == list(range(16))
    assert got.scale[0, 1] == 0 and got.scale[4].tolist() == [0, 0]  # all-zero blocks
    assert got.scale[1, 0] == 0 and got.scale[2, 0] == 127 and got.scale[3, 0] == 252
    assert got.codes()[2, 31] == 7 and got.dequantize()[2, 31] == 6.0
    packed, scales = ref_mxfp4(w)
    assert np.array_equal(got.packed, packed) and np.array_equal(got.scale, scales)
    ceil = Q.quantize_mxfp4(w, scale_rule="ceil")  # ModelOpt's rule: 2^ceil(log2(amax / 6)), no saturation
    assert ceil.scale[2, 0] == 128 and ceil.scale[0, 0] == x + 127


def test_mxfp4_error_bound_and_byte_254():
    rng = np.random.default_rng()
    w = bf16(rng, 2, 16, 96)
    got = Q.quantize_mxfp4(w)
    wf = w.astype(np.float64)
    s = np.repeat(e8m0_decode(got.scale), 32, -1)
    assert (np.abs(got.dequantize() - wf) <= np.maximum(np.abs(wf) / 3, s / 4)).all()
    blocks = rng.integers(0, 256, (2, 1, 16), dtype=np.uint8)
    scales = np.array([[254], [0]], np.uint8)  # the largest and smallest E8M0 scales
    deq = Q.MXFP4Weight(blocks.reshape(2, 16), scales, 32).dequantize()
    assert np.array_equal(deq, hf_gpt_oss_dequant(blocks, scales))


# ----------------------------------------------------------------------------- round trips


def _fp4_round_trip(w: object, back: object) -> None:
    assert np.array_equal(back.packed, w.packed) and np.array_equal(back.scale.view(np.uint8), w.scale.view(np.uint8))
    assert np.array_equal(back.codes(), w.codes()) and np.array_equal(back.dequantize(), w.dequantize())
    assert np.array_equal(pack_nibbles(unpack_nibbles(w.packed)), w.packed)


def test_round_trips_through_checkpoint_form():
    rng = np.random.default_rng()
    w = bf16(rng, 130, 96)
    for ue8m0 in (False, True):
        a = Q.quantize_fp8_block(w, ue8m0=ue8m0)
        b = Q.load_fp8_block({f"p.{k}": v for k, v in a.tensors().items()}, "p.")
        assert np.array_equal(b.q.view(np.uint8), a.q.view(np.uint8)) and np.array_equal(b.scale_inv, a.scale_inv)
        assert b.ue8m0 == ue8m0
    a8 = Q.quantize_fp8_block(w, ue8m0=True)
    e8 = Q.load_fp8_block({"weight": a8.q, "weight_scale_inv": a8.scale_inv.astype(E8M0)})  # ue8m0 storage
    assert np.array_equal(e8.dequantize(), a8.dequantize())
    t = Q.quantize_fp8_tensor(w, input_scale=0.5)
    tb = Q.load_fp8_tensor(t.tensors())
    assert np.array_equal(tb.q.view(np.uint8), t.q.view(np.uint8)) and tb.scale == t.scale and tb.input_scale == 0.5
    n = Q.quantize_nvfp4(w)
    _fp4_round_trip(n, Q.load_nvfp4(n.tensors()))
    m = Q.quantize_mxfp4(w)
    for order in ("low_even", "high_even"):
        ck = Q.dsv4_fp4_tensors(m, order)
        assert ck["weight"].dtype == np.int8 and ck["scale"].dtype == E8M0 and ck["weight"].shape == (130, 48)
        _fp4_round_trip(m, Q.load_dsv4_fp4(ck, scale_name="scale", nibble_order=order))


def test_dsv4_nibble_order_is_a_real_parameter():
    rng = np.random.default_rng()
    m = Q.quantize_mxfp4(bf16(rng, 8, 64))
    ck = Q.dsv4_fp4_tensors(m)  # default: low nibble = even element, as MXFP4
    assert np.array_equal(ck["weight"].view(np.uint8), m.packed)
    wrong = Q.load_dsv4_fp4(ck, scale_name="scale", nibble_order="high_even")
    codes = m.codes()
    assert np.array_equal(wrong.codes()[:, 0::2], codes[:, 1::2]) and not np.array_equal(wrong.codes(), codes)


# ----------------------------------------------------------------------------- loaders


def test_gpt_oss_loader_deinterleaves_gate_and_up():
    rng = np.random.default_rng()
    e, i, h = 2, 64, 96
    gate, up, down = (Q.quantize_mxfp4(bf16(rng, *s)) for s in ((e, i, h), (e, i, h), (e, h, i)))
    gu_blocks = np.zeros((e, 2 * i, h // 32, 16), np.uint8)
    gu_scales = np.zeros((e, 2 * i, h // 32), np.uint8)
    gu_bias = bf16(rng, e, 2 * i)
    for r in range(i):  # the checkpoint's interleave, written out: row 2r gate, row 2r+1 up
        gu_blocks[:, 2 * r], gu_blocks[:, 2 * r + 1] = gate.blocks()[:, r], up.blocks()[:, r]
        gu_scales[:, 2 * r], gu_scales[:, 2 * r + 1] = gate.scale[:, r], up.scale[:, r]
    pre = "model.layers.0.mlp.experts."
    ck = {pre + "gate_up_proj_blocks": gu_blocks, pre + "gate_up_proj_scales": gu_scales,
          pre + "down_proj_blocks": down.blocks(), pre + "down_proj_scales": down.scale,
          pre + "gate_up_proj_bias": gu_bias, pre + "down_proj_bias": bf16(rng, e, h)}
    got = Q.load_gpt_oss_experts(ck, pre)
    for mine, want in ((got.gate, gate), (got.up, up), (got.down, down)):
        _fp4_round_trip(want, mine)
    hf = hf_gpt_oss_dequant(gu_blocks, gu_scales)  # [E, 2I, H] as transformers dequantizes it
    assert np.array_equal(got.gate.dequantize(), hf[:, 0::2]) and np.array_equal(got.up.dequantize(), hf[:, 1::2])
    assert np.array_equal(got.gate_bias, gu_bias[:, 0::2]) and np.array_equal(got.up_bias, gu_bias[:, 1::2])
    assert got.gate.dequantize().shape == (e, i, h) and got.down.dequantize().shape == (e, h, i)


def test_nvfp4_gate_up_keeps_both_scale_2_exact():
    rng = np.random.default_rng()
    i, k = 24, 64
    g, u = Q.quantize_nvfp4(bf16(rng, i, k, scale=0.02)), Q.quantize_nvfp4(bf16(rng, i, k, scale=0.3))
    assert g.scale_2[0] != u.scale_2[0]
    ck = {f"mlp.experts.3.{name}.{t}": v for name, wt in (("gate_proj", g), ("up_proj", u))
          for t, v in wt.tensors().items()}
    fused = Q.load_nvfp4_gate_up(ck, "mlp.experts.3.gate_proj.", "mlp.experts.3.up_proj.")
    assert fused.segments == (i, i) and fused.packed.shape == (2 * i, k // 2)
    assert fused.scale_2.view(np.uint32).tolist() == [g.scale_2.view(np.uint32)[0], u.scale_2.view(np.uint32)[0]]
    assert np.array_equal(fused.packed, np.concatenate([g.packed, u.packed]))
    deq = fused.dequantize()
    assert np.array_equal(deq[:i], g.dequantize()) and np.array_equal(deq[i:], u.dequantize())
    back = fused.split()
    assert np.array_equal(back[1].scale_2, u.scale_2) and np.array_equal(back[1].packed, u.packed)
    with pytest.raises(Q.QuantError, match="split"):
        fused.tensors()


def test_fp8_block_activations_match_transcription():
    rng = np.random.default_rng()
    x = bf16(rng, 5, 200, scale=3.0)
    x[1, :128] = 0  # a zero block: s = 1e-4 / 448
    x[2, 128:] = bf16(rng, 72, scale=1e-6)  # amax below the 1e-4 floor: q = x / (1e-4 / 448), not 448 * x / amax
    for ue8m0 in (False, True):
        got = Q.fp8_block_activations(x, ue8m0=ue8m0)
        assert got.shape == x.shape and got.dtype == np.float64
        ref = np.zeros(x.shape)
        for t in range(5):
            for b in range(0, 200, 128):
                seg = [float(v) for v in x[t, b : b + 128]]
                s = max(f32(max(abs(v) for v in seg)), f32(1e-4)) / f32(448.0)
                if ue8m0:
                    s = f32(2.0 ** math.ceil(math.log2(s)))
                ref[t, b : b + len(seg)] = [e4m3_value(e4m3_round(float(f32(v) / s))) * float(s) for v in seg]
        assert np.array_equal(got, ref)
        xf = x.astype(np.float64)
        assert np.abs(got - xf).max() <= 2.0**-4 * np.abs(xf).max() and np.abs(got - xf).max() > 0


def test_quantizers_refuse_non_finite_and_non_float():
    w = np.ones((4, 32), np.float32)
    w[1, 3] = np.nan
    for fn in (Q.quantize_fp8_block, Q.quantize_fp8_tensor, Q.quantize_nvfp4, Q.quantize_mxfp4):
        with pytest.raises(Q.QuantError, match="NaN"):
            fn(w)
    with pytest.raises(Q.QuantError, match="dtype int32"):
        Q.quantize_mxfp4(np.ones((4, 32), np.int32))


# ----------------------------------------------------------------------------- refusals


def _fp8_block_ck(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f"x.{k}": v for k, v in Q.quantize_fp8_block(bf16(rng, 130, 20)).tensors().items()}


def _nvfp4_ck(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f"x.{k}": v for k, v in Q.quantize_nvfp4(bf16(rng, 8, 64)).tensors().items()}


def _gpt_oss_ck(rng: np.random.Generator) -> dict[str, np.ndarray]:
    gu, dn = Q.quantize_mxfp4(bf16(rng, 2, 128, 64)), Q.quantize_mxfp4(bf16(rng, 2, 64, 64))
    return {"gate_up_proj_blocks": gu.blocks(), "gate_up_proj_scales": gu.scale, "down_proj_blocks": dn.blocks(),
            "down_proj_scales": dn.scale, "gate_up_proj_bias": bf16(rng, 2, 128), "down_proj_bias": bf16(rng, 2, 64)}


def _dsv4_ck(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f"x.{k}": v for k, v in Q.dsv4_fp4_tensors(Q.quantize_mxfp4(bf16(rng, 8, 64))).items()}


def _nan_e4m3(a: np.ndarray) -> np.ndarray:
    b = a.view(np.uint8).copy()
    b.flat[3] = 0x7F
    return b.view(E4M3)


BAD = [  # (case, checkpoint maker, edit, loader, tensor the message must name)
    ("missing scale", _fp8_block_ck, lambda c: c.pop("x.weight_scale_inv"), "fp8", "x.weight_scale_inv"),
    ("weight not fp8", _fp8_block_ck, lambda c: c.update({"x.weight": np.zeros((130, 20), np.float32)}), "fp8",
     "x.weight"),
    ("scale grid", _fp8_block_ck, lambda c: c.update({"x.weight_scale_inv": np.ones((1, 1), np.float32)}), "fp8",
     "x.weight_scale_inv"),
    ("scale nan", _fp8_block_ck, lambda c: c.update({"x.weight_scale_inv": np.full((2, 1), np.nan, np.float32)}),
     "fp8", "x.weight_scale_inv"),
    ("weight nan", _fp8_block_ck, lambda c: c.update({"x.weight": _nan_e4m3(c["x.weight"])}), "fp8", "x.weight"),
    ("nvfp4 scale dtype", _nvfp4_ck, lambda c: c.update({"x.weight_scale": np.ones((8, 4), np.float32)}), "nvfp4",
     "x.weight_scale"),
    ("nvfp4 scale shape", _nvfp4_ck, lambda c: c.update({"x.weight_scale": c["x.weight_scale"][:, :3]}), "nvfp4",
     "x.weight_scale"),
    ("nvfp4 odd K", _nvfp4_ck, lambda c: c.update({"x.weight": c["x.weight"][:, :30]}), "nvfp4", "x.weight"),
    ("nvfp4 scale_2 missing", _nvfp4_ck, lambda c: c.pop("x.weight_scale_2"), "nvfp4", "x.weight_scale_2"),
    ("nvfp4 scale_2 vector", _nvfp4_ck, lambda c: c.update({"x.weight_scale_2": np.ones(2, np.float32)}), "nvfp4",
     "x.weight_scale_2"),
    ("nvfp4 scale negative", _nvfp4_ck, lambda c: c.update({"x.weight_scale": -c["x.weight_scale"]}), "nvfp4",
     "x.weight_scale"),
    ("gpt-oss blocks", _gpt_oss_ck, lambda c: c.update({"gate_up_proj_blocks": c["gate_up_proj_blocks"][..., :8]}),
     "gpt-oss", "gate_up_proj_blocks"),
    ("gpt-oss scales", _gpt_oss_ck, lambda c: c.update({"gate_up_proj_scales": c["gate_up_proj_scales"][:, :, :1]}),
     "gpt-oss", "gate_up_proj_scales"),
    ("gpt-oss nan scale", _gpt_oss_ck, lambda c: c["down_proj_scales"].__setitem__((0, 0, 0), 255), "gpt-oss",
     "down_proj_scales"),
    ("gpt-oss down H", _gpt_oss_ck, lambda c: c.update({"down_proj_blocks": c["down_proj_blocks"][:, :32],
                                                        "down_proj_scales": c["down_proj_scales"][:, :32]}),
     "gpt-oss", "down_proj_blocks"),
    ("gpt-oss odd rows", _gpt_oss_ck, lambda c: c.update({"gate_up_proj_blocks": c["gate_up_proj_blocks"][:, :3],
                                                          "gate_up_proj_scales": c["gate_up_proj_scales"][:, :3]}),
     "gpt-oss", "gate_up_proj_blocks"),
    ("gpt-oss bias missing", _gpt_oss_ck, lambda c: c.pop("down_proj_bias"), "gpt-oss", "down_proj_bias"),
    ("gpt-oss bias shape", _gpt_oss_ck, lambda c: c.update({"gate_up_proj_bias": c["gate_up_proj_bias"][:, :64]}),
     "gpt-oss", "gate_up_proj_bias"),
    ("dsv4 weight dtype", _dsv4_ck, lambda c: c.update({"x.weight": np.zeros((8, 32), np.float32)}), "dsv4",
     "x.weight"),
    ("dsv4 scale shape", _dsv4_ck, lambda c: c.update({"x.scale": c["x.scale"][:4]}), "dsv4", "x.scale"),
    ("dsv4 scale missing", _dsv4_ck, lambda c: c.pop("x.scale"), "dsv4", "x.scale"),
]

LOADERS = {
    "fp8": lambda c: Q.load_fp8_block(c, "x."),
    "nvfp4": lambda c: Q.load_nvfp4(c, "x."),
    "gpt-oss": lambda c: Q.load_gpt_oss_experts(c),
    "dsv4": lambda c: Q.load_dsv4_fp4(c, "x.", scale_name="scale"),
}


@pytest.mark.parametrize("case,make,edit,loader,name", BAD, ids=[b[0] for b in BAD])
def test_loaders_refuse_bad_input_naming_the_tensor(case, make, edit, loader, name):
    ck = make(np.random.default_rng())
    LOADERS[loader](dict(ck))  # the unedited checkpoint loads
    edit(ck)
    with pytest.raises(Q.QuantError) as err:
        LOADERS[loader](ck)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert msg.split(":")[0].removeprefix("missing tensor ") == name, msg
    assert "expected" in msg and "\n" not in msg


def test_nvfp4_gate_up_refuses_mismatched_partner():
    rng = np.random.default_rng()
    g, u = Q.quantize_nvfp4(bf16(rng, 8, 64)), Q.quantize_nvfp4(bf16(rng, 8, 32))
    ck = {f"{p}{t}": v for p, wt in (("g.", g), ("u.", u)) for t, v in wt.tensors().items()}
    with pytest.raises(Q.QuantError, match=r"^u\.weight: .*expected \[8, 32\]"):
        Q.load_nvfp4_gate_up(ck, "g.", "u.")
