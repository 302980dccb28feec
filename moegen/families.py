"""The kernel families of a layer, as the plan instantiates them: each function returns one
Kernel (its name, template arguments, C signature and how the launcher fills each argument).

Parameters that only some layers have go last in a signature and default to nullptr in the
template bodies, so a layer without a feature compiles to the code it had before the feature
existed (checkable with cuobjdump -sass).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .prefill import PREFILL_BN, PREFILL_STAGES
from .spec import Select, Spec

if TYPE_CHECKING:
    from .plan import Kernel, Target

WARPS = 4  # warps per GEMV block: K is split over them, partial sums added in warp order
ROUTER_TILES = 4  # the prefill router's 16-row tiles a block (router_tiles)
STATIC_SMEM = 48 * 1024  # the cp.async ring of a GEMV block stays within static shared memory
MAX_DEPTH = 8  # chunks per warp in the ring (DEPTH-1 in flight while one is consumed)
PACK_THREADS = 256
NORM_THREADS = 256
ROUTE_THREADS = 256  # the route kernel: one warp per token, 8 tokens a block
# (routing a token is a warp's arithmetic over all its experts: with 32 tokens a block, 1024
# threads, a multiprocessor's issue slots bound the kernel; Qwen3-Next-80B-A3B's route took
# 17.6-22 us at N = 64-256 on the H200; 256 threads also leave a lane the registers for any
# number of scored experts)
DOWN_TILES = 2  # 16-row tiles per down block: fewer, longer blocks (one wave at N=1)
FP4_FORMATS = ("mxfp4", "nvfp4")  # e2m1 codes: two matrices (gate and up, or two down tiles) share a fragment
# 16-byte A fragments per lane, matrix and 32-wide chunk (FP4: half of one, two matrices share it)
A_FRAGMENTS = {"bf16": 2.0, "fp8_block": 1.0, "fp8_block_a8": 1.0, "fp8_tensor": 1.0, "mxfp4": 0.5, "nvfp4": 0.5}
FMT_MACRO = {"bf16": "MOE_W_BF16", "fp8_block": "MOE_W_FP8_BLOCK", "fp8_block_a8": "MOE_W_FP8_BLOCK_A8",
             "fp8_tensor": "MOE_W_FP8_TENSOR",
             "mxfp4": "MOE_W_MXFP4", "nvfp4": "MOE_W_NVFP4"}
SCORE_MACRO = {"softmax": "MOE_SCORE_SOFTMAX", "sigmoid": "MOE_SCORE_SIGMOID",
               "sqrt_softplus": "MOE_SCORE_SQRT_SOFTPLUS", "sparsemixer": "MOE_SCORE_SPARSEMIXER"}
ACT_MACRO = {"silu_gated": "MOE_ACT_SILU", "gelu_gated": "MOE_ACT_GELU",
             "swiglu_clamped": "MOE_ACT_SWIGLU_CLAMPED"}

Rule = tuple[tuple[str, str, str], ...]  # (C type, name, value) constants of a rule struct
Extra = tuple[tuple[str, str, str], ...]  # (C parameter, wrapper argument, launcher key)


def _b(v: bool) -> str:
    return "true" if v else "false"


class TuningError(ValueError):
    """A tuning the kernels cannot take (moegen.plan turns it into a PlanError)."""


# 16-byte units of scales per matrix and chunk in the ring (FP8: one fp32 per matrix, rounded up)
SCALE_UNITS = {"bf16": 0, "fp8_block": 0.25, "fp8_block_a8": 0.25, "fp8_tensor": 0, "mxfp4": 1, "nvfp4": 2}


def chunk_bytes(mats: int, nt: int, fmt: str) -> int:
    """Ring bytes of one 32-wide chunk per warp: A fragments of MATS matrices, B of NT token
    groups, the chunk's scales (TileGemv::SCU), and with FP8 activations each lane's token scales
    (TileGemv::XSU)."""
    xsu = (nt + 1) // 2 if fmt == "fp8_block_a8" else 0
    return int((mats * A_FRAGMENTS[fmt] + nt + xsu) * 512) + 16 * math.ceil(mats * SCALE_UNITS[fmt])


def depth(mats: int, nt: int, fmt: str = "bf16", warps: int = WARPS) -> int:
    """Ring depth: as many 32-wide chunks in flight per warp as static shared memory holds."""
    chunk = chunk_bytes(mats, nt, fmt)
    fits = STATIC_SMEM // (warps * chunk)
    if fits < 2:
        raise TuningError(f"{warps} warps x 2 chunks of {chunk} bytes exceed {STATIC_SMEM} bytes of static "
                          f"shared memory ({mats} matrices, {8 * nt} tokens a pass)")
    return min(MAX_DEPTH, fits)


@dataclass(frozen=True)
class Tuning:
    """Choices the analytic plan makes that a measurement on the GPU may revise (`moegen tune`):
    warps per gate/up and down block (K is split over them; fewer where a kernel's ring would not
    fit, see _warps), 16-row tiles per down block, and whether down blocks prefetch their weights
    into L2 before waiting for gate/up, and the router's K split. The defaults are the analytic
    plan's; kernel names carry any other value."""

    warps: int = WARPS
    # 16-row tiles per down block, the down weights' packing. With 1 the one-token kernel's bulk
    # copies of a block's down rows are one contiguous run per expert (not one 1 KB piece per
    # 32-wide chunk): measured 28.5 against 29.2 us at N = 1 (Qwen3-30B-A3B, H200), but the
    # two-tile down kernels of N >= 2 were 4-20% faster, so the analytic plan keeps 2.
    down_tiles: int = DOWN_TILES
    # Down blocks that start early (programmatic dependent launch, while gate/up still runs) ask
    # L2 for their weight tile before they wait: the down weights stream during gate/up.
    prefetch: bool = False
    # The router's K split (0: the analytic one, the smallest that gives every SM a block): fewer,
    # longer router blocks leave fewer partial sums to add before the route.
    router_split: int = 0
    # The largest token bucket computed by the fused expert kernel, within fused_max's limits
    # (0: none, the analytic plan: measured on the H200 it gained 4% at N = 1 for Qwen3-30B-A3B
    # and lost elsewhere, see the README).
    fused: int = 0
    # The token count from which buckets (those whose largest N reaches it) run the prefill
    # kernels (0: the analytic one, moegen.prefill_plan.prefill_from; past max_tokens: never).
    prefill_from: int = 0
    # The largest token count of the GEMV path (0: the analytic crossover, prefill_plan): the
    # prefill kernels from the next one on, with a bucket edge there where the power-of-two buckets
    # have none (moegen tune measures cuts around the analytic one: a layer's own crossover).
    prefill_cut: int = 0
    # The prefill GEMMs' block (moegen.prefill.GemmTiles): bm / 64 warpgroups of 4 warps, a 16-row
    # weight tile each warp (bm 64 or 128; 0: the analytic 128), the ring's stages (0: the analytic
    # 4), and a producer warpgroup filling the ring (mbarriers; the consumer warpgroups run on their
    # own) rather than every thread loading and a block barrier a k-tile: on the H200 (2026-11-30,
    # moegen tune, N = 2048 / 8192) 3.3-5% faster than the barrier version (Mixtral-8x7B 11602
    # against 12352 us, Qwen3-30B-A3B 1783 against 1851 us at N = 8192).
    prefill_bm: int = 0
    prefill_stages: int = 0
    # The BF16 GEMMs' token rows a tile (0: the analytic choice, moegen.prefill_plan.tiles): 128, or
    # 160 (each k-step's A fragments loaded apart, which leaves the registers for the wider sums)
    prefill_bn: int = 0
    prefill_ws: bool = True
    # The down GEMM's stages (0: as gate/up's). Without the producer warpgroup, 3 fits two down
    # blocks a multiprocessor: 0.977 / 0.999 of the 4-stage time (Qwen3-30B-A3B / Mixtral, H200).
    prefill_down_stages: int = 0
    # The down GEMM with a producer warpgroup on whole row groups of two 16-row tiles (down_tiles 2):
    # a warp multiplies both tiles, gate/up's shape, so a block reads each token row B tile once
    # for 256 rows instead of 128 (False: a tile a warp).
    prefill_down_pair: bool = True
    # The persistent down GEMM's Y tile (row-group pairs, two consumer warpgroups) staged in shared
    # memory a warpgroup's half at a time and written by bulk copies (moegen.prefill.GemmTiles.stage_y;
    # None: the analytic choice, BF16 and FP4 weights). On the H200 (2026-12-01, one process, the same
    # bits, us per layer, without against with): Qwen3-30B-A3B 341.5 / 495.7 / 1499.0 against 345.3 /
    # 484.7 / 1429.8 at N = 600 / 2048 / 8192; -NVFP4 563.3 / 1694.7 against 559.4 / 1639.3, OLMoE
    # 510.8 / 1748.6 against 496.3 / 1709.0, Qwen3-Next-80B-A3B 963.8 / 2000.0 against 968.5 / 1944.1
    # at N = 2048 / 8192; slower with FP8 weights, whose loops convert codes (Qwen3-30B-A3B-FP8
    # 603.3 / 2024.9 against 618.2 / 2072.4, -FP8-a8 411.7 / 1399.6 against 418.9 / 1415.0).
    prefill_stage_y: bool | None = None
    # FP8 activations: the buckets of moegen.prefill_plan.a8_xrows quantize x into a row of codes
    # per (token, choice) in the tile table's order, which the routed gate/up GEMM reads by tensor
    # copies (False: it gathers each token's row by cp.async in every bucket).
    prefill_xrows: bool = True
    # The prefill GEMMs' weight k-tiles by bulk copies (moegen.prefill.GemmTiles.bulk_a): on
    # the H200 (2026-11-30, one process, the same bits) Qwen3-30B-A3B 357.3 / 577.7 / 1724.2 against
    # 340.8 / 528.9 / 1606.6 us at N = 512 / 2048 / 8192, Mixtral-8x7B 3493.6 / 11772.5 against
    # 3116.2 / 10593.9 us at N = 2048 / 8192, Qwen2-57B-A14B 1371.8 against 1316.7 us at N = 256;
    # Qwen3-30B-A3B-FP8-a8 426.8 / 1473.6 against 412.1 / 1411.6 us at N = 2048 / 8192, its FP8
    # weight-only layer within the spread, 2067.7 against 2069.8 us at N = 8192 (its loops convert
    # codes on the CUDA cores). False: the producers' cp.async, 16 bytes each.
    prefill_bulk_a: bool = True
    # Layers with a BF16 shared expert get prefill buckets too, the shared expert as one more GEMM
    # pair over all tokens (checked against the reference on the H200; False keeps them on the GEMV path).
    prefill_shared: bool = True
    # The prefill kernels before the GEMMs launched with programmatic dependence on the kernel
    # before (each waits for it, griddepcontrol.wait, before it reads anything; moegen.plan.Kernel.dep),
    # and the kernel that needs no routing (X' permute, grid-strided; FP8 activations: x's
    # quantization where its codes are a row per token) between the router and the route, its work
    # before its wait, so that it runs beside the router. On the H200 (2026-12-03, one process, the
    # same bits, us per layer, medians of 8 rounds, without -> with): Qwen3-30B-A3B 346.3 -> 341.6 /
    # 454.8 -> 447.8 at N = 600 / 2048 (8192 within the rounds' spread), -FP8-a8 364.0 -> 355.5 at
    # 2048. The GEMMs and what follows them stay plain launches: with programmatic dependence too,
    # Qwen3-30B-A3B's 2048 lost the gain and -FP8-a8's 8192 went 1060.2 -> 1103.0; measured one
    # boundary at a time, the down GEMM's costs 0.8-2.7% and the gate/up GEMM's and the combine's
    # are within the spread (README, Prefill). False: plain launches, that kernel after the route.
    prefill_pdl: bool = True
    # The one-token bucket as a single launch (single_layout: where its down weights fit in shared
    # memory): router, route, gate/up and down in one resident grid with two grid-wide barriers.
    single: bool = True
    # ... launched cooperatively (the driver refuses a grid that cannot be resident at once); False:
    # a plain launch, relying on one block per multiprocessor being resident (nothing else running)
    single_coop: bool = True
    # ... with tagged words (each partial logit and activation carries the call's epoch, and the
    # readers load until every one is this call's) instead of its two grid barriers, where the
    # route is route_one's (no expert groups, hash tables or SparseMixer): measured on the H200
    # 27.5-27.9 against 28.5-28.7 us (Qwen3-30B-A3B), 29.4-29.6 against 29.8-30.1 (Qwen3-Next)
    single_tags: bool = True
    # ... for FP8 block weights too (e4m3 codes, 128 x 128 block scales; with tagged words):
    # Qwen3-30B-A3B-FP8 at N = 1 22.4-22.8 us against 26.5 in four launches (H200)
    single_fp8: bool = True
    # ... for MXFP4 and NVFP4 weights too (e2m1 codes with their row scales; with tagged words and
    # two down tiles a row group: a block copies its group's whole run, both tiles, and multiplies
    # its own): Qwen3-30B-A3B at N = 1 20.7-21.4 us against 29.0-29.2 in four launches (H200)
    single_fp4: bool = True
    # ... with tagged words, the other warps streaming a block's first gate/up unit as soon as warp
    # 0's route has chosen its expert, while it chooses the rest (two mbarriers), rather than the
    # whole block routing first (route_block, the tuning single_overlap false): 0.4-0.8 us faster
    # at N = 1 on the H200 (26.1 against 26.9 us Qwen3-30B-A3B, 26.7 against 27.3 Qwen3-Next,
    # 20.2 against 20.6 NVFP4), racecheck clean (0 hazards: Qwen3-30B-A3B, Qwen3-Next, NVFP4;
    # 2026-11-30)
    single_overlap: bool = True
    # ... where a down row group packs several 16-row tiles (down_tiles > 1), a block's rows of one
    # operand (one 16-row piece per 32-wide chunk, 2 or more pieces apart) asked for as one tensor
    # copy (a TMA tensor map over the packed weights, moegen.plan.TensorMap) rather than a bulk
    # copy per piece, which held the asking warp for ~9 us at Qwen3-30B-A3B's 192 pieces. None (the
    # analytic plan) or True: on (Qwen3-30B-A3B-FP8 at N = 1: 22.8 against 25.2 us on the H200;
    # Qwen3-30B-A3B 26.9 against 27.0, its fence now off the route's path); False: never
    single_tmap: bool | None = None
    # ... a block's down rows asked for late (single_late_down): as warp 0 starts its last round of
    # gate/up loads, rather than as soon as the route has chosen, so that the memory streams the
    # gate/up weights first and the down rows behind them while the activations are exchanged.
    # None (the analytic plan): FP8 block and FP4 weights, not BF16. Measured on the H200 (2026-12-01,
    # N = 1, one process, 10-12 interleaved rounds, the same bits): Qwen3-30B-A3B-FP8 18.58 -> 17.63
    # and 18.50 -> 17.61 us, -NVFP4 20.43 -> 19.75, -MXFP4 20.46 -> 20.02; BF16 slower (Qwen3-30B-A3B
    # 25.70 -> 25.93, Qwen3-Next-80B-A3B 25.48 -> 25.87), and asked for one round earlier slower
    # still; the first half of the operands early and the rest late within the spread (25.59 ->
    # 25.55, 25.54 -> 25.49, FP8 18.50 -> 18.55).
    single_late_down: bool | None = None
    # ... with BF16 weights, down by columns (single_cols): each warp streams, behind a unit's gate/up
    # chunks, its row tiles' fragments of the unit's columns of down, and multiplies them by the
    # unit's activations while the next unit streams; each block's partial sum of every output row,
    # then each block's 16 rows added over the blocks' partials. None (the analytic plan) or True:
    # where it applies; False: the activations exchanged, then each block's 16 output rows of every
    # operand from shared memory.
    single_cols: bool | None = None
    # ... and (single_two) the two-token bucket in one launch too, where down by columns takes both
    # tokens (each token's units as at one token: a group's pairs of unit and token, twice its
    # units, at most SINGLE_TWO_PAIRS); False: that bucket runs router, gate/up and down
    single_two: bool = True
    # ... (one token, down by columns) the route by the whole block (route_block: every thread an
    # expert, the choices ranked among the keys above a bound) rather than warp 0's while the other
    # warps wait (route_one). None (the analytic plan): where the layer has no shared expert, whose
    # units the groups that start with one begin streaming while warp 0 routes, and at most 128
    # experts (route_block ranks each directly; Qwen3-Coder-480B's 160 are not measured). Measured on the H200
    # (2026-12-01, N = 1, one process, 6-8 interleaved rounds, the same bits), against warp 0's route:
    # Mixtral-8x7B 190.30 -> 187.69 us, OLMoE 30.53 -> 29.48, Qwen3-30B-A3B 24.77 -> 24.65; with a
    # shared expert slower: Qwen3-Next-80B-A3B 24.46 -> 25.10, DeepSeek-V2-Lite 38.74 -> 39.26
    # (GLM-4.5-Air 88.87 -> 88.23, but 88.88 with warp 0's route by a bound, below)
    single_block_route: bool | None = None
    # The GEMV buckets' pass width for the routed experts, in groups of 8 tokens (1-4; never more
    # than the bucket's own): 0, the analytic plan, takes twice the mean tokens per routed expert.
    routed_nt: int = 0

    def check(self, spec: Spec) -> None:
        """Raises TuningError where the kernels cannot take this tuning."""
        h = spec.hidden_size
        fp4 = "fp4" in spec.experts.format.value or "fp4" in getattr(spec.shared_expert, "format", spec.experts.format).value
        if self.warps not in (2, 4, 8):
            raise TuningError(f"tuning warps={self.warps}: 2, 4 or 8")
        if self.down_tiles not in (1, 2, 4, 8) or h % (16 * self.down_tiles):
            raise TuningError(f"tuning down_tiles={self.down_tiles}: 1, 2, 4 or 8, dividing hidden_size={h} by 16 each")
        if fp4 and self.down_tiles % 2:
            raise TuningError(f"tuning down_tiles={self.down_tiles}: FP4 tiles pair their matrices (an even count)")
        if self.prefill_bm not in (0, 64, 128) or self.prefill_stages not in (0, *PREFILL_STAGES):
            raise TuningError(f"tuning prefill_bm={self.prefill_bm}, prefill_stages={self.prefill_stages}: "
                              "bm 64 or 128, 3 to 8 stages (0: the analytic choice)")
        if self.prefill_bn not in (0, *PREFILL_BN):
            raise TuningError(f"tuning prefill_bn={self.prefill_bn}: {' or '.join(map(str, PREFILL_BN))} token rows a tile "
                              "(0: the analytic choice)")
        if self.prefill_bn > PREFILL_BN[0] and spec.experts.format.value != "bf16":
            raise TuningError(f"tuning prefill_bn={self.prefill_bn}: wider tiles than {PREFILL_BN[0]} take BF16 experts, "
                              f"not {spec.experts.format.value}")
        if self.prefill_bn > PREFILL_BN[0] and not (self.prefill_ws and self.prefill_bulk_a and self.prefill_down_pair
                                          and self.down_tiles == 2 and self.prefill_bm in (0, 128)):
            raise TuningError(f"tuning prefill_bn={self.prefill_bn}: wider tiles than {PREFILL_BN[0]} take the producer warpgroup, "
                              "two consumer warpgroups, the weights by bulk copies and the down GEMM on row-group pairs "
                              "(prefill_ws, prefill_bm, prefill_bulk_a, prefill_down_pair, down_tiles=2)")
        if self.prefill_bn > PREFILL_BN[0] and self.prefill_stage_y:
            raise TuningError(f"tuning prefill_bn={self.prefill_bn} with prefill_stage_y: the staged Y tile takes at "
                              "most 128 token rows (a row a consumer thread)")
        if self.prefill_down_stages not in (0, *PREFILL_STAGES):
            raise TuningError(f"tuning prefill_down_stages={self.prefill_down_stages}: 3 to 8 (0: as prefill_stages)")
        if self.prefill_from < 0:
            raise TuningError(f"tuning prefill_from={self.prefill_from}: 0 (analytic) or a token count")
        if self.prefill_cut < 0 or (self.prefill_cut and self.prefill_from):
            raise TuningError(f"tuning prefill_cut={self.prefill_cut}: 0 (analytic) or the GEMV path's largest "
                              "token count, without prefill_from")
        if self.fused < 0:
            raise TuningError(f"tuning fused={self.fused}: 0 (off) or the largest bucket to fuse")
        if self.routed_nt not in (0, 1, 2, 3, 4):
            raise TuningError(f"tuning routed_nt={self.routed_nt}: 1-4 groups of 8 tokens a pass (0: the analytic choice)")
        kc = h // 32
        if self.router_split and (self.router_split < 0 or kc % self.router_split or kc // self.router_split < WARPS):
            raise TuningError(f"tuning router_split={self.router_split}: a divisor of hidden_size/32={kc} leaving "
                              f"at least {WARPS} chunks per block")


def ksplit(tiles: int, kc: int, target: Target) -> int:
    """Smallest split of the router's K that gives every multiprocessor a block."""
    best = 1
    for s in range(1, kc + 1):
        if kc % s or kc // s < WARPS:
            continue
        best = s
        if tiles * s >= target.sm_count:
            break
    return best


@dataclass(frozen=True)
class Layer:
    """The spec's numbers and choices that the kernel families are made from."""

    spec: Spec
    h: int
    e: int
    z: int  # zero (identity) experts
    k: int
    i: int
    si: int  # shared expert width (0: none)
    gated: bool  # the shared expert has a sigmoid gate
    nmax: int
    rows_pad: int  # router rows (scored experts + gate row) padded to 16
    ksplit: int
    fmt_e: str  # the weights' formats as stored
    fmt_s: str
    kf_e: str  # the kernels' formats: the stored one, or fp8_block_a8 with FP8 activations
    kf_s: str
    woi: bool  # the routing weight scales the expert input (Llama-4)
    bias: bool  # expert biases
    hashed: bool
    x_router: str  # what the router reads: x, or its RMSNorm
    x_expert: str  # what the experts (and zero experts) read
    act_tag: str
    route_tag: str
    ep_size: int = 1
    ep_rank: int = 0
    ep_lo: int = 0  # this rank's experts: [ep_lo, ep_lo + e_local)
    e_local: int = 0
    tune: Tuning = Tuning()

    @property
    def a8_routed(self) -> bool:
        """The routed experts' GEMMs take FP8 activations (codes and per-token scales)."""
        return self.kf_e == "fp8_block_a8"

    @property
    def a8_shared(self) -> bool:
        """The shared expert's GEMMs take FP8 activations."""
        return self.kf_s == "fp8_block_a8" and self.si > 0

    @property
    def t8_routed(self) -> bool:
        """The routed experts' weights are FP8 per-tensor (their GEMVs read pre-quantized rows)."""
        return self.kf_e == "fp8_tensor"

    @property
    def t8_shared(self) -> bool:
        return self.kf_s == "fp8_tensor" and self.si > 0

    @property
    def a8(self) -> bool:
        return self.a8_routed or self.a8_shared

    @property
    def ep_tag(self) -> str:
        return f"_ep{self.ep_size}r{self.ep_rank}" if self.ep_size > 1 else ""

    @classmethod
    def of(cls, spec: Spec, target: Target, tune: Tuning | None = None) -> Layer:
        h, e, k, i = spec.hidden_size, spec.experts.count, spec.experts.top_k, spec.experts.intermediate_size
        sh, z, r = spec.shared_expert, spec.experts.zero_experts, spec.routing
        ep, rank = spec.parallel.ep_size, spec.parallel.ep_rank
        lo, n_local = partition(e, ep, rank)
        if rank > 0:  # the shared expert (and its gate) is added once, on rank 0
            sh = None
        gated = bool(sh and sh.gate == "sigmoid")
        rows_pad = math.ceil((e + z + int(gated)) / 16) * 16
        return cls(
            spec=spec, h=h, e=e, z=z, k=k, i=i, si=sh.intermediate_size if sh else 0, gated=gated,
            nmax=spec.max_tokens, rows_pad=rows_pad,
            ksplit=(tune.router_split if tune and tune.router_split else ksplit(rows_pad // 16, h // 32, target)),
            fmt_e=spec.experts.format.value, fmt_s=sh.format.value if sh else "bf16",
            kf_e=_kernel_format(spec.experts.format.value, spec), kf_s=_kernel_format(sh.format.value if sh else "bf16", spec),
            woi=r.weight_on_input, bias=spec.experts.bias, hashed=r.hash_vocab_size is not None,
            x_router="ws.xr" if spec.router.norm else "x", x_expert="ws.xe" if spec.pre_expert_norm else "x",
            act_tag=_act_tag(spec), route_tag=_route_tag(spec, e, z, k, gated) + (f"_ep{ep}r{rank}" if ep > 1 else ""),
            ep_size=ep, ep_rank=rank, ep_lo=lo, e_local=n_local, tune=tune or Tuning(),
        )


def _kernel_format(fmt: str, spec: Spec) -> str:
    """FP8 block weights with FP8 activations (experts.fp8_activations: every FP8 block GEMM of the
    layer, routed and shared, quantizes its input as DeepSeek's Linear layers do) read their B rows
    as e4m3 codes with per-token scales."""
    return "fp8_block_a8" if fmt == "fp8_block" and spec.experts.fp8_activations else fmt


def partition(experts: int, ep_size: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share of the experts: the first experts % ep_size ranks hold one more."""
    base, extra = divmod(experts, ep_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def _act_tag(spec: Spec) -> str:
    act, sh = spec.experts.activation, spec.shared_expert
    tag = act.kind.value + (f"_a{act.alpha:g}" if act.alpha else "") + (f"_l{act.limit:g}" if act.limit else "")
    return tag.replace(".", "p") + ("_sclamp" if sh and sh.clamp else "") + ("_bias" if spec.experts.bias else "")


def _route_tag(spec: Spec, e: int, z: int, k: int, gated: bool) -> str:
    r = spec.routing
    scale = f"{r.routed_scaling_factor:g}".replace(".", "p")
    return (f"e{e}{f'z{z}' if z else ''}_k{k}_{r.score.value}_{'logits' if r.select is Select.logits else 'scores'}"
            f"{'_winput' if r.weight_on_input else ''}{f'_hash{r.hash_vocab_size}' if r.hash_vocab_size else ''}"
            f"{'_cbias' if r.correction_bias else ''}{'_rbias' if spec.router.bias else ''}"
            f"{f'_g{r.n_group}of{r.topk_group}' if r.n_group > 1 else ''}"
            f"{'_renorm' if r.renormalize else ''}{'_x' + scale if r.routed_scaling_factor != 1.0 else ''}"
            f"{'_sgate' if gated else ''}_{spec.router.logits_dtype}")


# ---- the rule structs of the layer file ----
def route_rule(c: Layer) -> Rule:
    r, spec = c.spec.routing, c.spec
    return (
        ("int", "SCORE", SCORE_MACRO[r.score.value]),
        ("int", "E_REAL", str(c.e)),
        ("int", "ZERO", str(c.z)),
        ("bool", "WEIGHT_ON_INPUT", _b(c.woi)),
        ("bool", "HASH", _b(c.hashed)),
        ("int", "VOCAB", str(r.hash_vocab_size or 0)),
        ("bool", "EP", _b(c.ep_size > 1)),
        ("int", "EP_LO", str(c.ep_lo)),
        ("int", "EP_N", str(c.e_local)),
        ("bool", "EP_RANK0", _b(c.ep_rank == 0)),
        ("float", "SPARSEMIXER_EPS", f"{r.sparsemixer_eps!r}f"),
        ("bool", "SELECT_LOGITS", _b(r.select is Select.logits)),
        ("bool", "CORR_BIAS", _b(r.correction_bias)),
        ("bool", "ROUTER_BIAS", _b(spec.router.bias)),
        ("int", "NGROUP", str(r.n_group)),
        ("int", "TOPK_GROUP", str(r.topk_group)),
        ("bool", "RENORM", _b(r.renormalize)),
        ("float", "SCALE", f"{r.routed_scaling_factor!r}f"),
        ("bool", "LOGITS_BF16", _b(spec.router.logits_dtype == "bf16")),
    )


def act_rule(c: Layer) -> Rule:
    act, sh = c.spec.experts.activation, c.spec.shared_expert
    return (
        ("int", "KIND", ACT_MACRO[act.kind.value]),
        ("float", "LIMIT", f"{float(act.limit or 0.0)!r}f"),
        ("float", "ALPHA", f"{float(act.alpha or 1.0)!r}f"),
        ("bool", "SHARED_LIMIT", _b(bool(sh and sh.clamp))),
        ("bool", "EXPERT_BIAS", _b(c.bias)),
    )


def norm_rule(c: Layer) -> Rule:
    rnorm, enorm = c.spec.router.norm, c.spec.pre_expert_norm
    return (("float", "ROUTER_EPS", f"{float(rnorm.eps if rnorm else 1e-6)!r}f"),
            ("float", "EXPERT_EPS", f"{float(enorm.eps if enorm else 1e-6)!r}f"))


# ---- kernels ----
def _kernel(name: str, family: str, threads: int, targs: tuple[str, ...], base: Extra, extra: Extra, body: str,
            comment: str) -> Kernel:
    from .plan import Kernel

    sig = base + extra
    return Kernel(name, family, threads, targs, tuple(x[0] for x in sig), tuple(x[1] for x in sig),
                  tuple(x[2] for x in sig), body, comment)


def norm_kernel(c: Layer) -> Kernel | None:
    rnorm, enorm = c.spec.router.norm, c.spec.pre_expert_norm
    if not (rnorm or enorm):
        return None
    name = (f"moe_rmsnorm_h{c.h}" + (f"_router_eps{rnorm.eps:g}" if rnorm else "")
            + (f"_expert_eps{enorm.eps:g}" if enorm else "")).replace(".", "p").replace("-", "m") + f"_{c.spec.arch}"
    base = (("const bf16_t* __restrict__ x", "x", "x"), ("const float* __restrict__ w_router", "w_router", "w.rnorm_w"),
            ("const float* __restrict__ w_expert", "w_expert", "w.enorm_w"), ("bf16_t* __restrict__ xr", "xr", "ws.xr"),
            ("bf16_t* __restrict__ xe", "xe", "ws.xe"), ("int n", "n", "n"))
    return _kernel(name, "norm", NORM_THREADS, (str(c.h), str(NORM_THREADS), _b(bool(rnorm)), _b(bool(enorm))),
                   base, (), "rmsnorm_body", "RMSNorm of x before the router and/or the experts")


def _route_sig(c: Layer, routes: bool = True) -> Extra:
    """The route's parameters; routes=False: a router kernel that does not route takes only the
    ones every layer has (its code, and so its name, is then the same for every routing rule)."""
    sig: Extra = (
        ("const float* __restrict__ corr_bias", "corr_bias", "w.corr_bias"),
        ("const float* __restrict__ router_bias", "router_bias", "w.router_bias"),
        ("int* __restrict__ topk_ids", "topk_ids", "ws.topk_ids"), ("float* __restrict__ topk_w", "topk_w", "ws.topk_w"),
        ("int* __restrict__ pair_pos", "pair_pos", "ws.pair_pos"), ("float* __restrict__ gate_s", "gate_s", "ws.gate_s"),
        ("int* __restrict__ num_slots", "num_slots", "ws.num_slots"),
        ("int* __restrict__ slot_expert", "slot_expert", "ws.slot_expert"),
        ("int* __restrict__ slot_begin", "slot_begin", "ws.slot_begin"),
        ("int* __restrict__ slot_token", "slot_token", "ws.slot_token"), ("int n", "n", "n"),
    )
    if not routes:
        return sig
    if c.woi or c.hashed:
        sig += (("float* __restrict__ slot_w", "slot_w", "ws.slot_w"),)
    if c.hashed:  # the call's token ids and the static table [vocab, k] pick the experts
        sig += (("const int* __restrict__ token_ids", "token_ids", "token_ids"),
                ("const int* __restrict__ tid2eid", "tid2eid", "w.tid2eid"))
    return sig


def route_kernel(c: Layer, desc: str, group_max: int = 0) -> Kernel:
    """The route kernel. It follows a router that leaves the partial sums added in partial 0: it
    reads one (KSPLIT 1). Its last block groups the tokens by expert up to group_max tokens (the
    largest decode bucket; 0: every N); past it (prefill buckets) it writes the choices and
    weights only: one kernel for both."""
    name = f"moe_route_{c.route_tag}_n{c.nmax}{f'_g{group_max}' if group_max else ''}_{c.spec.arch}"
    threads = ROUTE_THREADS
    targs = (str(c.e), str(c.rows_pad), str(c.k), "1", str(c.nmax), _b(c.gated), str(threads), str(group_max))
    base = (("const float* __restrict__ logits", "logits", "ws.logits"), ("int* route_cnt", "route_cnt", "ws.route_cnt"),
            ("int* route_done", "route_done", "ws.route_done"))
    return _kernel(name, "route", threads, targs, base, _route_sig(c), "route_kernel_body",
                   f"route: {desc}; one token per warp, the last block groups the tokens by expert"
                   + (f" up to N = {group_max}" if group_max else ""))


def router_tiles(c: Layer) -> int:
    """16-row tiles a prefill router block takes (router_logits_body's RT): as many as divide the
    router's tiles, up to ROUTER_TILES, so that each token's activation row is read from L2 once per
    that many tiles rather than once per tile."""
    tiles = c.rows_pad // 16
    return next(r for r in range(min(ROUTER_TILES, tiles), 0, -1) if tiles % r == 0)


def router_kernel(c: Layer, nt: int, fused: bool, ksplit: int = 0, tiles: int = 1) -> Kernel:
    """The router logits; ksplit 0: the layer's K split (prefill buckets pass 1: their grid's y
    splits the tokens instead, and a block takes `tiles` row tiles, router_tiles)."""
    ks = ksplit or c.ksplit
    name = (f"moe_router_r{c.rows_pad}_h{c.h}_ks{ks}_nt{nt}" + (f"_rt{tiles}" if tiles > 1 else "") + f"_n{c.nmax}"
            + (f"_route_{c.route_tag}" if fused else "") + f"_bf16_{c.spec.arch}")
    # Without the route, the route's parameters are fixed placeholders: the name carries all that shapes the code.
    rt = (str(c.e), str(c.k), _b(c.gated)) if fused else ("1", "1", "false")
    targs = (*map(str, (c.h // 32, nt, WARPS, depth(tiles, nt), ks, c.rows_pad, c.nmax)), _b(fused), *rt,
             *((str(tiles),) if tiles > 1 else ()))
    base = (("const uint4* __restrict__ wr", "wr", "w.router"), ("const bf16_t* __restrict__ x", "x", c.x_router),
            ("float* logits", "logits", "ws.logits"), ("int* route_done", "route_done", "ws.route_done"))
    return _kernel(name, "router", WARPS * 32, targs, base, _route_sig(c, fused), "router_logits_body",
                   f"router: {c.rows_pad} rows x {c.h}, K split {ks} ways, {8 * nt} tokens per pass"
                   + (f", {tiles} row tiles a block" if tiles > 1 else "")
                   + ("; the last block routes" if fused else "; each tile's last block adds its partials"
                      if ks > 1 else ""))


def _gate_up_rings(c: Layer, nt: int, nts: int) -> tuple[int, int, int]:
    """A gate/up block's warps and its full rings' depths (the routed experts', the shared expert's)."""
    w = _warps(c, 2, max(nt, nts))
    return w, depth(2, nt, c.kf_e, w), _depth_s(c, 2, nt, nts, w)


def gate_up_wave(c: Layer, target: Target, nt: int, nts: int, grid: int) -> int:
    """Blocks a multiprocessor for a gate/up grid of `grid` blocks with its ring one chunk shallower,
    where that makes the grid one wave of resident blocks and the full ring does not; 0 otherwise
    (the full ring). A block's static shared memory is its ring (the routed or the shared expert's,
    whichever is larger), and a multiprocessor holds smem_per_block + 1 KB, 1 KB of it a block's;
    the kernel then asks __launch_bounds__ for that many blocks, so that registers do not cap them
    below it. With a second, partial wave the grid's last blocks stream while most of the
    multiprocessors idle: on the H200 (2026-12-01, N = 2, one process, 8 interleaved rounds, the
    same bits) Qwen3-30B-A3B's 768 gate/up blocks (5 a multiprocessor with 4 chunks a warp, 7 with
    3) took the layer from 50.02 to 48.69 us, Qwen3-Next-80B-A3B's 672 from 48.44 to 47.62 us; at
    N = 4 (1536 and 1312 blocks: fewer waves, not one) the shallower ring measured 76.54 -> 76.67
    and 73.55 -> 74.54 us, and N = 8 and 16 within 0.4%."""
    w, d, ds = _gate_up_rings(c, nt, nts)
    if min(d, ds) <= 2:
        return 0

    def per_sm(dr: int, dsr: int) -> int:
        ring = w * max(dr * chunk_bytes(2, nt, c.kf_e), dsr * chunk_bytes(2, nts, c.kf_s) if c.si else 0)
        return min(2048 // (32 * w), (target.smem_per_block + 1024) // (ring + 1024))

    full, shallow = per_sm(d, ds), per_sm(d - 1, ds - 1)
    return shallow if grid > full * target.sm_count and grid <= shallow * target.sm_count else 0


def gate_up_kernel(c: Layer, nt: int, nts: int, wave: int = 0) -> Kernel:
    """The gate/up GEMV kernel; with `wave` (gate_up_wave) its rings one chunk shallower, that many
    blocks a multiprocessor asked of the compiler."""
    name = (f"moe_gate_up_e{c.e}_h{c.h}_i{c.i}_nt{nt}_{c.kf_e}" + (f"_si{c.si}_nts{nts}_{c.kf_s}" if c.si else "")
            + f"_{c.act_tag}{'_winput' if c.woi else ''}{c.ep_tag}")
    w, d, ds = _gate_up_rings(c, nt, nts)
    if wave:
        d, ds = d - 1, ds - 1
    name += f"{_w(w)}" + (f"_b{wave}" if wave else "") + f"_{c.spec.arch}"
    targs = (*map(str, (c.h // 32, nt, nts, w, d, ds,
                        c.i // 16, c.si // 16, c.i, max(c.si, 1))), FMT_MACRO[c.kf_e], FMT_MACRO[c.kf_s], str(c.e_local))
    base = (("const uint4* __restrict__ w13", "w13", "w.w13"), ("const uint4* __restrict__ ws13", "ws13", "w.ws13"),
            ("const float* __restrict__ s13", "s13", "w.s13"), ("const float* __restrict__ ss13", "ss13", "w.ss13"),
            ("const bf16_t* __restrict__ x", "x", c.x_expert),
            ("const int* __restrict__ num_slots", "num_slots", "ws.num_slots"),
            ("const int* __restrict__ slot_expert", "slot_expert", "ws.slot_expert"),
            ("const int* __restrict__ slot_begin", "slot_begin", "ws.slot_begin"),
            ("const int* __restrict__ slot_token", "slot_token", "ws.slot_token"),
            ("bf16_t* __restrict__ act", "act", "ws.act"), ("bf16_t* __restrict__ act_s", "act_s", "ws.act_s"),
            ("int n", "n", "n"))
    a8, t8 = c.a8, c.t8_routed or c.t8_shared
    extra: Extra = (("const float* __restrict__ slot_w", "slot_w", "ws.slot_w"),) if c.woi or c.bias or a8 or t8 else ()
    if c.bias or a8 or t8:  # (positional: the quantized inputs' pointers come after these, null where unused)
        extra += (("const float* __restrict__ b_gate", "b_gate", "w.b_gate"),
                  ("const float* __restrict__ b_up", "b_up", "w.b_up"))
    if a8 or t8:  # x quantized per token and 128 channels (moe_act_quant), and its scales (t8: null placeholders)
        extra += (("const bf16_t* __restrict__ xq", "xq", "ws.xq"), ("const float* __restrict__ sx", "sx", "ws.sx"))
    if t8:  # FP8 per-tensor: x's rows quantized (moe_tensor_quant); down's scales, which quantize the activations
        extra += (("const bf16_t* __restrict__ xt", "xt", "ws.xt"), ("const bf16_t* __restrict__ xt_s", "xt_s", "ws.xt_s"),
                  ("const float* __restrict__ s2", "s2", "w.s2"), ("const float* __restrict__ ss2", "ss2", "w.ss2"))
    kernel = _kernel(name, "gate_up", w * 32, targs, base, extra, "gate_up_body",
                     f"gate/up + {c.act_tag}: expert slots x {c.i // 16} tiles"
                     + (f" + shared {c.si // 16} tiles" if c.si else "")
                     + (f"; rings of {d} chunks a warp, {wave} blocks a multiprocessor" if wave else ""))
    return dataclasses.replace(kernel, min_blocks=wave) if wave else kernel


def _depth_s(c: Layer, mats: int, nt: int, nts: int, warps: int) -> int:
    """The shared expert's ring depth in a gate/up or down block: its own format's chunks and token
    groups (each ring fills the block's static shared memory on its own: a block runs one of them,
    so the routed experts' ring of fewer token groups holds more chunks in flight). A layer without
    a shared expert reserves no shared memory for that ring (the kernels size theirs by the routed
    experts' alone); its depth is then the routed one, which leaves the code as it was."""
    return depth(mats, nts, c.kf_s, warps) if c.si else depth(mats, nt, c.kf_e, warps)


def down_kernel(c: Layer, nt: int, nts: int) -> Kernel:
    name = (f"moe_down_e{c.e}_h{c.h}_i{c.i}_k{c.k}_nt{nt}_{c.kf_e}" + (f"_si{c.si}_nts{nts}_{c.kf_s}" if c.si else "")
            + ("_sgate" if c.gated else "") + ("_bias" if c.bias else "") + (f"_z{c.z}" if c.z else "")
            + ("_winput" if c.woi else "") + c.ep_tag)
    w, t = _warps(c, c.tune.down_tiles, max(nt, nts)), c.tune.down_tiles
    name += _w(w) + (f"_t{t}" if t != DOWN_TILES else "") + ("_pf" if c.tune.prefetch else "") + f"_{c.spec.arch}"
    targs = (*map(str, (c.i // 32, c.si // 32, nt, nts, w, depth(t, nt, c.kf_e, w),
                        _depth_s(c, t, nt, nts, w), t, c.h // (16 * t), c.h, c.k)), _b(c.gated), FMT_MACRO[c.kf_e], FMT_MACRO[c.kf_s],
             str(c.e_local), _b(c.tune.prefetch))
    base = (("const uint4* __restrict__ w2", "w2", "w.w2"), ("const uint4* __restrict__ ws2", "ws2", "w.ws2"),
            ("const float* __restrict__ s2", "s2", "w.s2"), ("const float* __restrict__ ss2", "ss2", "w.ss2"),
            ("const bf16_t* __restrict__ act", "act", "ws.act"), ("const bf16_t* __restrict__ act_s", "act_s", "ws.act_s"),
            ("const int* __restrict__ num_slots", "num_slots", "ws.num_slots"),
            ("const int* __restrict__ slot_expert", "slot_expert", "ws.slot_expert"),
            ("const int* __restrict__ slot_begin", "slot_begin", "ws.slot_begin"),
            ("float* y", "y", "ws.y"), ("float* ys", "ys", "ws.ys"),
            ("const float* __restrict__ topk_w", "topk_w", "ws.topk_w"),
            ("const int* __restrict__ pair_pos", "pair_pos", "ws.pair_pos"),
            ("const float* __restrict__ gate_s", "gate_s", "ws.gate_s"), ("int* tile_done", "tile_done", "ws.tile_done"),
            ("bf16_t* __restrict__ out", "out", "out"), ("int n", "n", "n"))
    a8 = c.a8
    extra: Extra = (("const float* __restrict__ b_down", "b_down", "w.b_down"),) if c.bias or c.z or a8 else ()
    if c.z or a8:
        extra += (("const bf16_t* __restrict__ x", "x", c.x_expert),
                  ("const int* __restrict__ topk_ids", "topk_ids", "ws.topk_ids"))
    if a8:  # the activations quantized per token and 128 channels (moe_act_quant), and their scales
        extra += (("const bf16_t* __restrict__ actq", "actq", "ws.actq"), ("const float* __restrict__ sa", "sa", "ws.sa"),
                  ("const bf16_t* __restrict__ actq_s", "actq_s", "ws.actq_s"),
                  ("const float* __restrict__ sas", "sas", "ws.sas"))
    return _kernel(name, "down", w * 32, targs, base, extra, "down_body",
                   f"down: expert slots x {c.h // 16} tiles of {c.i}" + (f" + shared ({c.si})" if c.si else "")
                   + "; the last block of each tile writes the weighted sum")


# ---- small batches: one kernel per expert (gate/up, activation, down over one K chunk) ----
FUSED_MAX_TOKENS = 8  # one token group of 8 per expert: the fused kernel's B fragment
COMBINE_THREADS = 256  # 32 columns x 8 warps, each adding some of the choices' chunks
FUSED_PART_SHARE = 8  # the partial sums of a fused call stay within this share of L2


def part_bytes(c: Layer, tokens: int) -> int:
    """fp32 partial sums of the fused kernel for `tokens`: one row of H per down K chunk and
    (token, choice) pair, and per chunk and token for the shared expert."""
    return 4 * c.h * tokens * (c.k * (c.i // 32) + c.si // 32)


def fused_depth(c: Layer, warps: int = WARPS) -> int:
    """Ring depth of the fused kernel: its slot holds a gate/up chunk (4 fragments and x) or a down
    row group (2 fragments per tile); the reduction and the activations take the rest."""
    slot = 512 * max(5, 2 * c.tune.down_tiles)
    return min(MAX_DEPTH, (STATIC_SMEM - warps * 1024 - 256) // (warps * slot))


def fused_max(c: Layer, target: Target, buckets: tuple[int, ...]) -> int:
    """The largest bucket the fused kernel computes (0: none; a tuning asks for it). Its partial sums must fit a share
    of L2 (they are written and read back once); it takes BF16 weights and at most 8 tokens per
    expert; a spec that asks for one reduction order for every N (batch_invariant) keeps the
    two-kernel path, whose order does not depend on the bucket."""
    if c.tune.fused == 0 or c.spec.batch_invariant or c.kf_e != "bf16" or (c.si and c.kf_s != "bf16"):
        return 0
    if fused_depth(c) < 2:
        return 0
    cap = min(c.tune.fused, FUSED_MAX_TOKENS)
    fits = [b for b in buckets if b <= cap and part_bytes(c, b) <= target.l2_bytes // FUSED_PART_SHARE]
    return max(fits, default=0)


def fused_kernel(c: Layer, nf: int) -> Kernel:
    t = c.tune.down_tiles
    name = (f"moe_expert_e{c.e}_h{c.h}_i{c.i}" + (f"_si{c.si}" if c.si else "") + f"_nf{nf}_k{c.k}_bf16_{c.act_tag}"
            + ("_winput" if c.woi else "") + c.ep_tag + (f"_t{t}" if t != DOWN_TILES else "") + f"_{c.spec.arch}")
    targs = tuple(map(str, (c.h // 32, c.i // 32, max(c.si // 32, 1), WARPS, fused_depth(c), c.i // 16, c.si // 16,
                            c.i, t, c.h // (16 * t), c.h, nf, c.k)))
    base = (("const uint4* __restrict__ w13", "w13", "w.w13"), ("const uint4* __restrict__ ws13", "ws13", "w.ws13"),
            ("const uint4* __restrict__ w2", "w2", "w.w2"), ("const uint4* __restrict__ ws2", "ws2", "w.ws2"),
            ("const bf16_t* __restrict__ x", "x", c.x_expert),
            ("const int* __restrict__ num_slots", "num_slots", "ws.num_slots"),
            ("const int* __restrict__ slot_expert", "slot_expert", "ws.slot_expert"),
            ("const int* __restrict__ slot_begin", "slot_begin", "ws.slot_begin"),
            ("const int* __restrict__ slot_token", "slot_token", "ws.slot_token"),
            ("float* __restrict__ part", "part", "ws.part"), ("float* __restrict__ part_s", "part_s", "ws.part_s"),
            ("int n", "n", "n"))
    extra: Extra = (("const float* __restrict__ slot_w", "slot_w", "ws.slot_w"),) if c.woi or c.bias else ()
    if c.bias:
        extra += (("const float* __restrict__ b_gate", "b_gate", "w.b_gate"),
                  ("const float* __restrict__ b_up", "b_up", "w.b_up"))
    kernel = _kernel(name, "expert", WARPS * 32, targs, base, extra, "expert_fused_body",
                     f"expert (up to {nf} tokens): gate/up + {c.act_tag} of tile pairs, exchanged in a cluster, "
                     f"then down over their K chunk" + (f"; shared expert {c.si // 16} tiles" if c.si else ""))
    return dataclasses.replace(kernel, cluster=2)


def combine_kernel(c: Layer, nf: int) -> Kernel:
    name = (f"moe_combine_h{c.h}_i{c.i}_k{c.k}" + (f"_si{c.si}" if c.si else "") + ("_sgate" if c.gated else "")
            + ("_bias" if c.bias else "") + (f"_z{c.z}" if c.z else "") + ("_winput" if c.woi else "") + c.ep_tag
            + f"_nf{nf}_{c.spec.arch}")
    targs = (*map(str, (c.i // 32, max(c.si // 32, 1), c.h, c.k, nf)), _b(bool(c.si)), _b(c.gated))
    base = (("const float* __restrict__ part", "part", "ws.part"), ("const float* __restrict__ part_s", "part_s", "ws.part_s"),
            ("const float* __restrict__ topk_w", "topk_w", "ws.topk_w"),
            ("const int* __restrict__ pair_pos", "pair_pos", "ws.pair_pos"),
            ("const float* __restrict__ gate_s", "gate_s", "ws.gate_s"), ("bf16_t* __restrict__ out", "out", "out"),
            ("int n", "n", "n"))
    extra: Extra = (("const float* __restrict__ b_down", "b_down", "w.b_down"),) if c.bias or c.z else ()
    if c.z or c.bias:
        extra += (("const bf16_t* __restrict__ x", "x", c.x_expert),
                  ("const int* __restrict__ topk_ids", "topk_ids", "ws.topk_ids"))
    return _kernel(name, "combine", COMBINE_THREADS, targs, base, extra, "combine_body",
                   "combine: the fused kernel's chunk partials added in order, weighted per choice")


QUANT_THREADS = 256


def quant_blocks(warps: int) -> int:
    """Blocks of an FP8 activation quantization (decode or prefill): a warp per row and 128
    channels, grid-strided over at most 4 blocks a multiprocessor."""
    return max(1, min(-(-warps // (QUANT_THREADS // 32)), 4 * 132))


def act_quant_kernel(c: Layer, what: str) -> Kernel | None:
    """FP8 activations (MODELS.md format a): the rows of x (what="x": before gate/up) or of the
    routed and shared activations (what="act": before down) as e4m3 codes per token and 128
    channels, with their fp32 scales. None where no GEMM of that input takes FP8 activations."""
    if what == "x":
        if not c.a8:
            return None
        name = f"moe_act_quant_x_h{c.h}_{c.spec.arch}"
        return _kernel(name, "act_quant", QUANT_THREADS, (str(c.h), str(QUANT_THREADS)),
                       (("const bf16_t* __restrict__ src", "src", c.x_expert), ("bf16_t* __restrict__ q", "q", "ws.xq"),
                        ("float* __restrict__ s", "s", "ws.sx"), ("int n", "n", "n")), (), "act_quant_body",
                       "x as e4m3 codes per token and 128 channels, for the FP8 GEMMs")
    routed, shared = c.a8_routed, c.a8_shared
    if not (routed or shared):
        return None
    name = "moe_act_quant" + (f"_i{c.i}k{c.k}" if routed else "") + (f"_s{c.si}" if shared else "") + f"_{c.spec.arch}"
    # rows: the routed activations' n * top_k (every row a pair of the call may use), the shared n
    targs = tuple(map(str, (c.i if routed else 128, c.k if routed else 0, c.si if shared else 128, int(shared),
                            QUANT_THREADS)))
    sig = (("const bf16_t* __restrict__ act", "act", "ws.act"), ("bf16_t* __restrict__ actq", "actq", "ws.actq"),
           ("float* __restrict__ sa", "sa", "ws.sa"), ("const bf16_t* __restrict__ act_s", "act_s", "ws.act_s"),
           ("bf16_t* __restrict__ actq_s", "actq_s", "ws.actq_s"), ("float* __restrict__ sas", "sas", "ws.sas"),
           ("int n", "n", "n"))
    return _kernel(name, "act_quant", QUANT_THREADS, targs, sig, (), "act_quant2_body",
                   "the activations as e4m3 codes per token and 128 channels, for the FP8 down GEMMs")


def tensor_quant_kernel(c: Layer) -> Kernel | None:
    """FP8 per-tensor weights (ModelOpt FP8): the rows gate/up's GEMV reads, quantized once by the
    static input scales (the routed pairs' rows in slot order, by their experts'; the tokens' rows by
    the shared expert's), where the routed experts or the shared expert take that format. None
    elsewhere."""
    routed, shared = c.t8_routed, c.t8_shared
    if not (routed or shared):
        return None
    name = f"moe_tensor_quant_h{c.h}" + ("_r" if routed else "") + ("_s" if shared else "") + f"_{c.spec.arch}"
    sig = (("const bf16_t* __restrict__ x", "x", c.x_expert), ("const float* __restrict__ s13", "s13", "w.s13"),
           ("const float* __restrict__ ss13", "ss13", "w.ss13"),
           ("const int* __restrict__ num_slots", "num_slots", "ws.num_slots"),
           ("const int* __restrict__ slot_expert", "slot_expert", "ws.slot_expert"),
           ("const int* __restrict__ slot_begin", "slot_begin", "ws.slot_begin"),
           ("const int* __restrict__ slot_token", "slot_token", "ws.slot_token"),
           ("bf16_t* __restrict__ xt", "xt", "ws.xt"), ("bf16_t* __restrict__ xt_s", "xt_s", "ws.xt_s"), ("int n", "n", "n"))
    return _kernel(name, "tensor_quant", QUANT_THREADS, (str(c.h), _b(routed), _b(shared)), sig, (), "tensor_quant_body",
                   "x quantized by the FP8 per-tensor input scales, a row per routed pair / token")


def tensor_quant_blocks(c: Layer, tokens: int) -> int:
    """Blocks of moe_tensor_quant for `tokens`: a warp per 256 columns of every row it may write."""
    rows = tokens * c.k * int(c.t8_routed) + tokens * int(c.t8_shared)
    return quant_blocks(rows * -(-c.h // 256))


def _warps(c: Layer, mats: int, nt: int) -> int:
    """The tuning's warps per block, halved where the ring of this kernel's token group (the routed
    experts' or the shared expert's format, the larger chunk) would not fit in static shared memory
    (the analytic 4 always fits)."""
    w = c.tune.warps
    chunk = max(chunk_bytes(mats, nt, c.kf_e), chunk_bytes(mats, nt, c.kf_s) if c.si else 0)
    while w > WARPS and STATIC_SMEM // (w * chunk) < 2:
        w //= 2
    return w


def _w(w: int) -> str:
    return f"_w{w}" if w != WARPS else ""


def pack_kernel(arch: str) -> Kernel:
    """The weight packing (moegen.weights.pack_tiles on the device): any matrices per tile, side by
    side or interleaved (arguments, not template values: one kernel to compile, run once at load)."""
    base = (("const bf16_t* __restrict__ src0", "src0", "src0"), ("const bf16_t* __restrict__ src1", "src1", "src1"),
            ("uint4* __restrict__ dst", "dst", "dst"), ("int experts", "experts", "experts"),
            ("int rows", "rows", "rows"), ("int rows_pad", "rows_pad", "rows_pad"), ("int k", "k", "k"),
            ("int mats", "mats", "mats"), ("int interleave", "interleave", "interleave"))
    return _kernel(f"moe_pack_tiles_{arch}", "pack", PACK_THREADS, (), base, (), "pack_body",
                   "weight packing into the tile layout, matrices side by side or interleaved (runs once, at load)")
