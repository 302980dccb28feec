"""Packing into the kernels' tile layout: round trip, and the fragment arithmetic it encodes."""

import ml_dtypes
import numpy as np
import pytest

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
