"""Prefill building blocks on the CPU: the grouped-GEMM kernel compiles for sm_90a without spills
for its tile shapes, and the token grouping and tile table it reads are what they promise."""

from __future__ import annotations

import numpy as np
import pytest

from moegen.nvrtc import compile_cuda
from moegen.prefill import GemmTiles, group_by_expert, render_grouped_gemm, tile_table


@pytest.mark.parametrize("tiles", [GemmTiles(), GemmTiles(bm=64), GemmTiles(bn=256, stages=3)], ids=lambda t: t.name)
def test_grouped_gemm_compiles_clean(tiles):
    res = compile_cuda(render_grouped_gemm(tiles), "sm_90a", use_cache=False).resources
    r = res[tiles.name]
    assert r.spill_stores == r.spill_loads == r.stack_bytes == 0, r
    assert tiles.smem_bytes <= 227 * 1024  # an H100/H200 block's shared memory


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
