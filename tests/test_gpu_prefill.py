"""GPU: the prefill grouped GEMM (wgmma) against float64 NumPy on the same bf16 values: every
permuted row of every expert, tiles full and partial, an expert without tokens; outputs poisoned
first; a token's row the same bits in a smaller batch."""

from __future__ import annotations

import ml_dtypes
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
    ids[: 3 * tokens // 4, 0] = 0
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


@pytest.mark.parametrize("tiles", [GemmTiles(), GemmTiles(bm=64), GemmTiles(bn=64), GemmTiles(ws=True),
                                   GemmTiles(bn=64, ws=True), GemmTiles(bn=160, ws=True)], ids=lambda t: t.gate_up_name)
def test_gate_up_on_packed_weights_matches_numpy(tiles):
    """The prefill gate/up GEMM reads the decode path's packed tiles (register A) and X' (K
    permuted as they are): silu(gate) * up per permuted row, written as H' (I permuted)."""
    import torch

    from moegen.prefill import permute_k
    from moegen.weights import pack_tiles

    e_count, inter, k, tokens = 5, 256, 320, 200
    gemm = GroupedGemm(tiles)
    rng = np.random.default_rng()
    x = rng.standard_normal((tokens, k)).astype(ml_dtypes.bfloat16)
    gate, up = ((rng.standard_normal((e_count, inter, k)) / k**0.5).astype(ml_dtypes.bfloat16) for _ in range(2))
    packed = pack_tiles([gate.view(np.uint16), up.view(np.uint16)], inter)  # [E, I/16, K/32, 2, 2, 32, 8]
    ids = rng.integers(0, e_count - 1, (tokens, 2))
    tok, _, counts = group_by_expert(ids, e_count)
    table = tile_table(counts, tiles.packed_rows)
    dev = {n: torch.from_numpy(np.ascontiguousarray(a).view(np.int16 if a.dtype == np.uint16 else a.dtype)).cuda()
           for n, a in
           (("xp", permute_k(x.view(np.uint16))), ("tok", tok), ("w", packed), ("tiles", table.reshape(-1)))}
    h = torch.full((len(tok), inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.gate_up(dev["xp"].data_ptr(), dev["tok"].data_ptr(), dev["w"].data_ptr(), dev["tiles"].data_ptr(),
                 h.data_ptr(), len(table), inter, k, inter // 16, e_count,
                 stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    experts = np.repeat(np.arange(e_count), counts)
    xf = x.astype(np.float64)[tok]
    g = np.einsum("pk,pik->pi", xf, gate.astype(np.float64)[experts])
    u = np.einsum("pk,pik->pi", xf, up.astype(np.float64)[experts])
    # H' as the down GEMM reads it: each row's I permuted in 32-wide chunks, as permute_k permutes X
    _check_rows(_host(h).astype(np.float64), permute_k(g / (1.0 + np.exp(-g)) * u), tiles.gate_up_name)


@pytest.mark.parametrize(("down_mats", "tiles"), [(1, GemmTiles()), (2, GemmTiles()), (2, GemmTiles(bn=64)),
                                                   (2, GemmTiles(ws=True)), (4, GemmTiles(ws=True)),
                                                   (2, GemmTiles(bn=160, ws=True)), (4, GemmTiles(bn=160, ws=True))],
                         ids=["m1", "m2", "m2-bn64", "m2-ws", "m4-ws", "m2-ws-bn160", "m4-ws-bn160"])
def test_prefill_experts_match_numpy(down_mats, tiles):
    """The whole routed-expert prefill from packed weights (permute, group, gate/up, down,
    combine) against float64 NumPy on the same bf16 values: uneven experts, an expert without
    tokens, some zero-expert entries (weight * x); the output poisoned first."""
    import torch

    from moegen.plan import PackedWeight
    from moegen.prefill import PrefillExperts
    from moegen.weights import _pack_one, pack_tiles

    e_count, hidden, inter, top_k, n = 8, 512, 384, 2, 300
    rng = np.random.default_rng()
    x = rng.standard_normal((n, hidden)).astype(ml_dtypes.bfloat16)
    gate, up = ((rng.standard_normal((e_count, inter, hidden)) / hidden**0.5).astype(ml_dtypes.bfloat16) for _ in range(2))
    down = (rng.standard_normal((e_count, hidden, inter)) / inter**0.5).astype(ml_dtypes.bfloat16)
    w13 = pack_tiles([gate.view(np.uint16), up.view(np.uint16)], inter)
    w2 = _pack_one(PackedWeight("w2", ("experts.down_proj",), down_mats, True, e_count, hidden, hidden, inter),
                   {"experts.down_proj": down.view(np.uint16)})
    ids = np.stack([rng.integers(0, e_count - 1, n), rng.integers(0, e_count - 1, n)], 1).astype(np.int32)
    ids[:120, 0] = 0  # expert 0 has more than a tile; expert e_count - 1 none
    ids[::37, 1] = e_count + 1  # zero experts: weight * x
    wts = rng.uniform(0.1, 1.0, (n, top_k)).astype(np.float32)
    layer = PrefillExperts(e_count, hidden, inter, top_k, down_mats, tiles)

    def dev(a):
        a = np.ascontiguousarray(a)
        return torch.from_numpy(a.view(np.int16) if a.dtype in (np.uint16, ml_dtypes.bfloat16) else a).cuda()

    d = {k: dev(v) for k, v in (("x", x), ("ids", ids), ("wts", wts), ("w13", w13), ("w2", w2))}
    ws = {name: torch.empty(shape, device="cuda", dtype=getattr(torch, dtype))
          for name, (shape, dtype) in layer.workspace(n).items()}
    out = torch.full((n, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    layer(n, *(d[k].data_ptr() for k in ("x", "ids", "wts", "w13", "w2")), out.data_ptr(),
          {k: v.data_ptr() for k, v in ws.items()}, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    xf = x.astype(np.float64)
    want = np.zeros((n, hidden))
    for t in range(n):
        for j in range(top_k):
            e = ids[t, j]
            if e >= e_count:
                want[t] += wts[t, j] * xf[t]
                continue
            g, u = gate[e].astype(np.float64) @ xf[t], up[e].astype(np.float64) @ xf[t]
            h = (g / (1.0 + np.exp(-g)) * u).astype(ml_dtypes.bfloat16).astype(np.float64)  # H is bf16
            want[t] += wts[t, j] * (down[e].astype(np.float64) @ h)
    _check_rows(_host(out).astype(np.float64), want, f"prefill experts, down tiles x{down_mats}, {tiles.gate_up_name}")
