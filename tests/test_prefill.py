"""Prefill building blocks on the CPU: the grouped-GEMM kernel compiles for sm_90a without spills
for its tile shapes, and the token grouping and tile table it reads are what they promise."""

from __future__ import annotations

import numpy as np
import pytest

from moegen.nvrtc import compile_cuda
from moegen.prefill import GemmTiles, group_by_expert, k_permutation, permute_k, render_grouped_gemm, tile_table
from moegen.weights import pack_tiles


@pytest.mark.parametrize("tiles", [GemmTiles(), GemmTiles(bm=64), GemmTiles(bn=256, stages=3)], ids=lambda t: t.name)
def test_grouped_gemm_compiles_clean(tiles):
    res = compile_cuda(render_grouped_gemm(tiles), "sm_90a", use_cache=False).resources
    names = [tiles.name, "moe_prefill_group_count", "moe_prefill_group_scan", "moe_prefill_group_place",
             "moe_prefill_combine", "moe_prefill_permute"]
    if tiles.bn <= 128:  # the packed-weight GEMMs hold two accumulator sets
        names += [tiles.gate_up_name] + [f"{tiles.down_name}_m{m}" for m in (1, 2, 4)]
    assert set(res) == set(names)
    for name in names:
        r = res[name]
        assert r.spill_stores == r.spill_loads == r.stack_bytes == 0, (name, r)
    assert max(tiles.smem_bytes, tiles.gate_up_smem_bytes, tiles.down_smem_bytes) <= 227 * 1024  # an H100/H200 block's shared memory


def test_tile_shapes_are_checked():
    for bad in ({"bm": 96}, {"bn": 24}, {"bn": 512}, {"stages": 2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GemmTiles(**bad)


def test_grouping_is_a_stable_sort_by_expert():
    rng = np.random.default_rng()
    ids = rng.integers(0, 7, (50, 3))
    ids[:, 1] = (ids[:, 0] + 1 + rng.integers(0, 6, 50)) % 7  # distinct experts per token, mostly
    tok, slot, counts = group_by_expert(ids, 9)
    assert counts.tolist() == np.bincount(ids.reshape(-1), minlength=9).tolist() and counts[7:].sum() == 0
    flat = ids.reshape(-1)
    experts_in_order = np.repeat(np.arange(9), counts)
    # each permuted row p holds one (token, slot) pair of its expert; tokens ascend within an expert
    for e in range(9):
        rows = np.nonzero(experts_in_order == e)[0]
        assert (np.diff(tok[rows]) >= 0).all()
    for t in range(50):
        for j in range(3):
            p = slot[t * 3 + j]
            assert tok[p] == t and experts_in_order[p] == flat[t * 3 + j]
    assert sorted(slot.tolist()) == list(range(150))
    with pytest.raises(ValueError, match=r"\[0, 9\)"):
        group_by_expert(np.array([[9]]), 9)


def test_tile_table_covers_each_expert_in_bm_row_tiles():
    counts = np.array([0, 5, 128, 129, 300])
    t = tile_table(counts, 128)
    assert t.tolist() == [[1, 0, 5], [2, 5, 128], [3, 133, 128], [3, 261, 1],
                          [4, 262, 128], [4, 390, 128], [4, 518, 44]]
    assert tile_table(np.zeros(3, int), 64).shape == (0, 3)


def test_permuted_k_rows_meet_the_packed_fragments():
    """X' (permute_k) against the GEMV tiles as register A fragments (the m16n8k16 layout: lane
    (g, t) holds row g and g+8 at k-step positions 2t, 2t+1 and 2t+8, 2t+9): summing A[row, p] *
    X'[16s + p] over the k-steps of a chunk gives W[row] . X, for every row and chunk."""
    rng = np.random.default_rng()
    k = 96
    w = rng.standard_normal((16, k)).astype(np.float32)
    x = rng.standard_normal(k)
    packed = pack_tiles([w.view(np.uint32)[:, :, None].view(np.uint16)[:, :, 1]], 16)  # the bf16 bits
    frag = packed[0, :, 0].view(np.uint16).astype(np.uint32) << 16  # [KC, 2 k-steps, 32 lanes, 8] as fp32 bits
    vals = frag.view(np.float32).astype(np.float64)
    xp = permute_k(x)
    got = np.zeros(16)
    for c in range(k // 32):
        for s in range(2):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                v = vals[c, s, lane]
                for (row, p), a in zip([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
                                        (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)], v):
                    got[row] += a * xp[32 * c + 16 * s + p]
    want = (w.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64) @ x  # w truncated to its bf16 bits
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert sorted(k_permutation()) == list(range(32))
    with pytest.raises(ValueError, match="multiple of 32"):
        permute_k(np.zeros(40))
