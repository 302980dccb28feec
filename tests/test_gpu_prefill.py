"""GPU: the prefill grouped GEMM (wgmma) against float64 NumPy on the same bf16 values: every
permuted row of every expert, tiles full and partial, an expert without tokens; outputs poisoned
first; a token's row the same bits in a smaller batch."""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu import _check_rows, _host

from moegen.prefill import GemmTiles, GroupedGemm, group_by_expert, tile_table

pytestmark = pytest.mark.gpu


def _run(gemm, x, ids, w, torch):
    tok, slot, counts = group_by_expert(ids.cpu().numpy(), w.shape[0])
    tiles = tile_table(counts, gemm.tiles.bm)
    tok_d = torch.from_numpy(tok).cuda()
    tiles_d = torch.from_numpy(tiles.reshape(-1)).cuda()
    y = torch.full((len(tok), w.shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm(x.data_ptr(), tok_d.data_ptr(), w.data_ptr(), tiles_d.data_ptr(), y.data_ptr(), len(tiles), w.shape[1],
         w.shape[2], stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return y, tok, slot, counts


@pytest.mark.parametrize("tiles", [GemmTiles(), GemmTiles(bm=64), GemmTiles(bn=256, stages=3)], ids=lambda t: t.name)
def test_grouped_gemm_matches_numpy(tiles):
    import torch

    e_count, n_out, k, tokens, top_k = 6, 512, 704, 300, 2
    gemm = GroupedGemm(tiles)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(e_count, n_out, k, device="cuda") / k**0.5).to(torch.bfloat16)
    # uneven loads: expert 5 gets no tokens, expert 0 more than two tiles
    ids = torch.stack([torch.randint(0, 5, (tokens,)), torch.randint(0, 5, (tokens,))], 1)
    ids[: tokens // 2, 0] = 0
    y, tok, slot, counts = _run(gemm, x, ids, w, torch)
    assert counts[5] == 0 and counts[0] > 2 * tiles.bm
    xh, wh, yh = _host(x).astype(np.float64), _host(w).astype(np.float64), _host(y).astype(np.float64)
    experts = np.repeat(np.arange(e_count), counts)
    want = np.einsum("pk,pnk->pn", xh[tok], wh[experts])
    _check_rows(yh, want, tiles.name)
    # the first 40 tokens alone: their rows are the same bits
    y2, _, slot2, _ = _run(gemm, x[:40].contiguous(), ids[:40], w, torch)
    ids_flat = np.arange(40 * top_k)
    assert torch.equal(y2[torch.from_numpy(slot2[ids_flat]).long().cuda()].view(torch.int16),
                       y[torch.from_numpy(slot[ids_flat]).long().cuda()].view(torch.int16))
