"""The prefill buckets of a plan: from which token count a layer's calls run the routed experts
as grouped GEMMs on the tensor cores (templates/grouped_gemm.cu.j2) instead of the GEMV tiles,
the kernels that do it, their launches and their workspace.

A prefill bucket runs the norm (where the layer has one), the router and the route kernel as a
decode bucket does (they write each token's experts and weights), with permute (X', K in the
packed tiles' order; it needs no routing) between them, beside the router, then:
count, scan, place (tokens grouped by expert, a stable counting sort; the tile table) -> gate/up
GEMM with the activation (H', bf16) -> down GEMM (Y, bf16 per (token, choice) row) -> combine
(the weighted sum of a token's choices in choice order, zero experts adding weight * x). The
kernels up to place are launched with programmatic dependence on the one before (Tuning.prefill_pdl),
the GEMMs and the combine without. The GEMMs read the decode path's packed weights (no second
copy) as wgmma's register operand. Every output element is one fixed sequence of k-steps,
whatever the other tokens: batch-invariant within the bucket.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from .families import FP4_FORMATS, QUANT_THREADS, quant_blocks
from .prefill import DOWN_MATS, MAX_EXPERTS, PERMUTE_PER_SM, TILE_INTS, GemmTiles

if TYPE_CHECKING:
    from .families import Layer
    from .plan import Buffer, Kernel, Launch

TILES = GemmTiles()  # 2 warpgroups (16 weight rows a warp) x 128 tokens, 4 stages: measured on the H200
FP8_BN = 64  # FP8 block weights: tokens a tile (two accumulator sets a matrix in registers)
# The first prefill bucket is the smallest whose every token count gives the routed experts
# TOKENS_PER_EXPERT tokens each on average: there the GEMV path's passes have fallen below the
# prefill GEMMs, which read each hit expert's weights about once at any N up to 128 tokens an
# expert. Measured on the H200 (2026-12-01, A/B in one process, GEMV against prefill kernels, us):
# Qwen3-Next-80B-A3B N = 512 / 1024 (10 / 20 an expert) 1010.9 / 1263.0 against 869.8 / 904.3;
# Qwen3-30B-A3B N = 256 (16) 335.7 against 328.1; DeepSeek-V3-FP8 N = 256 (8; 2026-11-30) 3704.0
# against 3830.9; Mixtral-8x7B's crossover at or below N = 128 (32); Llama-4-Scout N = 129 / 257
# (8 / 16) 1293.0 / 1600.3 against 1147.3 / 1202.0; GPT-OSS-120B N = 257 / 513 / 1024 (8 / 16 / 32)
# 1509.0 / 1634.6 / 2667.1 against 1572.3 / 1603.1 / 1678.9; GPT-OSS-20B N = 129 / 256 (16 / 32)
# 403.6 / 617.1 against 430.4 / 440.5. FP4 weights cross later, at 16-32 tokens an expert
# (the GEMV path reads a quarter of the bytes), which the buckets' steps leave at the same first
# bucket where that bucket's smallest N gives 16: Qwen3-30B-A3B-MXFP4 N = 257 / 512 299.5 / 441.5
# against 328.3 / 335.2 (NVFP4 280.8 / 416.6 against 337.2 / 343.6), DeepSeek-V3-NVFP4 N = 513 /
# 1024 4704.0 / 7989.2 against 5530.4 / 5614.8, GPT-OSS-20B-MXFP4 N = 129 / 256 341.6 / 508.5
# against 441.9 / 447.3, GPT-OSS-120B-MXFP4 N = 513 / 1024 1315.7 / 1904.5 against 1649.2 / 1689.0.
# With one consumer warpgroup (tuning prefill_bm=64) the GEMMs stream a hit expert's weights at
# about two thirds of the rate of two, so the count doubles there: GPT-OSS-20B N = 129 / 256 398.8
# / 596.9 against 551.8 / 564.3 (all: the H200, 2026-12-01, the same A/B).
# FP8 block weights (weight-only), after the prefill consumers' shorter chain (the H200,
# 2026-12-02, the same A/B): DeepSeek-V3-FP8 N = 256 / 512 3762.4 / 5046.3 against 3579.1 / 3876.8
# (TOKENS_PER_EXPERT had started it at 1024: one bucket late), Qwen3-30B-A3B-FP8 N = 64 / 128 / 256 179.7 /
# 200.2 / 275.6 against 221.0 / 225.4 / 230.0 (512: right). So FP8 block weights cross between 8
# tokens an expert (Qwen3-30B-A3B-FP8 at 128: GEMV ahead) and 9 (DeepSeek-V3-FP8 at 256, the shared
# expert counted as below: prefill ahead): FP8_TOKENS_PER_EXPERT, between them.
TOKENS_PER_EXPERT = 10
FP8_TOKENS_PER_EXPERT = 8.5
# FP4 weights: measured inside the buckets (the GEMV at the bucket's own tiles against the prefill
# kernels at the same N; the H200, 2026-12-02, us): Qwen3-30B-A3B-NVFP4 N = 300 / 384 / 448 / 512
# 286.8 / 304.6 / 352.0 / 414.0 against 342.4 / 343.7 / 347.0 / 348.9, a crossover near 430 (27
# tokens an expert), where the whole 257..512 bucket had run the prefill kernels, 16% slower at 300.
# The earlier pairs above (their GEMV rising steeply within a bucket) cross, interpolated, at about
# 19 (Qwen3-30B-A3B-MXFP4), 26 (GPT-OSS-20B-MXFP4), 22 (DeepSeek-V3-NVFP4) and 25 (GPT-OSS-120B-MXFP4).
FP4_TOKENS_PER_EXPERT = 26
# FP8 and FP4 weights: the crossover is consistent across layers in tokens an expert, so the plan
# puts a bucket edge at it (prefill_split) rather than starting the prefill kernels at the next
# whole bucket, unless it lies within 1/SNAP of a bucket's first token count, where the prefill
# kernels take the whole bucket: Qwen3-30B-A3B-FP8 (crossover 136) measured 260.3 / 264.5 / 274.1
# us by the GEMV at N = 130 / 160 / 256 against 222.5 / 223.7 / 227.5 by the prefill kernels. BF16
# crossovers spread from under 7 tokens an expert (Qwen3-Next-80B-A3B: 845.6 / 916.3 against 834.3
# / 852.4 at N = 300 / 512) to 22 (GPT-OSS-20B: 416.7 / 450.6 against 430.3 / 435.2 at 160 / 192;
# Qwen3-30B-A3B about 13: 321.4 / 327.7 against 322.3 / 324.0 at 192 / 224), so BF16 keeps whole
# buckets, where a misplaced edge costs least.
SNAP = 8
# A shared expert takes every token: on the GEMV path it streams its weights once per token group
# (32 tokens), on the prefill GEMMs about once, so it counts as si / i more experts, each given
# every token (the count above, averaged over the routed and the shared experts' widths). It moved
# four layers' first bucket down by one, where the A/B measured the prefill kernels ahead at the new
# bucket's smallest N (GEMV against prefill, us; the H200, 2026-12-01): Llama-4-Scout N = 129 / 256
# 1271.2 / 1557.3 against 1130.0 / 1144.4; Llama-4-Maverick (one layer a replay, a process each)
# N = 1025 / 2048 10371.3 / 13996.0 against 7612.0 / 8179.2; Qwen1.5-MoE-A2.7B N = 129 / 256 395.1 /
# 491.8 against 370.2 / 374.7; Qwen2-57B-A14B N = 65 / 128 1215.4 / 1410.8 against 1153.5 / 1171.2.
# FP8 activations: the GEMV scales every token's products of every 32-wide chunk in fp32 (the
# token's scale changes each 128 channels), so its time grows with the tokens an expert gets from
# the first one, while the tensor-core GEMMs stream each hit expert once. Measured on the H200
# (2026-11-30, moegen bench, whole layer, GEMV against prefill at the same N): Qwen3-30B-A3B-FP8-a8
# N = 16 / 32 / 64 / 128 / 256: 132.9 / 184.3 / 230.6 / 341.9 / 596.1 us against 128.7 / 172.5 /
# 186.7 / 190.7 / 197.0 us; DeepSeek-V3-FP8-a8 N = 16 / 32 / 64 / 128: 1481 / 3635 / 5037 / 6392 us
# against 1122 / 1730 / 2320 / 2659 us. Prefill from one token per expert on average.
A8_TOKENS_PER_EXPERT = 1
FP4_MACRO = {"mxfp4": "MOE_W_MXFP4", "nvfp4": "MOE_W_NVFP4"}  # prefill_gemm's F4
GROUP_THREADS = 1024  # count / scan / place: a thread per (token, choice) entry of a 1024-entry chunk
EW_THREADS = 256  # permute and combine


# The BF16 GEMMs' token rows a tile. Their k-loops are bound by the bytes each k-tile brings into
# the multiprocessor (README, Prefill: the loads cost them 25-35%): a block's 256 weight rows (gate's
# and up's 16-row tiles a warp, or a down row group's two) and its bn token rows, 128 bytes each.
# A wider tile takes fewer of them a product, but pads each expert's last tile further. The plan
# weighs both at the layer's largest bucket: over the routed experts, the expected tiles of the
# rows an expert gets (routing taken as uniform: Binomial(N k, 1 / E)) times (256 + bn). It takes
# 160 (prefill_gemm_w's FINE fragments) where that is less than 128's, unless the down GEMM runs
# persistent with its Y tile staged (a token row a consumer thread, at most 128), which the wider
# tile would lose (a shared expert's GEMMs keep 128: shared_tiles_of). Measured on the H200 (2026-12-04, one
# process, the same bits, us per layer, 128 against 160): Mixtral-8x7B 2829.0 / 9987.8 against
# 2804.2 / 9442.7 at N = 2048 / 8192; Qwen3-30B-A3B (staged Y at 128) 461.1 / 1380.0 against 417.3
# / 1465.3. One width a layer: its small buckets, where an expert's rows fit one tile at either
# width, pay 2-7% at 160 (Mixtral-8x7B 716.6 against 763.6 us at N = 256; README, Prefill, where the
# same cost per bucket, with the staged Y counted, picks the faster width at 16 measurements).
WIDE_BN = 160


def expected_tiles(rows: int, p: float, bn: int) -> float:
    """E[ceil(c / bn)] for c ~ Binomial(rows, p): the tiles of an expert that each of `rows` routing
    choices picks with probability p (summed over the counts within 10 standard deviations)."""
    if p >= 1.0:  # every choice to the one expert
        return float(-(-rows // bn))
    mean, sd = rows * p, math.sqrt(rows * p * (1.0 - p))
    lo, hi = max(0, int(mean - 10 * sd) - 1), min(rows, int(mean + 10 * sd) + 2)
    head = math.lgamma(rows + 1)

    def pmf(c: int) -> float:
        return math.exp(head - math.lgamma(c + 1) - math.lgamma(rows - c + 1) + c * math.log(p) + (rows - c) * math.log1p(-p))

    return sum(pmf(c) * -(-c // bn) for c in range(lo, hi + 1))


def tile_bn(c: Layer, fmt: str, bm: int, ws: bool, staged: bool) -> int:
    """The BF16 GEMMs' token rows a tile (WIDE_BN or TILES.bn; the tuning's prefill_bn where set);
    staged: whether the down GEMM stages its Y tile at TILES.bn."""
    if c.tune.prefill_bn:
        return c.tune.prefill_bn
    mixed = c.si > 0 and c.fmt_s != c.fmt_e
    pair = c.tune.prefill_down_pair and c.tune.down_tiles == 2
    if fmt != "bf16" or mixed or bm != TILES.bm or not (ws and c.tune.prefill_bulk_a and pair) or staged:
        return TILES.bn
    def cost(bn: int) -> float:  # tiles, times a k-tile's rows: a warp's two 16-row matrices, and the tokens
        return c.e_local * expected_tiles(c.nmax * c.k, 1.0 / c.e, bn) * (TILES.threads // 32 * 32 + bn)

    return WIDE_BN if cost(WIDE_BN) < cost(TILES.bn) else TILES.bn


def tiles(c: Layer, fmt: str = "", wide: bool = True) -> GemmTiles:
    """The GEMMs' tile shape for weights in `fmt` (default: the routed experts'): TILES, revised by
    the format and the tuning (warpgroups, stages, producer warpgroup), and the token rows a tile
    (tile_bn; wide False: at most TILES.bn)."""
    t = c.tune
    fmt = fmt or c.fmt_e
    # FP8 block weights: bn 64 (a K block's accumulators beside the sums); with the producer
    # warpgroup only (unsupported() names the rest)
    fp8 = fmt == "fp8_block" and t.prefill_ws
    bm = t.prefill_bm or TILES.bm
    # PAIR: row groups of two tiles (down_tiles 2), a block of them or more over H (the last block
    # overlapping the one before where they are not whole blocks)
    pair = t.prefill_ws and t.prefill_down_pair and t.down_tiles == 2 and c.h // 32 >= bm // 64 * 4
    bulk = t.prefill_bulk_a and t.prefill_ws
    # FP4: with the bulk copies and row-group pairs (unsupported() names the rest)
    fp4 = fmt if fmt in FP4_FORMATS and bulk and pair else ""
    # FP8 activations: tokens as wgmma's M, a tile a consumer warpgroup, two of them (unsupported()
    # names a tuning without them or the row-group pairs)
    a8 = fp8 and c.a8 and bm == TILES.bm and pair
    g = GemmTiles(bm, FP8_BN if fp8 else TILES.bn, t.prefill_stages or TILES.stages,
                  ws=t.prefill_ws, down_stages=t.prefill_down_stages, fp8=fp8, a8=a8, down_pair=pair,
                  bulk_a=bulk, fp4=fp4, fp8_tensor=fmt == "fp8_tensor" and t.prefill_ws)
    # the staged Y tile: the routed down GEMM (K = I) persistent, two consumer warpgroups
    want = t.prefill_stage_y if t.prefill_stage_y is not None else fmt == "bf16" or bool(fp4)
    staged = pair and bm == 128 and g.persistent(c.i) and want
    bn = g.bn if fp8 or not wide else tile_bn(c, fmt, bm, t.prefill_ws, staged)
    return replace(g, bn=bn, stage_y=staged and bn <= TILES.bn)


BNT_ARG = 10  # prefill_gemm's template argument BNT (tokens a tile, where a GEMM's differ from the layer's)


def other_bn(kernels: tuple[Kernel, ...], bn: int) -> int:
    """The tile width (tokens) that some of the GEMMs take beside the layer's `bn` (0: none): their BNT
    (which a GEMM with a later template argument set lists even where it is the layer's)."""
    return max((int(k.targs[BNT_ARG]) for k in kernels
                if k.body == "prefill_gemm" and len(k.targs) > BNT_ARG and int(k.targs[BNT_ARG]) != bn), default=0)


def shared_tiles_of(c: Layer) -> GemmTiles:
    """The shared expert's GEMMs' tile shape: its format's (FP8 block's 64 tokens beside FP4 routed
    experts' 128; the rest of the shape is the layer's, one template), at most TILES.bn token rows
    (at 160, beside BF16 routed experts', its gate/up GEMM on rows in order spilled 12 bytes)."""
    if not c.si:
        return tiles(c)
    t = tiles(c, c.fmt_s, wide=False)  # (staged Y where its own down GEMM, K = si, runs persistent too)
    return replace(t, stage_y=t.stage_y and t.persistent(c.si))


def unsupported(c: Layer) -> str:
    """Why the layer has no prefill buckets ("" where it has them): the grouped GEMMs take routed
    experts all on this device, SiLU-gated (clamped or not) or GPT-OSS's clamped SwiGLU, with or
    without biases, the routing weight on their output or input, in BF16 or FP8 block (bf16
    activations, or with experts.fp8_activations e4m3 codes per token and 128 channels; with the
    producer warpgroup), FP8 per-tensor (with the producer warpgroup; no shared expert, biases or
    weights on the input), MXFP4 or NVFP4 (with the producer warpgroup, two consumer warpgroups, the
    weights by bulk copies and the down GEMMs on row-group pairs), and a shared expert (as one more
    GEMM pair over all tokens; the tuning prefill_shared=False keeps such layers on the GEMV path)
    in the routed experts' format or, with the producer warpgroup, in another of those formats
    (its own tile's width: DeepSeek-V4's FP8 block shared expert beside MXFP4 routed experts)."""
    from .plan import TARGETS

    spec = c.spec
    act = spec.experts.activation
    w = tiles(c).threads // 32
    ws = c.tune.prefill_ws  # (its GEMMs' last row block overlaps the one before where widths are not whole blocks)
    fp8 = c.fmt_e == "fp8_block"
    ts, mixed = shared_tiles_of(c), c.si > 0 and c.fmt_s != c.fmt_e
    checks = (
        (c.fmt_e not in ("bf16", "fp8_block", "fp8_tensor", *FP4_FORMATS), f"experts.format={c.fmt_e}"),
        (c.fmt_e == "fp8_tensor" and (not ws or c.si or c.bias or c.woi),
         "FP8 per-tensor experts without the producer warpgroup, or with a shared expert, biases or the weights on the input"),
        (fp8 and not c.tune.prefill_ws, "FP8 weights without the producer warpgroup (tuning prefill_ws=False)"),
        (fp8 and c.a8 and not tiles(c).a8,
         ("FP8 activations without two consumer warpgroups and the down GEMM on row-group pairs (tunings prefill_bm, "
          "prefill_down_pair, down_tiles=2)")),
        (tiles(c).a8 and c.h % 128, "FP8 activations with a hidden width not a multiple of 128"),
        (c.fmt_e in FP4_FORMATS and not tiles(c).fp4,
         (f"{c.fmt_e} weights without the producer warpgroup's bulk copies and row-group pairs (tunings prefill_ws, "
          "prefill_bulk_a, prefill_down_pair, down_tiles=2)")),
        # (a single consumer warpgroup's FP4 down pairs spill: 16 bytes of stack at 240 registers)
        (c.fmt_e in FP4_FORMATS and tiles(c).bm < TILES.bm, f"{c.fmt_e} weights with one consumer warpgroup"),
        (not (act.kind.value == "silu_gated" and not act.alpha or act.kind.value == "swiglu_clamped"),
         f"activation {c.act_tag}"),
        (c.si > 0 and not c.tune.prefill_shared, "a shared expert (tuning prefill_shared=False)"),
        (c.si > 0 and (c.si % 64 or c.si // 16 < w or not ws and (c.si // 16) % w), f"shared expert {c.fmt_s} x {c.si}"),
        (mixed and (c.fmt_s not in ("bf16", "fp8_block", *FP4_FORMATS) or not ws or c.a8
                    or c.fmt_s in FP4_FORMATS and not ts.fp4), f"shared expert {c.fmt_s} beside {c.fmt_e} experts"),
        (c.bias and not c.tune.prefill_ws, "expert biases without the producer warpgroup"),
        (c.woi and not c.tune.prefill_ws, "routing weights on the input without the producer warpgroup"),
        (c.ep_size > 1, "expert parallelism"),
        (spec.batch_invariant, "batch_invariant (one reduction order for every N)"),
        (c.e_local > MAX_EXPERTS, f"more than {MAX_EXPERTS} experts"),
        (c.h % 64 or c.i % 64, "hidden and expert widths not multiples of 64"),
        (min(c.i, c.h) // 16 < w, f"widths under a block of {w} 16-row tiles"),
        (not ws and ((c.i // 16) % w or (c.h // 16) % w),
         f"widths not whole blocks of {w} 16-row tiles without the producer warpgroup"),
        (c.tune.down_tiles not in DOWN_MATS, f"down_tiles={c.tune.down_tiles}"),
        # (a tile table's group word holds a tile index in 16 bits)
        (max_tiles(c, c.nmax) >= 1 << 16, f"{max_tiles(c, c.nmax)} tiles at max_tokens={c.nmax} (at most 65535)"),
        (max(tiles(c).gate_up_smem_bytes, tiles(c).down_smem_bytes, ts.gate_up_smem_bytes, ts.down_smem_bytes)
         > TARGETS[c.spec.arch].smem_per_block,
         f"the GEMMs' rings of {tiles(c).stages} / {tiles(c).dstages} stages exceed a block's shared memory"),
    )
    return "; ".join(why for bad, why in checks if bad)


def prefill_from(c: Layer) -> int:
    """The first bucket (its largest token count) that runs the prefill kernels (0: none), from
    the analytic crossover: the token count whose routed experts get TOKENS_PER_EXPERT tokens each
    on average (FP8 block weights FP8_TOKENS_PER_EXPERT, FP4 FP4_TOKENS_PER_EXPERT; twice as many
    with one consumer warpgroup), a shared expert counted as si / i experts that take every token;
    with FP8 activations from A8_TOKENS_PER_EXPERT routed tokens an expert; a tuning may move it.
    BF16 layers start at the first power-of-two bucket whose every token count is past the
    crossover; FP8 and FP4 weights at the bucket that holds it, cut there (prefill_split)."""
    return _crossover(c)[0]


def prefill_split(c: Layer) -> int:
    """The largest token count that stays on the GEMV path below the crossover inside the first
    prefill bucket (0: the bucket is whole): the plan adds a bucket that ends there."""
    return _crossover(c)[1]


def _crossover(c: Layer) -> tuple[int, int]:
    if unsupported(c):
        return 0, 0
    if c.tune.prefill_from:
        return c.tune.prefill_from, 0
    if c.tune.prefill_cut:
        return _cut_at(c.tune.prefill_cut + 1, 0, c.nmax)
    t = tiles(c)
    if t.a8:
        return math.ceil(A8_TOKENS_PER_EXPERT * c.e / c.k), 0
    shared = c.si / c.i  # (in routed experts' widths)
    per = FP4_TOKENS_PER_EXPERT if t.fp4 else FP8_TOKENS_PER_EXPERT if t.fp8 else TOKENS_PER_EXPERT
    first = math.ceil(per * (TILES.bm // t.bm) * (c.e + shared) / (c.k + shared))  # the first N past it
    if t.fp4 or t.fp8:
        return _cut_at(first, SNAP, c.nmax)
    b = 1  # BF16: the first bucket whose smallest N is past the crossover
    while b // 2 + 1 < first:
        b *= 2
    return b, 0


def _cut_at(first: int, snap: int, nmax: int) -> tuple[int, int]:
    """The power-of-two bucket that holds `first` (the first N of the prefill kernels) and the cut
    below it (0: none, where first begins the bucket or, with snap, lies within 1/snap of it, or
    the bucket lies past max_tokens: no prefill bucket)."""
    b = 1
    while b < first:
        b *= 2
    low = b // 2 + 1  # the bucket's first token count
    if first <= low + ((b // 2) // snap if snap else 0) or b > nmax:
        return b, 0
    return b, first - 1


def max_tiles(c: Layer, tokens: int, rows: int = 0) -> int:
    """Tiles the routing of `tokens` tokens can make: each expert's rows cut at the tile's tokens
    (or at `rows`)."""
    return -(-tokens * c.k // (rows or tiles(c).packed_rows)) + c.e_local


# FP8 activations: the buckets whose smallest token count gives the routed experts this many rows
# each on average cut the tile table at 128 rows, a GEMM block's two warpgroups taking a tile's
# halves (prefill_gemm_a8's HALVES); the others at 64, a block taking two tiles. On the H200
# (2026-12-02, the two forms first built as separate versions, at the same N): 128-row tiles ahead from
# 64 rows an expert (DeepSeek-V3-FP8-a8 N = 2048: 3984 against 4167 us for the pairs; Qwen3-30B-A3B-
# FP8-a8 at 128 rows an expert, N = 2048: 367.8 against 371.4), behind at 37 (Qwen3 N = 600: 229.1
# against 208.0) and 2 (DeepSeek-V3 N = 64: 2668 against 2392).
A8_HALVES_ROWS = 64


def a8_halves(c: Layer, nb: int) -> bool:
    """Whether the prefill bucket of up to nb tokens cuts the FP8-activation GEMMs' tiles at 128 rows."""
    return tiles(c).a8 and (nb // 2 + 1) * c.k >= A8_HALVES_ROWS * c.e_local


# The buckets whose smallest token count makes x's codes (N x H bytes, which the routed gate/up
# GEMM gathers a token row of 128 bytes at a time, each row once for each of its choices' tiles and
# row blocks) at least A8_XROWS_L2 of L2 quantize x into a row of codes per (token, choice) in the
# tile table's order (after place), which that GEMM reads by tensor copies as the GEMMs whose rows
# are in order do: the extra P x H bytes written pay once the gathered rows no longer stay in L2
# beside the weights. On the H200 (2026-12-03, one process, the same bits, us per layer, gathered
# against rows in order): DeepSeek-V3-FP8-a8 7645.5 against 7111.4 at N = 5000 (x's codes 36 MB),
# 10627.3 against 10077.0 at 8192 (59 MB); Qwen3-30B-A3B-FP8-a8 489.7 against 494.4 at N = 2500
# (5 MB), 1140.1 against 1127.8 at 8192 (17 MB), 2204.8 against 2182.8 at 16384 (34 MB). (The
# quantization's warp reads a token's choices' rows a lane each: top_k <= 32.)
A8_XROWS_L2 = 0.5


def a8_xrows(c: Layer, nb: int) -> bool:
    """Whether the prefill bucket of up to nb tokens gives the routed gate/up GEMM x's codes a row per
    (token, choice) in the tile table's order (A8_XROWS_L2)."""
    from .plan import TARGETS

    return (tiles(c).a8 and c.tune.prefill_xrows and c.k <= 32
            and (nb // 2 + 1) * c.h >= A8_XROWS_L2 * TARGETS[c.spec.arch].l2_bytes)


# FP8 activations: the gate/up GEMMs whose k-loop has at least A8_IDLE_KTILES k-tiles (K = H of at
# least 4096) let a consumer warpgroup whose 64-row tile has no rows (the second half of an expert's
# last 128-row tile, where it has 64 rows or fewer) wait for and release each stage without its
# products, leaving the tensor cores to the other warpgroup. On the H200 (2026-12-03, one process,
# the same bits, us per layer, medians of 4-5 rounds, without -> with): DeepSeek-V3-FP8-a8 (56
# k-tiles) 8035.0 -> 7868.8 at N = 6144, 9991.7 -> 9808.5 at 8192; its down GEMM (16 k-tiles)
# 8035.0 -> 8075.3 / 9991.7 -> 9952.3; Qwen3-30B-A3B-FP8-a8's gate/up (16 k-tiles) 370.1 -> 379.1 at
# N = 2048, 1121.3 -> 1126.6 at 8192, its down (6) 370.1 -> 370.6 / 1121.3 -> 1139.7.
A8_IDLE_KTILES = 32


def a8_idle(c: Layer) -> bool:
    """Whether the FP8-activation gate/up GEMMs skip the products of a warpgroup without rows (A8_IDLE_KTILES)."""
    return c.h // 128 >= A8_IDLE_KTILES


def chunks(c: Layer, tokens: int) -> int:
    return -(-tokens * c.k // GROUP_THREADS)


def workspace(c: Layer, on: bool) -> tuple[Buffer, ...]:
    """X', the per-chunk counts, each expert's first row and the tile tables (token rows, the
    choices' rows, H' and Y reuse the decode path's slot_token, pair_pos, act and y; the shared
    expert's H' and Y its act_s and ys)."""
    from .plan import Buffer

    n = c.nmax
    return (
        # (A8: the codes in xq; FP8 per-tensor: a row per (token, choice), quantized by its expert)
        Buffer("xp", "uint16", ((n * c.k if tiles(c).fp8_tensor else n), c.h) if on and not tiles(c).a8 else (1,)),
        Buffer("counts", "int32", (chunks(c, n) * c.e_local,) if on else (1,)),
        Buffer("first", "int32", (c.e_local + 1,) if on else (1,)),
        Buffer("tiles", "int32", (max_tiles(c, n) * TILE_INTS,) if on else (1,)),
        Buffer("stiles", "int32", (shared_tiles(c, n) * TILE_INTS,) if on and c.si else (1,)),
        # A8: x's codes and scales a row per (token, choice) (a8_xrows; [K / 128][rows] scales)
        Buffer("xqr", "uint8", (n * c.k, c.h) if on and a8_xrows(c, n) else (1,)),
        Buffer("sxr", "float32", (n * c.k, c.h // 128) if on and a8_xrows(c, n) else (1,)),
    )


def shared_tiles(c: Layer, tokens: int, rows: int = 0) -> int:
    """Tiles of the shared expert's GEMMs: every token, in order, cut at its tile's tokens (or at `rows`)."""
    return -(-tokens // (rows or shared_tiles_of(c).packed_rows)) if c.si else 0


def kernels(c: Layer, halves: bool = False, xrows: bool = False) -> dict[str, Kernel]:
    """The prefill kernels of the layer, by family (halves: the FP8-activation GEMMs and the scan of
    the buckets that cut the tiles at 128 rows, a8_halves; xrows: x's quantization and the routed
    gate/up GEMM of the buckets that give x's codes a row per (token, choice), a8_xrows)."""
    from .plan import TARGETS, Kernel

    e, k, h, i, arch = c.e_local, c.k, c.h, c.i, c.spec.arch
    t, ts = tiles(c), shared_tiles_of(c)
    layer_bn = t.bn  # (the template's default BNT)
    if halves:
        t, ts = replace(t, bn=2 * t.bn), replace(ts, bn=2 * ts.bn)
    warps = t.threads // 32
    ids = ("const int* __restrict__ ids", "ids", "ws.topk_ids")
    counts = ("int* __restrict__ counts", "counts", "ws.counts")
    first = ("int* __restrict__ first", "first", "ws.first")
    table = ("int* __restrict__ tiles", "tiles", "ws.tiles")
    tok = ("int* __restrict__ tok", "tok", "ws.slot_token")
    slot = ("int* __restrict__ slot", "slot", "ws.pair_pos")
    stable = ("int* __restrict__ stiles", "stiles", "ws.stiles")
    n = ("int n", None, "n")
    si = c.si

    def kern(family: str, name: str, threads: int, targs: tuple[str, ...], sig: tuple, args: tuple[str, ...],
             body: str, comment: str, tile: GemmTiles = t, dep: str = "") -> Kernel:
        return Kernel(f"moe_prefill_{name}_{arch}", f"prefill_{family}", threads, targs, tuple(s[0] for s in sig), args,
                      tuple(s[2] for s in sig), body, comment,
                      min_blocks=(1 if ws_cap(tile) and family.startswith("gemm") else
                                  down_blocks if family.startswith("gemm_down") else 0), dep=dep)

    def gemm_tag(tile: GemmTiles) -> str:
        return f"bm{tile.bm}_bn{tile.bn}_s{tile.stages}" + ("_ws" if tile.ws else "") + ("_bulk" if tile.bulk_a else "")

    gemm, wf = gemm_tag(t), t.wfmt

    def targs(gated: str, mats: str, gather: str = "", woi: bool = False, bias: bool = False,
              tile: GemmTiles = t, rows: bool = False) -> tuple[str, ...]:
        """prefill_gemm's template arguments: GATED, MATS, then GATHER, FP8, A8, PAIR (the down GEMMs
        on row groups of two tiles), BULK (weight runs by bulk copies), F4 (FP4 weights), WOI (the
        routing weight on the input: the routed gate/up GEMM scales gate and up by it), BIAS (the
        routed experts' biases), BNT (the tile's tokens; the shared expert's tile where its format's
        differs), PT8 (FP8 per-tensor weights), STY (the down GEMM's Y tile staged, stage_y), XROWS
        (A8: the routed gate/up GEMM's x codes a row per (token, choice), a8_xrows) and IDLE (A8: a
        consumer warpgroup whose tile has no rows skips the block's products, a8_idle) up to the
        last that is not its default."""
        pair = gated == "false" and tile.down_pair
        full = [gated, mats, gather or gated, *(str(v).lower() for v in (tile.fp8, tile.a8, pair,
                                                                          tile.bulk_a and (gated == "true" or pair))),
                FP4_MACRO.get(tile.fp4, "0"), str(woi).lower(), str(bias).lower(), str(tile.bn),
                str(tile.fp8_tensor).lower(), str(pair and tile.stage_y).lower(), str(rows).lower(),
                str(tile.a8 and gated == "true" and a8_idle(c)).lower()]
        default = [None, None, gated, "false", "false", "false", "false", "0", "false", "false", str(layer_bn), "false",
                   "false", "false", "false"]
        while full[-1] == default[len(full) - 1]:
            full.pop()
        return tuple(full)

    # FP8: the block scales after the GEMMs' other arguments (FP4: the row scales' records, as
    # bytes); A8: then the input rows' scales
    def scales(name: str, xs: str = "", tile: GemmTiles = t) -> tuple:
        return (((f"const float* __restrict__ {name}", None, f"w.{name}"),) if tile.scaled else ()) + (
            ((f"const float* __restrict__ {xs}", None, f"ws.{xs}"),) if tile.a8 else ())

    def sarg(name: str, xs: str = "", tile: GemmTiles = t) -> tuple[str, ...]:
        return ((name,) if tile.scaled else ()) + ((xs,) if tile.a8 else ())

    # WOI (Llama-4): the place kernel writes each row's routing weight (the decode path's slot_w),
    # the routed gate/up GEMM reads it after its scale arguments, the combine adds Y unweighted
    wrow = ("float* __restrict__ wrow", None, "ws.slot_w")
    topk_w = ("const float* __restrict__ wts", None, "ws.topk_w")

    def tail(name: str, xs: str = "", woi: bool = False, biases: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The routed GEMMs' last arguments, (sc, xs, wrow, bias0, bias1) up to the last one used."""
        full = [*sarg(name, xs), *("nullptr",) * (2 - len(sarg(name, xs))), "wrow" if woi else "nullptr", *biases]
        while full and full[-1] == "nullptr":
            full.pop()
        return tuple(full)

    # A8: each GEMM copies its weights' k-tiles by a TMA box (a8_tensor_maps: w13, w2, ws13, ws2 in
    # the weights' buffer "tmaps"), its last argument after (sc, xs, wrow, bias0, bias1)
    tmaps = (("const void* __restrict__ tmaps", None, "w.tmaps"),) if t.a8 else ()

    # and its tokens' rows (xmap, a map over the workspace's codes: a8_tensor_maps)
    xmaps = a8_token_maps(c) if t.a8 else {}

    def tmap(rest: tuple[str, ...], idx: int, codes: str = "") -> tuple[str, ...]:
        return (*rest, *("nullptr",) * (5 - len(rest)), f"static_cast<const char*>(tmaps) + {128 * idx}",
                f"static_cast<const char*>(tmaps) + {128 * xmaps[codes]}") if t.a8 else rest

    # BIAS (GPT-OSS): the routed experts' biases, [E][I] for gate and up, [E][H] for down
    b13 = ((("const float* __restrict__ b_gate", None, "w.b_gate"), ("const float* __restrict__ b_up", None, "w.b_up"))
           if c.bias else ())
    b2 = (("const float* __restrict__ b_down", None, "w.b_down"),) if c.bias else ()

    # the GEMMs' inputs: bf16 rows (X' permuted, H' permuted by the gate/up epilogue), or with A8
    # the e4m3 codes the quantization kernels write (x, then H in column order)
    act_in = "const unsigned char* __restrict__" if t.a8 else "const bf16_t* __restrict__"
    xr = xrows and t.a8
    xsx = "sxr" if xr else "sx"  # (the routed gate/up GEMM's x scales: a row per (token, choice) with xr)
    xin, hin, hsin = ("ws.xq", "ws.actq", "ws.actq_s") if t.a8 else ("ws.xp", "ws.act", "ws.act_s")
    def down_tag(tile: GemmTiles) -> str:
        return (f"bm{tile.bm}_bn{tile.bn}_s{tile.dstages}" + ("_ws" if tile.ws else "") + ("_pair" if tile.down_pair else "")
                + ("_bulk" if tile.bulk_a and tile.down_pair else "") + ("_sy" if tile.stage_y else ""))

    down = down_tag(t)
    # setmaxnreg needs the register count at entry fixed: with a producer warpgroup and at most 256
    # threads (bm 64) nothing else caps it, so the block asks for one block a multiprocessor
    # (without, ptxas ignores setmaxnreg: C7508); 384 threads cap it at 168 already where the
    # consumers need more (BF16), not where they need fewer (FP8: C7508 again). Without a
    # producer, the down blocks a multiprocessor fits by shared memory (registers asked to match).
    def ws_cap(tile: GemmTiles) -> bool:
        return tile.ws and (tile.packed_threads <= 256 or tile.fp8)

    # (a multiprocessor holds smem_per_block + 1 KB, each block 1 KB of it for the system)
    sm_smem = TARGETS[c.spec.arch].smem_per_block + 1024
    down_blocks = 2 if not t.ws and sm_smem // (t.down_smem_bytes + 1024) >= 2 else 0
    out = {
        "permute": kern("permute", f"permute_h{h}", EW_THREADS, (),
                        (("const bf16_t* __restrict__ x", None, c.x_expert), ("bf16_t* __restrict__ xp", None, "ws.xp"), n),
                        ("x", "xp", str(h), "n"),
                        "prefill_permute_body", "prefill: X' (each 32-wide K chunk in the packed tiles' order)",
                        dep="last"),
        "count": kern("count", f"count_e{e}_k{k}", GROUP_THREADS, (), (ids, counts, n),
                      ("ids", f"n * {k}", str(e), "counts"), "prefill_count_body",
                      "prefill: entries per expert in each chunk of 1024 (token, choice) entries", dep="first"),
        "scan": kern("scan", f"scan_e{e}_k{k}_r{t.packed_rows}_n{c.nmax}{'_shared' if si else ''}"
                     + ("_halves" if halves else "")  # (its table sized for the layer's 64-row tiles)
                     + (f"_r{ts.packed_rows}" if si and ts.packed_rows != t.packed_rows else ""), GROUP_THREADS, (),
                     (counts, first, table, *((stable,) if si else ()), n),
                     ("counts", f"(n * {k} + {GROUP_THREADS - 1}) / {GROUP_THREADS}", str(e), str(t.packed_rows),
                      str(max_tiles(c, c.nmax)), "first", "tiles",
                      *(("n", "stiles", str(shared_tiles(c, c.nmax))) if si else ()),
                      *((str(ts.packed_rows),) if si and ts.packed_rows != t.packed_rows else ())), "prefill_scan_body",
                     f"prefill: each expert's first row and the tile table ({t.packed_rows} token rows a tile)"
                     + ("; the shared expert's tiles" if si else ""), dep="first"),
        "place": kern("place", f"place_e{e}_k{k}" + ("_winput" if c.woi else ""), GROUP_THREADS,
                      ("true",) if c.woi else (), (ids, counts, first, tok, slot, *((topk_w, wrow) if c.woi else ()), n),
                      ("ids", f"n * {k}", str(e), str(k), "counts", "first", "tok", "slot",
                       *(("wts", "wrow") if c.woi else ())), "prefill_place_body",
                      "prefill: each (token, choice) entry's row, grouped by expert in a stable order"
                      + (", and its routing weight" if c.woi else ""), dep="first"),
        "gemm_gate_up": kern("gemm_gate_up", f"gate_up_e{e}_k{k}_h{h}_i{i}_{gemm}_{wf}_{c.act_tag}"
                             + ("_winput" if c.woi else "") + ("_xrows" if xr else ""), t.packed_threads,
                             targs("true", "2", "false" if t.fp8_tensor else "", woi=c.woi, bias=c.bias, rows=xr),
                             ((f"{act_in} xp", None, "ws.xqr" if xr else xin), tok,
                              ("const uint4* __restrict__ w13", None, "w.w13"), table,
                              ("bf16_t* __restrict__ h", None, "ws.act"), n, *scales("s13", xsx),
                              *((wrow,) if c.woi else ()), *b13, *tmaps),
                             ("xp", "tok", "w13", "tiles", "h", str(i), str(h), str(i // 16), str(e), "n", str(k), str(e),
                              *tmap(tail("s13", xsx, c.woi, ("b_gate", "b_up") if c.bias else ()), 0,
                                    "xqr" if xr else "xq")),
                             "prefill_gemm",
                             f"prefill: H' = silu(X' Wg) * (X' Wu) per expert, wgmma ({'both operands from shared memory' if t.a8 else 'register A'}) on the packed tiles, "
                             + ("two 64-row tiles x 64 columns a block" if t.a8 else
                              f"{warps} 16-row tiles x {t.packed_rows} tokens a block")
                             + (", x's codes a row per (token, choice)" if xr else "")),
        "gemm_down": kern("gemm_down", f"down_e{e}_k{k}_h{h}_i{i}_{down}_m{c.tune.down_tiles}_{wf}", t.packed_threads,
                          targs("false", str(c.tune.down_tiles), bias=c.bias),
                          ((f"{act_in} hp", None, hin),
                           ("const uint4* __restrict__ w2", None, "w.w2"), table, ("bf16_t* __restrict__ y", None, "ws.y"),
                           n, *scales("s2", "sa"), *b2, *tmaps),
                          ("hp", "nullptr", "w2", "tiles", "y", str(h), str(i), str(h // 16), str(e), "n", str(k), str(e),
                           *tmap(tail("s2", "sa", biases=("b_down",) if c.bias else ()), 1, "actq")),
                          "prefill_gemm",
                          "prefill: Y = H' Wd per expert (bf16), " + ("two 64-row tiles x 128 columns a block" if t.a8 else
                                                                        f"{warps} 16-row tiles x {t.packed_rows} tokens a block")),
        "combine": kern("combine", f"combine_h{h}_k{k}" + (("_sgate" if c.gated else "_shared") if si else "")
                        + ("_winput" if c.woi else ""), EW_THREADS, ("true",) if c.woi else (),
                        (("const bf16_t* __restrict__ y", None, "ws.y"), slot,
                         ("const float* __restrict__ wts", None, "ws.topk_w"),
                         ("const bf16_t* __restrict__ x", None, c.x_expert), ("bf16_t* __restrict__ out", None, "out"),
                         *((("const bf16_t* __restrict__ ys", None, "ws.ys"),) if si else ()),
                         *((("const float* __restrict__ gate", None, "ws.gate_s"),) if c.gated else ())),
                        ("y", "slot", "wts", "x", "out", str(h), str(k), "blockIdx.x",
                         f"(blockIdx.y * {EW_THREADS} + threadIdx.x) * 4",
                         *(("ys", "gate" if c.gated else "nullptr") if si else ())), "prefill_combine_body",
                        ("prefill: out = sum_j Y[row(t, j)] (the weights on the input), choices in order" if c.woi else
                         "prefill: out = sum_j w[t, j] * Y[row(t, j)] (zero experts: w * x), choices in order")
                        + (" + gate * YS" if c.gated else " + YS" if si else "")),
    }
    if t.a8:  # FP8 activations: x, then the activations, quantized into codes in A8_ORDER (no X')
        del out["permute"]
        out["quant_x"] = kern("quant", f"quant_x_h{h}", QUANT_THREADS, (),
                              (("const bf16_t* __restrict__ x", None, c.x_expert),
                               ("unsigned char* __restrict__ xq", None, "ws.xq"), ("float* __restrict__ sx", None, "ws.sx"),
                               n),
                              ("x", "xq", "sx", str(h), "n"), "prefill_quant_body",
                              "prefill: x as e4m3 codes per token and 128 channels (FP8 activations), in A8_ORDER",
                              dep="last")
        shared_q = ((("const bf16_t* __restrict__ hs", None, "ws.act_s"),
                     ("unsigned char* __restrict__ hsq", None, "ws.actq_s"), ("float* __restrict__ sas", None, "ws.sas"))
                    if si else ())
        if xr:  # (after place: each (token, choice) row's place in the table)
            out["quant_x"] = kern("quant", f"quant_x_h{h}_k{k}_rows" + ("_shared" if si else ""), QUANT_THREADS, (),
                                  (("const bf16_t* __restrict__ x", None, c.x_expert),
                                   ("unsigned char* __restrict__ xq", None, "ws.xq"),
                                   ("float* __restrict__ sx", None, "ws.sx"), slot,
                                   ("unsigned char* __restrict__ xqr", None, "ws.xqr"),
                                   ("float* __restrict__ sxr", None, "ws.sxr"), n),
                                  ("x", "xq" if si else "nullptr", "sx", "slot", "xqr", "sxr", str(h), "n", str(k)),
                                  "prefill_quant_x_rows_body",
                                  "prefill: x as e4m3 codes per token and 128 channels (FP8 activations), in A8_ORDER, "
                                  "a row per (token, choice) in the tile table's order"
                                  + (" and a row per token (the shared expert's)" if si else ""), dep="first")
        out["quant_h"] = kern("quant", f"quant_h_i{i}_k{k}" + (f"_si{si}" if si else ""), QUANT_THREADS, (),
                              (("const bf16_t* __restrict__ h", None, "ws.act"),
                               ("unsigned char* __restrict__ hq", None, "ws.actq"), ("float* __restrict__ sa", None, "ws.sa"),
                               *shared_q, n),
                              ("h", "hq", "sa", str(i), f"n * {k}", *(("hs", "hsq", "sas", str(si), "n") if si else ())),
                              "prefill_quant_body",
                              "prefill: the activations as e4m3 codes per row and 128 channels, in A8_ORDER"
                              + (" (routed, then the shared expert's)" if si else ""))
    if t.fp8_tensor:  # FP8 per-tensor: no X'; the routed rows quantized per tile by their expert's input scales
        del out["permute"]
        out["quant_x"] = kern("quant", f"quant_x_h{h}_fp8t", EW_THREADS, ("true",),
                              (("const bf16_t* __restrict__ x", None, c.x_expert), tok, table,
                               ("const float* __restrict__ s13", None, "w.s13"), ("bf16_t* __restrict__ xp", None, "ws.xp")),
                              ("x", "tok", "tiles", "s13", "4", "xp", str(h), "blockIdx.y",
                               f"blockIdx.x * {EW_THREADS} + threadIdx.x"), "prefill_quant_tile_body",
                              "prefill: each routed row of x quantized by its expert's static input scale, in the "
                              "packed K order (FP8 per-tensor)", dep="first")
        out["quant_h"] = kern("quant", f"quant_h_i{i}_fp8t", EW_THREADS, ("false",),
                              (("bf16_t* h", None, "ws.act"), table, ("const float* __restrict__ s2", None, "w.s2")),
                              ("h", "nullptr", "tiles", "s2", "2", "h", str(i), "blockIdx.y",
                               f"blockIdx.x * {EW_THREADS} + threadIdx.x"), "prefill_quant_tile_body",
                              "prefill: H' quantized in place by each row's expert's down input scale (FP8 per-tensor)")
    if si:  # the shared expert: every token, in order, through its own gate/up and down GEMMs (its tile)
        out["gemm_gate_up_shared"] = kern(
            "gemm_gate_up_shared", f"gate_up_shared_h{h}_i{si}_{gemm_tag(ts)}_{ts.wfmt}_{c.act_tag}", ts.packed_threads,
            targs("true", "2", "false", tile=ts),
            ((f"{act_in} xp", None, xin), ("const uint4* __restrict__ ws13", None, "w.ws13"),
             stable, ("bf16_t* __restrict__ h", None, "ws.act_s"), n, *scales("ss13", "sx", ts), *tmaps),
            ("xp", "nullptr", "ws13", "stiles", "h", str(si), str(h), str(si // 16), "1", "n", "1", "0",
             *tmap(sarg("ss13", "sx", ts), 2, "xq")),
            "prefill_gemm",
            f"prefill: the shared expert's H' = silu(X' Wg) * (X' Wu), {ts.packed_rows} tokens a block", ts)
        out["gemm_down_shared"] = kern(
            "gemm_down_shared", f"down_shared_h{h}_i{si}_{down_tag(ts)}_m{c.tune.down_tiles}_{ts.wfmt}", ts.packed_threads,
            targs("false", str(c.tune.down_tiles), tile=ts),
            ((f"{act_in} hp", None, hsin), ("const uint4* __restrict__ ws2", None, "w.ws2"),
             stable, ("bf16_t* __restrict__ y", None, "ws.ys"), n, *scales("ss2", "sas", ts), *tmaps),
            ("hp", "nullptr", "ws2", "stiles", "y", str(h), str(si), str(h // 16), "1", "n", "1", "0",
             *tmap(sarg("ss2", "sas", ts), 3, "actq_s")),
            "prefill_gemm",
            "prefill: the shared expert's YS = H' Wd (bf16)", ts)
    return out


def a8_tensor_maps(c: Layer) -> tuple:
    """The tensor maps the prefill GEMMs with FP8 activations copy their weights with (w13, w2, then
    the shared expert's ws13, ws2; indices 0-3 of the weights' buffer "tmaps"): over the core-matrix
    layout (moegen.weights.pack_fp8_core: per group (gate/up's 16-row tile, down's row group of two),
    32-wide chunk, matrix and K half, the two 8-row halves' core matrices, 256 bytes), 32-bit
    elements, dims innermost first: those 256 bytes, the matrix, the group (every expert's in turn),
    the K half, the chunk. One box, a GEMM block's k-tile (four groups: 128 weight rows, four chunks),
    lands in shared memory as [chunk][K half][group][matrix][256 bytes]: the block's 128 rows as
    core matrices 128 bytes apart (gate/up: each group's gate rows, then its up rows), the K halves
    2048 bytes apart, as prefill_gemm_a8's B descriptor reads them. Then the maps over the
    workspace's token codes (x's, the routed and the shared activations'; a8_token_maps): bytes,
    [rows][K], a box one 64-row tile's k-tile in the 128-byte swizzle, the stage's layout for the
    A descriptor."""
    from .plan import TensorMap

    t = tiles(c)
    if not t.a8 or unsupported(c):
        return ()

    def tmap(weight: str, groups: int, kc: int, tile: GemmTiles) -> TensorMap:
        return TensorMap(weight, (64, 2, groups, 2, kc), (512, kc * 2 * 512, 256, 2 * 512), (64, 2, 4, 2, 4))

    maps = (tmap("w13", c.e_local * (c.i // 16), c.h // 32, t), tmap("w2", c.e_local * (c.h // 32), c.i // 32, t))
    if c.si:
        ts = shared_tiles_of(c)
        maps += (tmap("ws13", c.si // 16, c.h // 32, ts), tmap("ws2", c.h // 32, c.si // 32, ts))

    def codes(buf: str, k: int, rows: int, box_rows: int) -> TensorMap:
        return TensorMap(buf, (k, rows), (k,), (128, box_rows), elem=1, swizzle=128, workspace=True)

    # the token rows' codes in the workspace (bytes in the 128-byte swizzle: the stage's layout), a
    # box a 64-row tile's k-tile, for the GEMMs whose rows are in order (down; the shared expert's)
    maps += (codes("xq", c.h, c.nmax, 64), codes("actq", c.i, c.nmax * c.k, 64))
    if c.si:
        maps += (codes("actq_s", c.si, c.nmax, 64),)
    if a8_xrows(c, c.nmax):
        maps += (codes("xqr", c.h, c.nmax * c.k, 64),)
    return maps


def a8_token_maps(c: Layer) -> dict[str, int]:
    """Where a8_tensor_maps has each workspace buffer's map (the kernels' xmap; the routed gate/up
    GEMM reads xqr's in the buckets of a8_xrows, and elsewhere gathers its rows by cp.async, x's
    map unread)."""
    return {m.weight: i for i, m in enumerate(a8_tensor_maps(c)) if m.workspace}


def launches(c: Layer, nb: int, add: object) -> tuple[tuple[Launch, ...], tuple[Launch, ...]]:
    """The prefill kernels' launches for calls of up to nb tokens: (the one that needs no routing,
    X' or x's codes a row per token, its kernel's dep "last"; the rest, after the route). With
    prefill_pdl the kernels before the GEMMs are launched with programmatic dependence on the
    kernel before, and the first part goes between the router and the route (moegen.plan), where
    it runs beside the router."""
    from .plan import Launch

    halves, xrows = a8_halves(c, nb), a8_xrows(c, nb)
    ks = kernels(c, halves, xrows)
    t, ts = tiles(c), shared_tiles_of(c)
    rows_h = 2 * t.packed_rows if halves else 0  # (A8: the tiles' rows where a bucket cuts them at 128)

    def gemm_grid(k_dim: int, n_out: int, n_tiles: int, rows: int = t.gate_up_rows, tile: GemmTiles = t
                  ) -> tuple[int | str, int]:
        """A GEMM's grid: persistent where its k-loop is short (GemmTiles.persistent), one block a
        multiprocessor; otherwise a block per (row block of `rows`, tile; A8 pair of 64-row tiles)."""
        return ("sms", 1) if tile.persistent(k_dim) else (
            -(-n_out // rows), -(-n_tiles // 2) if tile.a8 and not halves else n_tiles)

    first = ({"quant_x": ((quant_blocks(nb * (c.h // 128)), 1), QUANT_THREADS, 0)} if t.a8 else {} if t.fp8_tensor else
             {"permute": (("sms", PERMUTE_PER_SM), EW_THREADS, 0)})
    group = {"count": ((chunks(c, nb), 1), GROUP_THREADS, 0), "scan": ((1, 1), GROUP_THREADS, 0),
             "place": ((chunks(c, nb), 1), GROUP_THREADS, 0)}

    def per_tile(width: int) -> tuple[tuple[int, int], int, int]:  # a block per routed tile and 512 columns
        return (-(-width // (2 * EW_THREADS)), max_tiles(c, nb)), EW_THREADS, 0

    if t.fp8_tensor:  # (after place: the rows' tiles)
        group["quant_x"] = per_tile(c.h)
    if xrows:  # (after place: each (token, choice) row's place)
        group["quant_x"] = first.pop("quant_x")
    routed = {"gemm_gate_up": (gemm_grid(c.h, c.i, max_tiles(c, nb, rows_h)), t.packed_threads, t.gate_up_smem_bytes),
              "gemm_down": (gemm_grid(c.i, c.h, max_tiles(c, nb, rows_h), t.down_rows), t.packed_threads,
                            t.down_smem_bytes)}
    shared = ({"gemm_gate_up_shared": (gemm_grid(c.h, c.si, shared_tiles(c, nb, rows_h), ts.gate_up_rows, ts),
                                       ts.packed_threads, ts.gate_up_smem_bytes),
               "gemm_down_shared": (gemm_grid(c.si, c.h, shared_tiles(c, nb, rows_h), ts.down_rows, ts), ts.packed_threads,
                                    ts.down_smem_bytes)}
              if c.si else {})
    experts = {**routed, **shared}
    if t.a8:  # both gate/up GEMMs, the quantization of their activations, then the downs
        quant_h = {"quant_h": ((quant_blocks(nb * c.k * (c.i // 128) + nb * (c.si // 128)), 1), QUANT_THREADS, 0)}
        experts = {f: experts[f] for f in ("gemm_gate_up", "gemm_gate_up_shared") if f in experts} | quant_h | {
            f: experts[f] for f in ("gemm_down", "gemm_down_shared") if f in experts}
    if t.fp8_tensor:  # gate/up, the quantization of H', then down
        experts = {"gemm_gate_up": experts["gemm_gate_up"], "quant_h": per_tile(c.i), "gemm_down": experts["gemm_down"]}
    combine = {"combine": (("n", -(-c.h // (4 * EW_THREADS))), EW_THREADS, 0)}
    pdl = c.tune.prefill_pdl

    def run(part: dict, pdl: bool) -> tuple[Launch, ...]:
        return tuple(Launch(add(ks[f]), grid, block, pdl, smem) for f, (grid, block, smem) in part.items())

    # the GEMMs and what follows them without programmatic dependence (prefill_pdl: the down GEMM's
    # measured 0.8-2.7% slower with it, the gate/up GEMM's and the combine's no faster)
    return run(first, pdl), run(group, pdl) + run({**experts, **combine}, False)
