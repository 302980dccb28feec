"""Prefill building blocks on the CPU: the grouped-GEMM kernel compiles for sm_90a without spills
for its tile shapes, and the token grouping and tile table it reads are what they promise."""

from __future__ import annotations

import numpy as np
import pytest

from moegen.nvrtc import compile_cuda
from moegen.prefill import (
    PREFILL_BN,
    TILE_INTS,
    GemmTiles,
    group_by_expert,
    k_permutation,
    permute_k,
    render_grouped_gemm,
    tile_table,
)
from moegen.weights import pack_tiles


@pytest.mark.parametrize("tiles", [GemmTiles(), GemmTiles(bm=64), GemmTiles(bn=256, stages=3)], ids=lambda t: t.name)
def test_grouped_gemm_compiles_clean(tiles):
    res = compile_cuda(render_grouped_gemm(tiles), "sm_90a", use_cache=False).resources
    names = [tiles.name, "moe_prefill_group_count", "moe_prefill_group_scan", "moe_prefill_group_place",
             "moe_prefill_combine", "moe_prefill_permute"]
    if tiles.bn <= max(PREFILL_BN):  # the packed-weight GEMMs hold two accumulator sets
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
    assert t[:, :3].tolist() == [[1, 0, 5], [2, 5, 128], [3, 133, 128], [3, 261, 1],
                                 [4, 262, 128], [4, 390, 128], [4, 518, 44]]
    assert tile_table(np.zeros(3, int), 64).shape == (0, 8)


def test_tile_tables_past_16_bit_tile_indices_are_refused():
    """A tile table's group word holds a tile index in 16 bits: a layer whose routing could make
    65536 tiles or more has no prefill buckets, and says why (the plan's top_k <= 32 and
    max_tokens <= 65536 keep every real layer under 33280; the Layer here skips the plan's checks)."""
    from pathlib import Path

    import yaml

    from moegen import prefill_plan
    from moegen.families import Layer
    from moegen.plan import TARGETS
    from moegen.spec import parse_spec

    data = yaml.safe_load((Path(__file__).resolve().parent.parent / "specs" / "qwen3-30b-a3b.yaml").read_text())
    wide = {**data, "experts": {**data["experts"], "top_k": 128}, "max_tokens": 65536}
    spec = parse_spec(wide, check_generated=False)
    assert "65664 tiles at max_tokens=65536 (at most 65535)" in prefill_plan.unsupported(Layer.of(spec, TARGETS[spec.arch]))
    spec = parse_spec({**wide, "max_tokens": 32768}, check_generated=False)
    assert "tiles at max_tokens" not in prefill_plan.unsupported(Layer.of(spec, TARGETS[spec.arch]))


def test_tile_groups_are_an_experts_tiles_cut_in_equal_parts_past_two_over_the_average():
    """The group word (first tile | tiles << 16): here 7 tiles over 5 experts, at most 2 + 2 a group,
    so every expert is one group; a hot expert of 11 tiles beside seven of one tile (at most 3 + 2
    a group) becomes parts of 4, 4 and 3 tiles."""
    word = lambda first, size: first | size << 16
    t = tile_table(np.array([0, 5, 128, 129, 300]), 128)
    assert t[:, 3].tolist() == [word(0, 1), word(1, 1), word(2, 2), word(2, 2), word(4, 3), word(4, 3), word(4, 3)]
    t = tile_table(np.array([11 * 64 - 5] + [64] * 6 + [50]), 64)
    assert t[:, 3].tolist() == [word(0, 4)] * 4 + [word(4, 4)] * 4 + [word(8, 3)] * 3 + [word(u, 1) for u in range(11, 18)]
    # gemm_tile's order (rb outer within a group): every block one (row block, tile), once, each
    # tile's expert, first row and rows from its group's entry
    rbs, seen = 3, set()
    for b in range(rbs * len(t)):
        e, _, _, g, grow0, glast = t[b // rbs, :6]
        first, size = g & 0xFFFF, g >> 16
        rem = b - first * rbs
        rb, i = rem // size, rem % size
        assert (e, grow0 + i * 64, glast if i + 1 == size else 64) == tuple(t[first + i, :3])
        seen.add((rb, first + i))
    assert seen == {(rb, u) for rb in range(rbs) for u in range(len(t))}


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


def _group_kernels(ids: np.ndarray, experts: int, top_k: int, bm: int, max_tiles: int):
    """templates/grouped_gemm.cu.j2's count, scan and place kernels, step for step: 1024-entry
    chunks, warps of 32 with __match_any_sync ranks, per-warp counts, zero experts skipped."""
    flat = ids.reshape(-1)
    p = flat.size
    chunks = -(-p // 1024)
    counts = np.zeros((chunks, experts), np.int64)
    for i, e in enumerate(flat):  # count
        if e < experts:
            counts[i // 1024, e] += 1
    total = counts.sum(0)
    counts = np.cumsum(counts, 0) - counts  # scan: each chunk's offset within its expert
    first = np.concatenate([[0], np.cumsum(total)])
    tiles = np.zeros((max_tiles, TILE_INTS), np.int64)
    ntile = -(-total // bm)
    gmax = (int(ntile.sum()) + experts - 1) // experts + 2
    t = 0
    for e in range(experts):
        c = int(ntile[e])
        parts = (c + gmax - 1) // gmax
        base, big = (c // parts, c % parts) if parts else (0, 0)
        for r in range(c):
            g0 = r // (base + 1) * (base + 1) if r < big * (base + 1) else r - (r - big * (base + 1)) % base
            size = base + 1 if r < big * (base + 1) else base
            tiles[t + r] = (e, first[e] + r * bm, min(bm, total[e] - r * bm), (t + g0) | size << 16,
                            first[e] + g0 * bm, min(bm, total[e] - (g0 + size - 1) * bm), 0, 0)
        t += c
    tiles[t:, 3] = np.arange(t, max_tiles) | 1 << 16
    tok, slot = np.full(p, -7), np.full(p, -7)
    for b in range(chunks):  # place
        ent = [flat[i] if i < p else -1 for i in range(b * 1024, b * 1024 + 1024)]
        wcnt = np.zeros((32, experts), np.int64)
        for w in range(32):
            lanes = ent[w * 32:(w + 1) * 32]
            for e in set(lanes):
                if 0 <= e < experts:
                    wcnt[w, e] = lanes.count(e)
        for j, e in enumerate(ent):
            i = b * 1024 + j
            if i >= p:
                continue
            if e >= experts:
                slot[i] = -1
                continue
            w, lane = divmod(j, 32)
            before = ent[w * 32: w * 32 + lane].count(e)
            row = first[e] + counts[b, e] + before + wcnt[:w, e].sum()
            tok[row], slot[i] = i // top_k, row
    return tok, slot, tiles, first


def test_grouping_kernels_agree_with_the_stable_sort():
    """The device grouping (its transcription) equals group_by_expert and tile_table, across
    several 1024-entry chunks, with zero-expert ids left out and unused tiles zeroed."""
    rng = np.random.default_rng()
    n, k, e = 700, 4, 11
    ids = rng.integers(0, e, (n, k))
    ids[:300, 0] = 3  # one expert across chunks
    ids[::13, 2] = e + 2  # zero experts
    tok, slot, tiles, first = _group_kernels(ids, e, k, 128, -(-n * k // 128) + e)
    routed = ids < e
    want_tok, _, counts = group_by_expert(np.where(routed, ids, e), e + 1)  # zero experts sort last
    rows = int(counts[:e].sum())
    assert first[-1] == rows and np.array_equal(tok[:rows], want_tok[:rows])
    assert (slot.reshape(n, k)[~routed] == -1).all()
    flat_slot = slot.reshape(n, k)
    for t in range(n):
        for j in range(k):
            if routed[t, j]:
                assert tok[flat_slot[t, j]] == t
    want_tiles = tile_table(counts[:e], 128)
    used = len(want_tiles)
    assert np.array_equal(tiles[:used], want_tiles) and not tiles[used:, [0, 1, 2, 4, 5, 6, 7]].any()
    assert np.array_equal(tiles[used:, 3], np.arange(used, len(tiles)) | 1 << 16)  # each its own group


def test_gate_up_writes_h_in_the_permuted_order():
    """The gate/up epilogue's column -> position formula is the inverse of k_permutation; the
    permute kernel's and the FP8 per-tensor row quantization's position -> column formulas are it."""
    perm = k_permutation()
    for c in range(32):
        at = 16 * ((c >> 2) & 1) + 8 * ((c >> 1) & 1) + 2 * (c >> 3) + (c & 1)  # as in the template
        assert perm[at] == c
    for at in range(0, 32, 2):  # and the permute kernel's position -> column, for even positions
        s, q, tt = at >> 4, (at >> 3) & 1, (at >> 1) & 3
        assert perm[at] == 8 * tt + 4 * s + 2 * q
    for at in range(0, 32, 2):  # the FP8 per-tensor row quantization's (prefill_quant_tile_body, PERM)
        c = at & 31
        col = 8 * ((c >> 1) & 3) + 4 * (c >> 4) + 2 * ((c >> 3) & 1)
        assert perm[at] == col and perm[at + 1] == col + 1


# ptxas's warnings that a kernel's wgmmas are serialized (C7512 too few registers; C7513, C7514, C7515
# A registers or accumulators touched while a group is in flight; C7519 an arrival the compiler
# inserted in a divergent path) or that setmaxnreg is ignored (C7508)
PTXAS_WARNINGS = ("C7508", "C7512", "C7513", "C7514", "C7515", "C7519")


@pytest.mark.parametrize("name,tuning", [("qwen3-30b-a3b", {}), ("qwen3-30b-a3b", {"prefill_bm": 64}),
                                         ("qwen3-30b-a3b", {"prefill_ws": False}),
                                         ("qwen3-30b-a3b", {"prefill_ws": False, "prefill_down_stages": 3}),
                                         ("qwen3-30b-a3b", {"prefill_down_pair": False}),
                                         ("qwen3-30b-a3b", {"prefill_bulk_a": False}),
                                         ("qwen3-30b-a3b", {"prefill_stage_y": False}),
                                         ("qwen3-30b-a3b-fp8", {}), ("qwen3-30b-a3b-fp8-a8", {}),
                                         ("qwen3-30b-a3b-nvfp4", {}), ("qwen3-30b-a3b-mxfp4", {})], ids=str)
def test_layer_prefill_gemms_compile_without_serialized_wgmma(name, tuning):
    """A layer's prefill GEMMs (the analytic plan's: a producer warpgroup, the weights by bulk copies;
    and its tunings; BF16, FP8 block weights with bf16 or FP8 activations (QGMMA in the SASS), NVFP4
    and MXFP4 weights (the F4 template argument, last))
    compile without spills and without ptxas's warnings that wgmmas are
    serialized (C7513, C7514, C7515: the A registers or accumulators touched while a group is in flight;
    C7512: too few registers; C7519: an arrival the compiler inserted in a divergent path)
    or that setmaxnreg is ignored (C7508: no register count fixed at entry); a two-block down GEMM
    stays within its registers."""
    from pathlib import Path

    from moegen.build import render_all
    from moegen.families import Tuning
    from moegen.plan import make_plan
    from moegen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    plan = make_plan(spec, tuning=Tuning(**tuning))
    out = compile_cuda(render_all(spec, plan)["layer.cu"], plan.arch, use_cache=False)
    for code in PTXAS_WARNINGS:
        assert code not in out.log, out.log
    gemms = [k for k in plan.kernels if k.family.startswith("prefill_gemm")]
    # FP8 activations: the large buckets' GEMMs too, on 128-row tiles (prefill_plan.a8_halves), and
    # the largest ones' gate/up on x's codes a row per (token, choice) (prefill_plan.a8_xrows)
    halves = [k for k in gemms if name.endswith("-a8") and "_bn128_" in k.name]
    xrows = int(name == "deepseek-v3-fp8-a8")
    assert len(halves) == (2 + xrows if name.endswith("-a8") else 0), [k.name for k in gemms]
    assert sum("_xrows_" in k.name for k in halves) == xrows
    gemms = [k for k in gemms if k not in halves]
    assert len(gemms) == 2 and all(("_ws_" in k.name) == tuning.get("prefill_ws", True) for k in gemms)
    assert all(k.name.count("_fp8_") == name.endswith("-fp8") for k in gemms), [k.name for k in gemms]
    assert all(k.name.count("_fp8a8") == name.endswith("-a8") for k in gemms), [k.name for k in gemms]
    fp4 = name.rsplit("-", 1)[1] if name.endswith("fp4") else ""
    assert all(k.name.count("fp4_") == bool(fp4) and (f"_{fp4}_" in k.name or not fp4) for k in gemms), \
        [k.name for k in gemms]
    assert all(((k.targs[7] if len(k.targs) > 7 else "0") == f"MOE_W_{fp4.upper()}") == bool(fp4) for k in gemms), \
        [k.targs for k in gemms]
    # the down GEMM on row-group pairs: the analytic plan's with a producer warpgroup and down_tiles 2
    pair = tuning.get("prefill_ws", True) and tuning.get("prefill_down_pair", True)
    assert [k.name.count("_pair_") for k in gemms] == [0, int(pair)], [k.name for k in gemms]
    # the weights' k-tiles by bulk copies (analytic, with the producer warpgroup): gate/up, and the
    # down GEMM on row-group pairs; the template's BULK argument with the name
    bulk = tuning.get("prefill_ws", True) and tuning.get("prefill_bulk_a", True)
    assert [k.name.count("_bulk") for k in gemms] == [int(bulk), int(bulk and pair)], [k.name for k in gemms]
    assert [len(k.targs) >= 7 and k.targs[6] == "true" for k in gemms] == [bulk, bulk and pair], [k.targs for k in gemms]
    # the persistent down GEMM's Y tile staged (analytic: BF16 and FP4 weights, two consumer warpgroups,
    # on row-group pairs): the template's STY argument (the last) with the name
    sty = pair and tuning.get("prefill_bm", 128) == 128 and tuning.get("prefill_stage_y", not name.endswith(("fp8", "a8")))
    assert [k.name.count("_sy_") for k in gemms] == [0, int(sty)], [k.name for k in gemms]
    assert [len(k.targs) == 13 and k.targs[12] == "true" for k in gemms] == [False, sty], [k.targs for k in gemms]
    for k in gemms + halves:
        r = out.resources[k.name]
        assert r.spill_stores == r.spill_loads == r.stack_bytes == 0, (k.name, r)
        if k.min_blocks == 2:
            assert r.registers * k.threads * 2 <= 65536, (k.name, r)


def test_fp8_prefill_takes_block_scaled_layers():
    """FP8 block weights get prefill buckets with the producer warpgroup only, with bf16 activations
    or FP8 ones (the tiles say which; the block format's widths are whole 128-wide K blocks, one
    k-tile of the FP8-activation GEMMs); the plain kernel is refused by name, and those layers stay
    on the GEMV path."""
    from pathlib import Path

    import yaml

    from moegen import prefill_plan
    from moegen.families import Layer, Tuning
    from moegen.plan import TARGETS, make_plan
    from moegen.spec import parse_spec

    data = yaml.safe_load((Path(__file__).resolve().parent.parent / "specs" / "qwen3-30b-a3b-fp8.yaml").read_text())
    ok = make_plan(parse_spec(data, check_generated=False))
    assert ok.prefill_from and ok.prefill_tiles[1] == prefill_plan.FP8_BN and ok.prefill_tiles[5:7] == (True, False)
    a8 = {**data, "experts": {**data["experts"], "fp8_activations": True}}
    ok8 = make_plan(parse_spec(a8, check_generated=False))
    assert ok8.prefill_from and ok8.prefill_tiles[5:7] == (True, True)
    cases = ((data, {"prefill_ws": False}, "without the producer warpgroup"),
             (a8, {"prefill_ws": False}, "without the producer warpgroup"))
    for d, tune, why in cases:
        spec = parse_spec(d, check_generated=False)
        assert why in prefill_plan.unsupported(Layer.of(spec, TARGETS[spec.arch], Tuning(**tune)))
        assert make_plan(spec, tuning=Tuning(**tune)).prefill_from == 0


@pytest.mark.parametrize("name,first", [("deepseek-v3-fp8-a8", 4096), ("qwen3-30b-a3b-fp8-a8", 2048)])
def test_fp8_activation_buckets_cut_their_tiles_at_128_rows_from_64_rows_an_expert(name, first):
    """The FP8-activation GEMMs take 128-row tiles (a block's two warpgroups a tile's halves) in the
    buckets whose smallest token count gives the routed experts 64 rows each on average, and pairs
    of 64-row tiles below: the scan, the GEMM kernels and their grids follow the bucket (the first
    such bucket as measured for the README: DeepSeek-V3 4096, Qwen3-30B-A3B 2048)."""
    from pathlib import Path

    from moegen.plan import make_plan
    from moegen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    plan = make_plan(spec)
    e, k = plan.local_experts, plan.top_k
    lo = 0
    seen = []
    for b in plan.buckets:
        smallest, lo = lo + 1, b.max_tokens
        if b.max_tokens < plan.prefill_from:
            continue
        halves = smallest * k >= 64 * e
        seen.append((b.max_tokens, halves))
        by = {l.kernel.split("_e")[0]: l for l in b.launches}
        scan = by["moe_prefill_scan"].kernel
        assert scan.endswith("_halves_" + plan.arch) == halves and (f"_r{128 if halves else 64}_" in scan), scan
        for fam in ("moe_prefill_gate_up", "moe_prefill_down"):
            gemm = by[fam]
            assert (f"_bn{128 if halves else 64}_" in gemm.kernel), gemm.kernel
            if gemm.grid[0] != "sms":  # a block per (row block, tile; a pair of 64-row tiles)
                tiles = -(-b.max_tokens * k // (128 if halves else 64)) + e
                assert gemm.grid[1] == (tiles if halves else -(-tiles // 2)), (gemm.kernel, gemm.grid)
    assert next(m for m, h in seen if h) == first and all(h == (m >= first) for m, h in seen), seen



@pytest.mark.parametrize("name,first", [("deepseek-v3-fp8-a8", 8192), ("qwen3-30b-a3b-fp8-a8", 1 << 30)])
def test_fp8_activation_gemms_read_their_rows_in_order_by_maps_over_the_codes_they_are_given(name, first):
    """Each FP8-activation GEMM whose token rows are in order (down, the shared expert's gate/up and
    down, and the routed gate/up of the buckets that give x's codes a row per (token, choice): from
    the one whose smallest N makes x's codes half of L2, DeepSeek-V3's 8192, none of Qwen3-30B-A3B's
    up to 16384) is handed, as its last
    argument, the tensor map over the very workspace buffer it reads its codes from: bytes, [rows][K]
    spanning that buffer's rows and no more than its bytes, a box one 64-row tile's 128-byte k-tile
    (the stage's rows) in the 128-byte swizzle that the A descriptor reads. The other routed gate/up
    GEMMs gather their rows (cp.async). Those buckets quantize x after the rows are placed, into
    its own rows of codes and scales, a row per (token, choice)."""
    import re
    from pathlib import Path

    from moegen.plan import make_plan
    from moegen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    plan = make_plan(spec)
    sizes = {b.name: (b.shape, int(np.prod(b.shape)) * np.dtype(b.dtype).itemsize) for b in plan.workspace}
    seen = set()
    for b in plan.buckets:
        if b.max_tokens < plan.prefill_from:
            continue
        names = [ln.kernel for ln in b.launches]
        xrows = b.max_tokens >= first
        for ln in b.launches:
            k = plan.kernel(ln.kernel)
            if k.family == "prefill_quant" and "quant_x" in k.name:  # after place where x's rows follow the table
                assert (names.index(k.name) > next(i for i, m in enumerate(names) if "_place_" in m)) == xrows
                assert ("ws.xqr" in k.arg_keys) == xrows and ("ws.pair_pos" in k.arg_keys) == xrows
            if not k.family.startswith("prefill_gemm"):
                continue
            seen.add(k.name)
            codes = k.arg_keys[0]
            routed_gate_up = k.family == "prefill_gemm_gate_up"
            assert codes == ("ws.xqr" if routed_gate_up and xrows else codes), (k.name, codes)
            m = plan.tensor_maps[int(re.fullmatch(r"static_cast<const char\*>\(tmaps\) \+ (\d+)", k.args[-1])[1]) // 128]
            assert m.workspace and m.weight == codes[3:], (k.name, m)
            (rows, _), nbytes = sizes[m.weight]
            width = {"xq": plan.hidden, "xqr": plan.hidden, "actq": plan.inter, "actq_s": plan.shared_inter}[m.weight]
            assert m.dims == (width, rows) and m.strides == (width,) and m.dims[0] * m.dims[1] <= nbytes
            assert rows == {"xq": spec.max_tokens, "actq_s": spec.max_tokens}.get(m.weight, spec.max_tokens * plan.top_k)
            assert (m.elem, m.swizzle, m.box) == (1, 128, (128, 64)), m
            assert (k.name.endswith("_xrows_" + plan.arch)) == (routed_gate_up and xrows), k.name
            assert (k.targs[13:14] == ("true",)) == (routed_gate_up and xrows), k.targs
    assert len(seen) == (9 if plan.shared_inter else 4)  # the 64-row pairs', the 128-row tiles', xrows' gate/up


@pytest.mark.parametrize("name,idle", [("deepseek-v3-fp8-a8", True), ("qwen3-30b-a3b-fp8-a8", False),
                                       ("kimi-k2-fp8", False)])
def test_fp8_activation_gate_up_gemms_skip_empty_tiles_where_their_k_loop_is_long(name, idle):
    """The FP8-activation gate/up GEMMs (routed and shared) take IDLE, their last template argument,
    where K = H gives at least A8_IDLE_KTILES k-tiles of 128 (DeepSeek-V3's 7168: 56; Qwen3-30B-A3B's
    2048: 16); down GEMMs never, nor the GEMMs on bf16 activations."""
    from pathlib import Path

    from moegen.plan import make_plan
    from moegen.prefill_plan import A8_IDLE_KTILES
    from moegen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    plan = make_plan(spec)
    assert (plan.hidden // 128 >= A8_IDLE_KTILES) == (plan.hidden == 7168)
    gemms = [k for k in plan.kernels if k.family.startswith("prefill_gemm")]
    assert gemms
    for k in gemms:
        gated, a8 = k.targs[0] == "true", k.targs[4:5] == ("true",)
        assert (k.targs[14:15] == ("true",)) == (idle and gated and a8), (k.name, k.targs)
        assert len(k.targs) <= 15


def _compiles_clean(spec, plan, kernels) -> None:
    """The layer compiles without ptxas's warnings (C7508: setmaxnreg ignored; C7513, C7514: wgmmas
    serialized), and these kernels without spills or a stack frame."""
    from moegen.build import render_all

    out = compile_cuda(render_all(spec, plan)["layer.cu"], plan.arch, use_cache=False)
    for code in PTXAS_WARNINGS:
        assert code not in out.log, out.log
    for k in kernels:
        r = out.resources[k.name]
        assert r.spill_stores == r.spill_loads == r.stack_bytes == 0, (k.name, r)



def test_fp8_activation_gemm_on_x_rows_in_table_order_compiles_clean():
    """DeepSeek-V3-FP8-a8's routed gate/up GEMM of the buckets that give x's codes a row per (token,
    choice) (prefill_plan.a8_xrows) and the other prefill GEMMs of its layer compile without ptxas's
    serialization warnings, spills or a stack frame."""
    from pathlib import Path

    from moegen.plan import make_plan
    from moegen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / "deepseek-v3-fp8-a8.yaml")
    plan = make_plan(spec)
    gemms = [k for k in plan.kernels if k.family.startswith("prefill_gemm")]
    assert sum(k.name.endswith("_xrows_" + plan.arch) for k in gemms) == 1
    _compiles_clean(spec, plan, gemms)

@pytest.mark.parametrize("name,first,cut", [
    ("qwen3-next-80b-a3b", 1024, 0), ("qwen3-30b-a3b", 512, 0), ("mixtral-8x7b", 128, 0),
    ("deepseek-v3-fp8", 256, 242), ("qwen3-30b-a3b-fp8", 256, 0), ("kimi-k2-fp8", 512, 363),
    ("qwen3-30b-a3b-fp8-a8", 16, 0),
    ("llama-4-scout", 256, 0), ("gpt-oss-20b", 256, 0), ("gpt-oss-120b", 1024, 0),
    ("qwen3-30b-a3b-mxfp4", 512, 415), ("qwen3-30b-a3b-nvfp4", 512, 415), ("deepseek-v3-nvfp4", 1024, 742),
    ("gpt-oss-20b-mxfp4", 256, 207), ("gpt-oss-120b-mxfp4", 1024, 831),
    ("llama-4-maverick", 2048, 0), ("qwen1.5-moe-a2.7b", 256, 0),
    ("qwen2-57b-a14b", 128, 0)])
def test_the_analytic_crossover_is_where_the_h200_measured_it(name, first, cut):
    """The first prefill bucket of the analytic plan, where A/B runs on the H200 put the crossover
    (moegen.prefill_plan.TOKENS_PER_EXPERT): Qwen3-Next-80B-A3B's GEMV path 1010.9 us at N = 512
    against the prefill kernels' 869.8 (the bucket from 513 on), Qwen3-30B-A3B's 335.7 against 328.1
    at 256 (too close to move its bucket of 129..256); FP8 block weights cross between 8 and 9 tokens an
    expert: DeepSeek-V3-FP8's 3762 against 3579 at 256 and 5046 against 3877 at 512 (2026-12-02), so
    from its bucket of 257..512, Qwen3-30B-A3B-FP8's 200.2 against 225.4 at 128 and 275.6 against
    230.0 at 256, so from its bucket of 257..512 (Kimi-K2-FP8, 42.8 experts' worth a token, from 513),
    GPT-OSS-120B's 1634.6 against 1603.1 at 513; FP4 weights cross at 16-32 tokens an expert:
    Qwen3-30B-A3B-MXFP4's 299.5 against 328.3 at 257 and 441.5 against 335.2 at 512,
    DeepSeek-V3-NVFP4's 4704.0 against 5530.4 at 513 and 7989.2 against 5614.8 at 1024. A shared
    expert counts as si / i experts taking every token: Llama-4-Scout's 1271.2 against 1130.0 at 129,
    Llama-4-Maverick's 10371.3 against 7612.0 at 1025, Qwen1.5-MoE-A2.7B's 395.1 against 370.2 at
    129, Qwen2-57B-A14B's 1215.4 against 1153.5 at 65. FP8 and FP4 weights cut the bucket that holds
    their crossover there (prefill_plan.prefill_split; the H200, 2026-12-02, each at the bucket's own
    tiles): Qwen3-30B-A3B-NVFP4's 304.6 against 343.7 at 384 and 352.0 against 347.0 at 448;
    DeepSeek-V3-FP8's 3609 against 3678 at 192 and 3808 against 3687 at 224; Qwen3-30B-A3B-FP8's
    crossover (136) within an eighth of its bucket's 129, so the whole bucket: 260.3 against 222.5 at
    130."""
    from pathlib import Path

    from moegen.plan import make_plan
    from moegen.spec import load_spec

    plan = make_plan(load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml"))
    assert plan.prefill_from == first
    sizes = [b.max_tokens for b in plan.buckets]
    assert next(b for b in sizes if b >= first) == first
    # the GEMV path's last bucket: the crossover's cut inside the first prefill bucket, or the
    # power of two below it; every other bucket a power of two (or max_tokens)
    assert max(b for b in sizes if b < first) == (cut or first // 2)
    assert [b for b in sizes if b & (b - 1) and b != plan.max_tokens] == ([cut] if cut else [])
    for b in plan.buckets:
        gemms = [ln.kernel for ln in b.launches if ln.kernel.startswith("moe_prefill_")]
        assert bool(gemms) == (b.max_tokens >= first), (b.max_tokens, gemms)


def test_the_prefill_router_blocks_cover_the_router_rows_in_row_tiles():
    """Every catalog spec: each bucket's router launch covers the router's padded rows exactly,
    16-row tiles times the K split (decode) or times the row tiles a block takes (prefill: no K
    split, router_tiles of them, which divide the tiles and are at most ROUTER_TILES); decode
    routers take one tile a block."""
    import re
    from pathlib import Path

    from moegen.families import ROUTER_TILES
    from moegen.plan import make_plan
    from moegen.spec import load_spec

    seen_rt = set()
    for path in sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.yaml")):
        plan = make_plan(load_spec(path))
        for b in plan.buckets:
            for ln in b.launches:
                m = re.match(r"moe_router_r(\d+)_h\d+_ks(\d+)_nt\d+(?:_rt(\d+))?_", ln.kernel)
                if not m:
                    continue
                rows, ks, rt = int(m[1]), int(m[2]), int(m[3] or 1)
                prefill = bool(plan.prefill_from) and b.max_tokens >= plan.prefill_from
                assert ln.grid[0] * 16 * rt == rows * ks, (path.name, b.max_tokens, ln)
                if prefill:
                    assert ks == 1 and (rows // 16) % rt == 0 and rt <= ROUTER_TILES, (path.name, ln.kernel)
                    assert rt == max(r for r in range(1, ROUTER_TILES + 1) if (rows // 16) % r == 0)
                    seen_rt.add(rt)
                else:
                    assert rt == 1, (path.name, b.max_tokens, ln.kernel)
    assert {1, 4} <= seen_rt  # Mixtral's one tile, the 128- and 256-expert routers' four


def test_clamped_silu_layers_get_prefill_buckets():
    """SiLU clamped at the layer's limit (DeepSeek-V4) runs on the prefill GEMMs too: the epilogue
    clamps the routed experts' gate and up (the shared expert's as ActRule::SHARED_LIMIT says), the
    kernels' names carry the activation, and the four GEMMs compile without spills or ptxas's
    warnings."""
    from pathlib import Path

    from moegen import prefill_plan
    from moegen.families import Layer
    from moegen.plan import TARGETS, make_plan
    from moegen.spec import load_spec

    specs = Path(__file__).resolve().parent.parent / "specs"
    spec = load_spec(specs / "deepseek-v4-flash.yaml")
    plan = make_plan(spec)
    gemms = [k for k in plan.kernels if k.family.startswith("prefill_gemm")]
    assert plan.prefill_from and len(gemms) == 4, [k.name for k in gemms]
    assert all("_silu_gated_l10_" in k.name for k in gemms if "gate_up" in k.family), [k.name for k in gemms]
    _compiles_clean(spec, plan, gemms)
    assert not prefill_plan.unsupported(Layer.of(spec, TARGETS[spec.arch]))


def test_weight_on_input_layers_get_prefill_buckets():
    """Llama-4's routing weight on the expert input through the prefill kernels: the place kernel
    writes each row's weight into slot_w, the routed gate/up GEMM (template argument WOI, last) reads
    it after its two scale arguments, the combine adds Y unweighted; the shared expert's GEMMs are
    the plain ones; everything compiles without spills or ptxas's warnings. Without the producer
    warpgroup the layer stays on the GEMV path, by name."""
    from pathlib import Path

    from moegen import prefill_plan
    from moegen.families import Layer, Tuning
    from moegen.plan import TARGETS, make_plan
    from moegen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / "llama-4-scout.yaml")
    plan = make_plan(spec)
    # 16 experts top-1 and a shared expert as wide (taking every token): 10 tokens each from N = 85,
    # the bucket of 129..256
    assert plan.prefill_from == 256
    ks = {k.family: k for k in plan.kernels if k.family.startswith("prefill")}
    assert ks["prefill_place"].targs == ("true",) and ks["prefill_place"].arg_keys[-3:] == ("ws.topk_w", "ws.slot_w", "n")
    gu = ks["prefill_gemm_gate_up"]
    assert gu.targs[-1] == "true" and gu.args[-3:] == ("nullptr", "nullptr", "wrow") and gu.arg_keys[-1] == "ws.slot_w"
    shared = ks["prefill_gemm_gate_up_shared"].targs  # (WOI, the ninth, false: listed where a later one is not its default)
    assert (len(shared) < 9 or shared[8] == "false") and "wrow" not in ks["prefill_gemm_gate_up_shared"].args
    assert ks["prefill_combine"].targs == ("true",)
    _compiles_clean(spec, plan, ks.values())
    why = prefill_plan.unsupported(Layer.of(spec, TARGETS[spec.arch], Tuning(prefill_ws=False)))
    assert "routing weights on the input without the producer warpgroup" in why


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-20b-mxfp4"])
def test_expert_bias_layers_get_prefill_buckets(name):
    """GPT-OSS's experts (BF16, and MXFP4 as released) through the prefill kernels: widths of 2880
    (180 16-row tiles, 90 row groups: whole blocks of neither 8 warps nor 4) take the plan's two
    consumer warpgroups and the down GEMM on row-group pairs, the last row block of each GEMM
    overlapping the one before; the gate/up and down GEMMs (template argument BIAS, last) take the
    experts' biases after their scale and weight arguments; everything compiles without spills or
    ptxas's warnings, in BF16 with one consumer warpgroup too (tuning prefill_bm=64), which FP4
    weights are refused (their down pairs spill there)."""
    from pathlib import Path

    from moegen import prefill_plan
    from moegen.families import Layer, Tuning
    from moegen.plan import TARGETS, make_plan
    from moegen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    plan = make_plan(spec)
    assert plan.prefill_from == 256 and plan.prefill_tiles[0] == 128  # 32 experts, top-4
    ks = {k.family: k for k in plan.kernels if k.family.startswith("prefill_gemm")}
    gu, dn = ks["prefill_gemm_gate_up"], ks["prefill_gemm_down"]
    n_sc = 2 if name.endswith("mxfp4") else 0  # (the scale records' pointers, then xs)
    assert gu.targs[-1] == "true" and gu.args[-5:] == (*(("s13",) if n_sc else ("nullptr",)), "nullptr", "nullptr",
                                                       "b_gate", "b_up")
    assert dn.targs[-1] == "true" and dn.args[-4:] == (*(("s2",) if n_sc else ("nullptr",)), "nullptr", "nullptr",
                                                       "b_down")
    assert "_pair" in dn.name and gu.arg_keys[-2:] == ("w.b_gate", "w.b_up") and dn.arg_keys[-1] == "w.b_down"
    # the row blocks rounded up: 180 tiles in 23 blocks of 8 warps, 90 row groups in 12 (the last
    # block of each overlapping the one before; gg::row_unit)
    grids = {x.kernel: x.grid for x in plan.buckets[-1].launches}
    assert grids[gu.name][0] == 23 and grids[dn.name][0] == 12, (grids[gu.name], grids[dn.name])
    _compiles_clean(spec, plan, ks.values())
    one = Tuning(prefill_bm=64)
    if n_sc:
        assert "mxfp4 weights with one consumer warpgroup" in prefill_plan.unsupported(Layer.of(spec, TARGETS[spec.arch], one))
    else:
        plan = make_plan(spec, tuning=one)
        assert plan.prefill_tiles[0] == 64 and plan.prefill_from == 512  # (twice the tokens an expert)
        _compiles_clean(spec, plan, [k for k in plan.kernels if k.family.startswith("prefill_gemm")])


def test_a_shared_expert_in_another_format_takes_its_own_tile():
    """DeepSeek-V4-Flash-FP4's FP8 block shared expert beside its MXFP4 routed experts: the shared GEMMs take FP8 block's tile (64 tokens, template argument BNT after BIAS,
    whose register-A wgmma wrappers are rendered beside the routed tile's 128), the scan cuts the
    shared expert's tile table at 64 rows, the launches size the shared GEMMs' rings by their own
    tile; the layer compiles without spills or ptxas's warnings. A shared expert in a format the
    GEMMs do not take, or beside FP8 activations, stays refused by name."""
    from pathlib import Path

    import yaml

    from moegen import prefill_plan
    from moegen.families import Layer
    from moegen.plan import TARGETS, make_plan
    from moegen.spec import parse_spec

    data = yaml.safe_load((Path(__file__).resolve().parent.parent / "specs" / "deepseek-v4-flash-fp4.yaml").read_text())
    spec = parse_spec({**data, "max_tokens": 16384}, check_generated=False)
    plan = make_plan(spec)
    assert plan.prefill_from == 1024 and plan.prefill_tiles[1] == 128 and plan.prefill_tiles[9] == "mxfp4"
    ks = {k.family: k for k in plan.kernels if k.family.startswith("prefill")}
    gus, dns = ks["prefill_gemm_gate_up_shared"], ks["prefill_gemm_down_shared"]
    assert len(gus.targs) == len(dns.targs) == prefill_plan.BNT_ARG + 1 and gus.targs[-1] == dns.targs[-1] == "64"
    assert gus.targs[3] == dns.targs[3] == "true" and gus.targs[7] == "0"  # FP8, not F4
    assert len(ks["prefill_gemm_gate_up"].targs) <= prefill_plan.BNT_ARG
    assert prefill_plan.other_bn(plan.kernels, plan.prefill_tiles[1]) == 64
    assert ks["prefill_scan"].args[-1] == "64" and ks["prefill_scan"].args[-2] == str(-(-16384 // 64))
    launches = {x.kernel: x for x in plan.buckets[-1].launches}
    shared_tile = prefill_plan.shared_tiles_of(Layer.of(spec, TARGETS[spec.arch]))
    assert launches[gus.name].smem == shared_tile.gate_up_smem_bytes != launches[ks["prefill_gemm_gate_up"].name].smem
    assert launches[gus.name].grid[1] == -(-16384 // 64)
    _compiles_clean(spec, plan, [k for k in plan.kernels if k.family.startswith("prefill_gemm")])
    a8 = parse_spec({**data, "max_tokens": 16384, "experts": {**data["experts"], "format": "fp8_block",
                                                              "fp8_activations": True},
                     "shared_expert": {**data["shared_expert"], "format": "bf16"}}, check_generated=False)
    assert "shared expert bf16 beside fp8_block experts" in prefill_plan.unsupported(Layer.of(a8, TARGETS[a8.arch]))


def test_fp8_per_tensor_experts_get_prefill_kernels():
    """Qwen3-30B-A3B-FP8-tensor's layer: no X'; after place, each routed
    row of x quantized by its expert's static input scale (a block per routed tile, into xp with a
    row per (token, choice)); gate/up and down on the e4m3 codes (template argument PT8, last;
    GATHER false: the rows in order), their scales the GEMV's s13 / s2; H' quantized in place
    between them; BF16's tile (128 tokens: the sums over all of K, one scale at the end); the
    layer compiles without spills or ptxas's warnings. With a shared expert it stays refused."""
    from pathlib import Path

    import yaml

    from moegen import prefill_plan
    from moegen.families import Layer
    from moegen.plan import TARGETS, make_plan
    from moegen.spec import parse_spec

    data = yaml.safe_load((Path(__file__).resolve().parent.parent / "specs" / "qwen3-30b-a3b-fp8-tensor.yaml").read_text())
    spec = parse_spec({**data, "max_tokens": 16384}, check_generated=False)
    plan = make_plan(spec)
    assert plan.prefill_from == 512 and plan.prefill_tiles[1] == 128 and plan.prefill_tiles[10] is True
    ks = {k.name: k for k in plan.kernels if k.family.startswith("prefill")}
    order = [x.kernel for x in plan.buckets[-1].launches if x.kernel in ks]
    assert [ks[n].family for n in order] == ["prefill_count", "prefill_scan", "prefill_place", "prefill_quant",
                                              "prefill_gemm_gate_up", "prefill_quant", "prefill_gemm_down",
                                              "prefill_combine"]
    qx, gu, qh, dn = (ks[order[i]] for i in (3, 4, 5, 6))
    assert qx.targs == ("true",) and qx.args[:5] == ("x", "tok", "tiles", "s13", "4") and qx.arg_keys[-1] == "ws.xp"
    assert qh.targs == ("false",) and qh.args[:6] == ("h", "nullptr", "tiles", "s2", "2", "h")
    assert gu.targs[2] == "false" and gu.targs[-1] == dn.targs[-1] == "true" and len(gu.targs) == 12
    assert gu.args[-1] == "s13" and dn.args[-1] == "s2" and "_fp8t_" in gu.name
    assert {b.name: b.shape for b in plan.workspace}["xp"] == (16384 * 8, 2048)  # a row per (token, choice)
    _compiles_clean(spec, plan, [k for k in plan.kernels if k.family.startswith("prefill")])
    shared = parse_spec({**data, "max_tokens": 16384, "shared_expert": {"intermediate_size": 512, "format": "fp8_tensor"}},
                        check_generated=False)
    assert "FP8 per-tensor experts without the producer warpgroup, or with a shared expert" in prefill_plan.unsupported(
        Layer.of(shared, TARGETS[shared.arch]))


def test_fp4_prefill_takes_nvfp4_and_mxfp4_layers_with_bulk_copies_and_pairs():
    """NVFP4 and MXFP4 weights get prefill buckets (BF16's tile, the format in the tiles) with the
    producer warpgroup, the weights by bulk copies and the down GEMMs on row-group pairs; without
    any of them the layer stays on the GEMV path and the plan names why. Rings that do not fit a
    block's shared memory are refused by name too."""
    from pathlib import Path

    from moegen import prefill_plan
    from moegen.families import Layer, Tuning
    from moegen.plan import TARGETS, make_plan
    from moegen.spec import load_spec

    for fmt in ("nvfp4", "mxfp4"):
        spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"qwen3-30b-a3b-{fmt}.yaml")
        ok = make_plan(spec)
        assert ok.prefill_from == 512 and ok.prefill_tiles[1] == prefill_plan.TILES.bn and ok.prefill_tiles[9] == fmt
        for tune in ({"prefill_ws": False}, {"prefill_bulk_a": False}, {"prefill_down_pair": False}):
            why = prefill_plan.unsupported(Layer.of(spec, TARGETS[spec.arch], Tuning(**tune)))
            assert f"{fmt} weights without the producer warpgroup's bulk copies and row-group pairs" in why, (tune, why)
            assert make_plan(spec, tuning=Tuning(**tune)).prefill_from == 0
    bf16 = load_spec(Path(__file__).resolve().parent.parent / "specs" / "qwen3-30b-a3b.yaml")
    why = prefill_plan.unsupported(Layer.of(bf16, TARGETS[bf16.arch], Tuning(prefill_stages=5)))
    assert "rings of 5 / 5 stages exceed a block's shared memory" in why


@pytest.mark.parametrize("name,routed,shared", [
    ("qwen3-30b-a3b", True, None), ("qwen3-30b-a3b-nvfp4", True, None), ("qwen3-30b-a3b-fp8", False, None),
    ("qwen3-30b-a3b-fp8-a8", False, None), ("mixtral-8x7b", False, None), ("gpt-oss-20b", False, None),
    ("qwen3-next-80b-a3b", True, True), ("qwen1.5-moe-a2.7b", True, False), ("deepseek-v4-flash-fp4", True, False)])
def test_the_down_gemms_stage_their_y_tile_where_persistent_with_bf16_or_fp4_weights(name, routed, shared):
    """The analytic stage_y: the down GEMMs on row-group pairs that run persistent (K = I, or si for
    the shared expert's, at most PERSISTENT_KTILES k-tiles) with BF16 or FP4 weights stage their Y
    tile (not FP8 weights, not Mixtral's or GPT-OSS's long k-loops, not Qwen1.5-MoE's shared expert
    of 5632, not DeepSeek-V4-Flash-FP4's FP8 shared expert); with it a BF16 down GEMM's four stages,
    the staged half tile and the barriers in its padding fill the 227 KB exactly; the kernel's name
    and its STY argument say so, and the tuning turns it off."""
    from pathlib import Path

    from moegen import prefill_plan
    from moegen.families import Layer, Tuning
    from moegen.plan import TARGETS, make_plan
    from moegen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    c = Layer.of(spec, TARGETS[spec.arch])
    t, ts = prefill_plan.tiles(c), prefill_plan.shared_tiles_of(c)
    assert t.stage_y == routed and (shared is None or ts.stage_y == shared), (t, ts)
    assert t.down_smem_bytes <= TARGETS[spec.arch].smem_per_block
    if routed and not t.fp4:  # BF16: 4 x (16 + 32 KB) + 128 x 272 + 1 KB
        assert t.dstages == 4 and t.down_smem_bytes == 4 * 48 * 1024 + 128 * 272 + 1024 == 227 * 1024
    plan = make_plan(spec)
    downs = [k for k in plan.kernels if k.family in ("prefill_gemm_down", "prefill_gemm_down_shared")]
    routed_down = next(k for k in downs if k.family == "prefill_gemm_down")
    sty = len(routed_down.targs) == 13 and routed_down.targs[12] == "true"  # prefill_gemm's STY, the last
    assert ("_sy_" in routed_down.name) == routed == sty, routed_down
    off = make_plan(spec, tuning=Tuning(prefill_stage_y=False))
    assert not [k for k in off.kernels if "_sy_" in k.name]


def test_expected_tiles_match_sampled_routing():
    """prefill_plan.expected_tiles (the mean of ceil(c / bn) for an expert's rows c ~ Binomial(rows, p))
    against the mean over sampled counts: the same within the samples' error."""
    from moegen.prefill_plan import expected_tiles

    rng = np.random.default_rng()
    for rows, p, bn in ((16384, 1 / 8, 160), (16384, 1 / 8, 128), (8192 * 8, 1 / 128, 160), (700, 0.3, 128), (50, 0.5, 160)):
        c = rng.binomial(rows, p, 200_000)
        sampled = np.ceil(c / bn)
        assert abs(expected_tiles(rows, p, bn) - sampled.mean()) < 5 * sampled.std() / np.sqrt(len(c)) + 1e-9, (rows, p, bn)
    assert expected_tiles(1000, 1.0, 128) == 8  # every row to the one expert


@pytest.mark.parametrize("name,bn", [("mixtral-8x7b", 160), ("llama-4-scout", 160), ("gpt-oss-20b", 160),
                                     ("qwen3-30b-a3b", 128), ("qwen3-next-80b-a3b", 128), ("qwen3-30b-a3b-fp8", 64),
                                     ("qwen3-30b-a3b-nvfp4", 128)])
def test_bf16_gemms_take_the_wider_tile_where_it_costs_fewer_bytes(name, bn):
    """The analytic token rows a tile: 160 for BF16 layers whose experts' rows at the largest bucket
    pad 160-row tiles less than the bytes they save (Mixtral-8x7B, Llama-4-Scout with its shared
    expert, GPT-OSS-20B with biases), 128 where the down GEMM stages its Y tile a token row a thread
    (Qwen3-30B-A3B, Qwen3-Next), FP8 block's 64 and FP4's 128 as before; the kernels' names and BNT
    say so; the tuning prefill_bn overrides it for BF16 layers and is refused for others."""
    from pathlib import Path

    from moegen import prefill_plan
    from moegen.families import Layer, Tuning
    from moegen.plan import TARGETS, PlanError, make_plan
    from moegen.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    c = Layer.of(spec, TARGETS[spec.arch])
    t = prefill_plan.tiles(c)
    assert t.bn == bn and t.packed_rows == bn and not (bn > 128 and t.stage_y)
    assert t.gate_up_smem_bytes <= TARGETS[spec.arch].smem_per_block
    def gemms(plan):  # the routed experts' GEMMs, and the shared expert's (at most 128 token rows a tile)
        ks = [k for k in plan.kernels if k.family.startswith("prefill_gemm")]
        return [k for k in ks if not k.family.endswith("_shared")], [k for k in ks if k.family.endswith("_shared")]

    plan = make_plan(spec)
    routed, shared = gemms(plan)
    assert len(routed) == 2 and all(f"_bn{bn}_" in k.name for k in routed), [k.name for k in routed]
    assert all(f"_bn{min(bn, 128)}_" in k.name for k in shared) and bool(shared) == bool(c.si), [k.name for k in shared]
    assert any(k.name.startswith("moe_prefill_scan") and f"_r{bn}_" in k.name for k in plan.kernels)
    if spec.experts.format.value == "bf16":
        for other in (128, 160):
            routed, shared = gemms(make_plan(spec, tuning=Tuning(prefill_bn=other)))
            assert all(f"_bn{other}_" in k.name for k in routed) and all("_bn128_" in k.name for k in shared)
    else:
        with pytest.raises(PlanError, match="prefill_bn=160: wider tiles than 128 take BF16 experts"):
            make_plan(spec, tuning=Tuning(prefill_bn=160))
    with pytest.raises(PlanError, match="prefill_bn=192"):
        make_plan(spec, tuning=Tuning(prefill_bn=192))
    if spec.experts.format.value == "bf16":
        with pytest.raises(PlanError, match="prefill_bn=160: wider tiles than 128 take the producer warpgroup"):
            make_plan(spec, tuning=Tuning(prefill_bn=160, prefill_down_pair=False))


def test_wide_tile_gemms_compile_without_spills_or_serialized_wgmma():
    """Mixtral-8x7B's prefill GEMMs at 160 token rows a tile (the A fragments a k-step at a time) and
    Qwen3-30B-A3B's with the tuning prefill_bn=160 (its shared-expert-free layer; the staged Y tile
    then off): no spills or stack, none of ptxas's warnings of serialized wgmmas."""
    from pathlib import Path

    from moegen.build import render_all
    from moegen.families import Tuning
    from moegen.plan import make_plan
    from moegen.spec import load_spec

    for name, tuning in (("mixtral-8x7b", None), ("qwen3-30b-a3b", Tuning(prefill_bn=160))):
        spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
        plan = make_plan(spec, tuning=tuning)
        out = compile_cuda(render_all(spec, plan)["layer.cu"], plan.arch, use_cache=False)
        for code in PTXAS_WARNINGS:
            assert code not in out.log, out.log
        gemms = [k for k in plan.kernels if k.family.startswith("prefill_gemm")]
        assert len(gemms) == 2 and all("_bn160_" in k.name and "_sy_" not in k.name for k in gemms)
        for k in gemms:
            r = out.resources[k.name]
            assert r.spill_stores == r.spill_loads == r.stack_bytes == 0, (k.name, r)
