"""The one-token kernel family: the whole layer in one launch (the one-token bucket, and with
single_two the two-token bucket) where its down weights fit, with its layout, the choices the
analytic plan makes for it (moegen.families.Tuning's single_* fields revise them) and its tensor maps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .families import FMT_MACRO, FP4_FORMATS, STATIC_SMEM, Layer, _b, _kernel

if TYPE_CHECKING:
    from .plan import Kernel, Target

SINGLE_WARPS = 16  # 512 threads: 128 registers each, P chunks of gate/up weights in flight per warp
SINGLE_INFLIGHT = 4  # gate/up chunks in flight per warp (4 x 2 KB x 16 warps = 128 KB a multiprocessor)
SINGLE_INFLIGHT_FP4 = 8  # FP4's chunks are 512 bytes: 8 x 512 bytes x 16 warps = 64 KB
# down by columns: the most units a group (each unit's weight base in registers; Mixtral-8x22B's 16
# spilled 60 bytes, Mixtral-8x7B's 14 none)
SINGLE_COLS_UR = 14
# the two-token bucket in one launch (single_two): at most 8 (unit, token) pairs a group. A group's
# bytes double with the tokens, and one block streams at about 30-38 GB/s (per-block stamps, H200),
# so past about 8 units of 192 KB a group's stream outlasts the three launches' whole layer. On the
# H200 (2026-12-01, N = 2, one process, 8 rounds, three launches -> one): Qwen3-30B-A3B (6 pairs)
# 47.86 -> 43.37 us, Qwen3-Next-80B-A3B (6) 45.96 -> 42.12, OLMoE (8) 56.93 -> 55.83; with 12 pairs
# slower: DeepSeek-V2-Lite 66.98 -> 71.39, Qwen1.5-MoE 63.35 -> 71.05, GLM-4.5-Air 138.35 -> 172.48
SINGLE_TWO_PAIRS = 8


def single_layout(c: Layer, target: Target, ntok: int = 1) -> tuple[int, int] | None:
    """(dynamic shared memory bytes, gate/up units a block takes per round) of the single-launch
    kernel for this layer, or None where it does not apply: it takes BF16 weights (or, with the
    tunings single_fp8 / single_fp4, FP8 block or per-tensor, MXFP4 or NVFP4 weights; a shared expert in the
    routed experts' format), no expert parallelism, biases, identity experts, weighted inputs or
    hash routing, one reduction order for every N only where the spec does not ask for it
    (batch_invariant), hidden sizes whose 32-wide chunks split evenly over its warps, and a
    block's share of the down weights (16 rows of every chosen expert and of the shared expert, 1
    KB per 32-wide chunk in BF16, 512 bytes in FP8; FP4: its row group's 32 rows, 512 bytes, and
    their scales) must fit in shared memory beside the reduction space, unless down goes by
    columns (single_cols: BF16), which keeps none of it there. ntok 2: the two-token bucket's kernel
    (single_two: down by columns only, twice a group's units at most SINGLE_TWO_PAIRS)."""
    # FP8 and FP4 with tagged words only (with the barriers FP8's down phase spills); FP4 with two
    # down tiles a row group (a block copies its group's run, both tiles, and takes its own)
    fmts = ("bf16",) + (("fp8_block", "fp8_tensor") if c.tune.single_fp8 and c.tune.single_tags else ()) + (
        FP4_FORMATS if c.tune.single_fp4 and c.tune.single_tags and c.tune.down_tiles == 2 else ())
    if not c.tune.single or c.spec.batch_invariant or c.kf_e not in fmts or (c.si and c.kf_s != c.kf_e):
        return None
    if c.ep_size > 1 or c.bias or c.z or c.woi or c.hashed or 16 * (c.k + 1) > 32 * SINGLE_WARPS:
        return None
    kc = c.h // 32
    cpu = kc // SINGLE_WARPS
    if kc % SINGLE_WARPS or cpu % _inflight(cpu):
        return None
    _, ur = _single_units(c, target)
    dslots = c.k + (1 if c.si else 0)
    pieces = c.k * (c.i // 32) + c.si // 32
    cols = single_cols(c, target)
    if ntok > 1 and not (cols and c.tune.single_two and ur * ntok <= SINGLE_TWO_PAIRS):
        return None
    red = 4 * max(SINGLE_WARPS * 16 * ntok, ur * ntok * SINGLE_WARPS * 32, (SINGLE_WARPS + 1) * dslots * 16)
    if cols:  # the staged logits, each token's sums of every output row, mbarriers, the choices, route_one's room
        static = ntok * (4 * single_ksplit(c) * c.rows_pad + 4 * c.h + 8 * ur + 12 * c.k + 264) + 8 * dslots + 760
    else:
        static = 8 * (c.e + c.z) + 8 * c.k + 256  # route_body's counters, the block's routing
        static += 16 * c.e + 256  # route_block's keys, scores and group maxima
        static += 12 * 32  # route_one's candidates and their scores
        # the activations staged for down; with tagged words, the logits before them in the same space
        static += max(2 * (c.k * c.i + c.si), 4 * single_ksplit(c) * c.rows_pad if single_tags(c) else 0)
    if c.kf_e == "fp8_block":  # the down rows' block scales
        static += 4 * dslots * -(-max(c.i, c.si) // 128)
    if c.kf_e == "fp8_tensor":  # each operand's down scale; x quantized for each unit of a round
        static += 4 * dslots + 2 * ur * c.h
    if c.kf_e in FP4_FORMATS:  # each operand's down scales (a chunk's 32 or 64 bytes; NV: scale_2, 16)
        static += dslots * (max(c.i, c.si) // 32 * (32 if c.kf_e == "mxfp4" else 64) + (16 if c.kf_e == "nvfp4" else 0))
    smem = red if cols else pieces * _single_piece(c) + red
    if smem + static > target.smem_per_block or static > STATIC_SMEM:
        return None
    return smem, ur


def single_cols(c: Layer, target: Target) -> int:
    """The one-token kernel's down by columns (tuning single_cols, on unless set) as its count of
    unit groups, 0 where not taken. Group v takes the gate/up units v, v + VB, ... (ur of them at
    most, VB = ceil(units / ur): a block each where the grid has as many). Each warp streams, after
    unit k + 1's gate/up chunks, its row tiles' fragments of unit k's columns of down (16 K of every
    output row: 16 bytes a lane and row tile, the packed layout's lanes of the unit's half chunk),
    and multiplies them by unit k's activations once every warp has added its part (an mbarrier a
    unit); the group's sums of every output row (the units in order) go out as one partial, and
    each block adds its 16 rows over the VB partials in group order. So only the last unit's
    products follow the stream, and the exchange after it is one word per group and row, where
    down by rows exchanges every activation and then multiplies 16 rows of every operand from
    shared memory. BF16 weights, tagged words and the overlapped route; a warp's row tiles in whole
    column chunks (4 a chunk). With a shared expert its units come first (the first units of
    groups 0, 1, ...), and those groups start them before the route has chosen. Needing no shared
    memory for down, it also takes the layers whose down rows do not fit (OLMoE, DeepSeek-V2-Lite,
    Mixtral-8x7B, Qwen3-235B-A22B, ...: their N = 1 bucket ran router, gate/up and down before)."""
    if c.tune.single_cols is False or c.kf_e != "bf16" or not single_overlap(c) or single_late_down(c):
        return 0
    if (c.h // 16) % (SINGLE_WARPS * 4):
        return 0
    units, ur = _single_units(c, target)
    return -(-units // ur) if ur <= SINGLE_COLS_UR else 0


def _single_units(c: Layer, target: Target) -> tuple[int, int]:
    """The one-token kernel's gate/up units (16 rows of one chosen expert or of the shared expert)
    and the most a block takes in one round (one round where the grid has the target's blocks)."""
    units = c.k * (c.i // 16) + c.si // 16
    return units, -(-units // target.sm_count)


def _single_piece(c: Layer) -> int:
    """Bytes of one down piece of the one-token kernel: a block's 16 rows x 32 K in BF16 or FP8 codes,
    or the 32 rows of its row group in FP4 codes (a lane's 16 bytes hold both tiles')."""
    return 1024 if c.kf_e == "bf16" else 512


def single_ksplit(c: Layer) -> int:
    """The one-token kernel's router K split: parts of one 32-wide chunk per warp (a unit's loads
    are one round trip either way), so that the route adds as few partial sums as it can; never
    more parts than the layer's logits buffer holds."""
    return max(1, min(c.ksplit, (c.h // 32) // SINGLE_WARPS))


def _inflight(cpu: int) -> int:
    """Chunks in flight per warp: SINGLE_INFLIGHT or the largest divisor of a warp's chunks below it."""
    return max(p for p in range(1, SINGLE_INFLIGHT + 1) if cpu % p == 0)


def single_tags(c: Layer) -> bool:
    """Whether the one-token kernel synchronizes with tagged words (tuning single_tags) rather than
    grid barriers: where its route is route_one's (no expert groups, hash tables or SparseMixer)."""
    r = c.spec.routing
    return c.tune.single_tags and r.n_group == 1 and r.score.value != "sparsemixer"


def single_overlap(c: Layer) -> bool:
    """Whether the one-token kernel overlaps its route with the first gate/up loads (tuning
    single_overlap): with tagged words."""
    return c.tune.single_overlap and single_tags(c)


def single_block_route(c: Layer, target: Target, ntok: int = 1) -> bool:
    """Whether the one-token kernel routes with the whole block (tuning single_block_route; None:
    without a shared expert, at most a quarter as many experts as threads) rather than warp 0's
    route_one: down by columns, one token, and a rule route_block takes (every expert's selection
    value a function of its logit, one expert a thread, at most 16 choices)."""
    r = c.spec.routing
    fits = (not (r.score.value == "softmax" and r.select.value == "scores" and r.correction_bias)
            and c.e <= SINGLE_WARPS * 32 and c.k <= 16)
    # the analytic rule where it was measured: every rank counted directly (4 E <= threads, one
    # barrier); past that, route_block's rank of its group maxima took 1.2 us of Qwen3-Next's 2.1
    want = (c.tune.single_block_route if c.tune.single_block_route is not None
            else not c.si and 4 * c.e <= SINGLE_WARPS * 32)
    return bool(want and fits and ntok == 1 and single_cols(c, target) and single_tags(c))


def single_tmap(c: Layer) -> bool:
    """Whether the one-token kernel asks for a block's down rows of one operand with one tensor
    copy (tuning single_tmap, on unless set): where they are pieces apart (down_tiles > 1). One
    bulk copy a piece holds the issuing warp until most of the pieces are in flight."""
    return c.tune.single_tmap is not False and c.tune.down_tiles > 1 and c.kf_e not in FP4_FORMATS


def single_late_down(c: Layer) -> bool:
    """Whether the one-token kernel asks for a block's down rows as warp 0 starts its last round of
    gate/up loads rather than once the route has chosen (tuning single_late_down; None: FP8 block
    and FP4 weights, whose down rows a block takes 96 or 48 KB of at Qwen3-30B-A3B's shape, not
    BF16's 192 KB, which then come too late)."""
    v = c.tune.single_late_down
    return c.kf_e != "bf16" if v is None else v


def single_tensor_maps(c: Layer, target: Target) -> tuple:
    """The tensor maps the one-token kernel copies its down rows with (single_tmap): over the packed
    down weights w2 [E][row group][chunk][tile][piece] and the shared expert's ws2 (no E), 32-bit
    elements, one box = one tile's pieces of every chunk (one operand's rows of a block, contiguous
    in shared memory as the kernel reads them)."""
    from .plan import TensorMap

    if not single_tmap(c) or single_cols(c, target):
        return ()
    piece = _single_piece(c)
    t, groups = c.tune.down_tiles, c.h // (16 * c.tune.down_tiles)

    def tmap(weight: str, kcd: int, experts: int) -> TensorMap:
        dims = (piece // 4, t, kcd, groups) + ((experts,) if experts else ())
        strides = (piece, piece * t, piece * t * kcd) + ((piece * t * kcd * groups,) if experts else ())
        return TensorMap(weight, dims, strides, (piece // 4, 1, kcd, 1) + ((1,) if experts else ()))

    return (tmap("w2", c.i // 32, c.e_local),) + ((tmap("ws2", c.si // 32, 0),) if c.si else ())


def single_kernel(c: Layer, target: Target, ntok: int = 1) -> tuple[Kernel, int]:
    """The single-launch kernel of the one-token bucket (ntok 2: of the two-token bucket,
    single_two), and its dynamic shared memory."""
    smem, ur = single_layout(c, target, ntok)
    ks = single_ksplit(c)
    vb = single_cols(c, target)
    br = single_block_route(c, target, ntok)
    name = (f"moe_single_e{c.e}_h{c.h}_i{c.i}_k{c.k}" + (f"_si{c.si}" if c.si else "")
            + f"_ks{ks}_n{c.nmax}_{c.route_tag}_{c.act_tag}_t{c.tune.down_tiles}_u{ur}"
            + ("" if single_tags(c) else "_barriers") + ("_ov" if single_overlap(c) else "")
            + ("_cols" if vb else "_tmap" if single_tmap(c) else "")
            + ("_late" if single_late_down(c) else "") + ("_br" if br else "")
            + ("" if c.kf_e == "bf16" else f"_{c.kf_e}") + (f"_x{ntok}" if ntok > 1 else "")
            + f"_{c.spec.arch}")
    kc = c.h // 32
    targs = (*map(str, (kc, c.i // 32, c.si // 32, c.i // 16, c.si // 16, c.i, c.si, c.h, c.e, c.k, c.rows_pad,
                        ks, c.nmax, c.tune.down_tiles)), _b(c.gated),
             *map(str, (SINGLE_WARPS, ur, SINGLE_INFLIGHT_FP4 if c.kf_e in FP4_FORMATS else _inflight(kc // SINGLE_WARPS))),
             _b(single_tags(c)), FMT_MACRO[c.kf_e],
             _b(single_overlap(c)), _b(single_tmap(c) and not vb), _b(single_late_down(c)), str(vb), str(ntok), _b(br))
    base = (("const uint4* __restrict__ wr", "wr", "w.router"), ("const uint4* __restrict__ w13", "w13", "w.w13"),
            ("const uint4* __restrict__ ws13", "ws13", "w.ws13"), ("const uint4* __restrict__ w2", "w2", "w.w2"),
            ("const uint4* __restrict__ ws2", "ws2", "w.ws2"),
            ("const float* __restrict__ s13", "s13", "w.s13"), ("const float* __restrict__ ss13", "ss13", "w.ss13"),
            ("const float* __restrict__ s2", "s2", "w.s2"), ("const float* __restrict__ ss2", "ss2", "w.ss2"),
            ("const bf16_t* __restrict__ xr", "xr", c.x_router),
            ("const bf16_t* __restrict__ x", "x", c.x_expert), ("float* logits", "logits", "ws.logits"),
            ("unsigned* gbar", "gbar", "ws.gbar"),
            ("const float* __restrict__ corr_bias", "corr_bias", "w.corr_bias"),
            ("const float* __restrict__ router_bias", "router_bias", "w.router_bias"),
            ("int* __restrict__ topk_ids", "topk_ids", "ws.topk_ids"), ("float* __restrict__ topk_w", "topk_w", "ws.topk_w"),
            ("bf16_t* act", "act", "ws.act"), ("bf16_t* act_s", "act_s", "ws.act_s"),
            ("bf16_t* __restrict__ out", "out", "out"), ("unsigned long long* tl", "tl", "ws.stl"),
            ("u32* tact", "tact", "ws.stact"), ("u32* epoch", "epoch", "ws.sepoch"),
            ("unsigned long long* spart", "spart", "ws.spart"), ("const void* tmaps", "tmaps", "w.tmaps"))
    kernel = _kernel(name, "single", SINGLE_WARPS * 32, targs, base, (), "single_body",
                     ("one token" if ntok == 1 else f"{ntok} tokens")
                     + f" in one launch: router ({c.rows_pad // 16} tiles x {ks} parts), route in "
                     f"every block, gate/up ({c.k} x {c.i // 16}" + (f" + {c.si // 16}" if c.si else "")
                     + (" tiles), down by columns streamed behind them, partial sums a block; "
                        if vb else " tiles), down from shared memory (16 rows a block) + weighted sum; ")
                     + ("tagged words" if single_tags(c) else "two grid barriers"))
    return kernel, smem
