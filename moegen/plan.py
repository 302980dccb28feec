"""Plan: how to compute a Spec on a GPU. Pure Python, no CUDA.

Every decision the kernels need (tiles, splits, token groups, grids per token-count bucket,
workspace, weight packing) is made here, from the spec and the target's properties, and written
down as plain data. Templates only substitute these values; the launcher only replays them.

The analytic model (decode is memory-bound):
- a weight byte is read once per call, so the work is split into 16-row weight tiles, one per
  block; there must be several blocks per multiprocessor to keep enough loads in flight;
- tokens that share an expert share its tile: a block applies the tile to up to 8*NT tokens per
  pass, NT sized from the expected tokens per expert in the bucket (more passes re-read the tile
  from L2, not from memory);
- the router matrix is small (E x H), so its K is split over KSPLIT blocks per tile until the
  tiles cover the multiprocessors, and past the fused buckets its grid's y splits the tokens into
  32-token passes; each (tile, pass)'s last K part adds its partial sums in a fixed order;
- a "last block" that sums others' results must not become the kernel's tail: the router's last
  K part sums one 32-token pass, and the down blocks run in row-group order, so that each row
  group's last block sums it (float4 rows, two tokens in flight a thread) while later groups
  stream, not all of them at the grid's end;
- gate/up then down, each over all of K. A tuning may instead fuse them for the smallest buckets
  (families.fused_max: each pair of gate/up tiles computes down's partial sums over its K chunk,
  a combine kernel adds them in order; the partials must stay within an eighth of L2). Measured,
  that saved no dependent launch (the combine is one), so the analytic plan does not fuse.
- one token (the N = 1 bucket) pays the dependent-launch chain (router -> gate/up -> down) about as
  much as its bytes: where a block's share of the down weights (16 rows of every chosen expert)
  fits in shared memory beside the reduction space (single.single_layout), the bucket is one
  cooperative launch of one block per multiprocessor, the down weights streaming into shared
  memory while gate/up runs, with two grid barriers (templates/single.cu.j2);
- past the point where the routed experts get more tokens each than one GEMV pass takes (8*MAX_NT
  on average), the GEMV tiles would be read again per pass: those buckets run the routed experts
  as grouped GEMMs on the tensor cores instead (moegen.prefill_plan), on the same packed weights.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import astuple, dataclass, field, replace

from . import families as F
from . import prefill_plan as P
from . import single as S
from .families import NORM_THREADS, WARPS
from .spec import Select, Spec

FUSED_ROUTE_MAX = 8  # up to this many tokens the router's last block routes them (4 warps, 2 tokens each)
MAX_NT = 4  # token groups of 8 per pass: 4 keeps the accumulators in registers


class PlanError(ValueError):
    """The spec is valid but this target cannot run it; the message says what and why."""


@dataclass(frozen=True)
class Target:
    arch: str
    sm_count: int
    smem_per_block: int
    l2_bytes: int


# Properties of the chips each arch is planned for (H100/H200 SXM: 132 multiprocessors).
TARGETS = {"sm_90a": Target(arch="sm_90a", sm_count=132, smem_per_block=227 * 1024, l2_bytes=50 << 20)}


@dataclass(frozen=True)
class Kernel:
    name: str
    family: str
    threads: int
    targs: tuple[str, ...]  # template arguments of the family's body, in order
    params: tuple[str, ...]  # the extern "C" signature
    args: tuple[str, ...]  # what the wrapper passes to the body
    arg_keys: tuple[str, ...]  # how the launcher fills each parameter (buffer name, "x", "n", ...)
    body: str
    comment: str
    cluster: int = 1  # blocks per thread-block cluster (__cluster_dims__ of the kernel)
    part: int = 0  # the program (of Plan.parts) the kernel is compiled in: the source's MOE_PART guards
    min_blocks: int = 0  # blocks a multiprocessor must fit (__launch_bounds__'s second value; 0: none asked)
    # The wrapper's part in programmatic dependent launch (a no-op where launched without it): ""
    # none (the body waits itself, or the kernel is launched without it); "first": wait for the
    # kernel before, let the next one launch, then the body; "last": let the next one launch, the
    # body, then wait (the body reads nothing the kernels of this call wrote before it, and writes
    # nothing they read: its completion still implies theirs)
    dep: str = ""


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int | str, int]  # "n" = the call's token count
    block: int
    pdl: bool  # programmatic dependent launch on the previous kernel
    smem: int = 0  # dynamic shared memory, bytes
    # a cooperative launch: every block resident at once (grid-wide barriers), or the launch fails;
    # its grid is ("sms", 1): one block per multiprocessor of the device it runs on
    coop: bool = False


@dataclass(frozen=True)
class Bucket:
    max_tokens: int
    launches: tuple[Launch, ...]


@dataclass(frozen=True)
class Buffer:
    name: str
    dtype: str  # numpy dtype name; bf16 is stored as uint16 bits
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PackedWeight:
    """A device tensor in the kernels' tile layout, made by moegen.weights.pack_tiles."""

    name: str
    sources: tuple[str, ...]  # Hugging Face tensor names: MATS matrices per tile, or rows concatenated
    mats: int
    interleaved: bool  # the MATS matrices are consecutive 16-row tiles of the one source
    experts: int  # 0: not per expert
    rows: int  # rows of each source matrix (per expert)
    rows_padded: int
    cols: int
    # "fp8_block": e4m3 codes, 16 bytes per lane and chunk, fp32 128x128 block scales;
    # "fp8_tensor": the same codes, an fp32 weight scale and static input scale per matrix;
    # "mxfp4" / "nvfp4": e2m1 codes, 8 bytes per lane and chunk (two matrices per 16-byte fragment),
    # E8M0 row scales per 32 / e4m3 row scales per 16 and an fp32 scale_2 per matrix
    format: str = "bf16"
    # the device buffer of its scales: FP8 [MATS sources][E][R/128][K/128] fp32; FP8 per-tensor
    # [E][sources][weight scale, input scale] fp32;
    # MXFP4 [E][tile][K/32 chunk][MATS][16 rows] E8M0 bytes; NVFP4 per tile [K/32 chunk][MATS][2][16 rows]
    # e4m3 bytes then the MATS fp32 scale_2 (16 bytes)
    scale_name: str = ""
    # FP8 block codes with FP8 activations: wgmma's core-matrix layout (moegen.weights.pack_fp8_core),
    # which the prefill GEMMs read by descriptor and the GEMV kernels through ldmatrix
    core: bool = False


@dataclass(frozen=True)
class TensorMap:
    """A TMA tensor map over a packed weight (workspace: over a workspace buffer), which the runtime
    encodes (cuTensorMapEncodeTiled) once the weight is on the device and stores in the weights'
    buffer "tmaps", 128 bytes each in plan order: `elem`-byte elements (4 or 1), dims innermost
    first, strides in bytes (dims 1..), one box, no swizzle or the 128-byte one."""

    weight: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    elem: int = 4
    swizzle: int = 0
    workspace: bool = False


@dataclass(frozen=True)
class Assert:
    expr: str
    why: str


@dataclass(frozen=True)
class Plan:
    arch: str
    hidden: int
    experts: int
    scored: int  # experts the router scores: routed + zero (identity) experts
    local_experts: int  # the experts whose weights this layer holds (expert parallelism: this rank's)
    expert_offset: int  # the first of them
    ep_size: int  # expert-parallel ranks (1: the layer holds every expert)
    top_k: int
    inter: int
    shared_inter: int
    shared_gate: bool
    rows_pad: int
    ksplit: int
    max_tokens: int
    slots_max: int
    routing_desc: str
    expert_bytes: int
    kernels: tuple[Kernel, ...]
    buckets: tuple[Bucket, ...]
    workspace: tuple[Buffer, ...]
    weights: tuple[PackedWeight, ...]
    asserts: tuple[Assert, ...]
    route_rule: tuple[tuple[str, str, str], ...]  # (C type, name, value) of the layer's RouteRule constants
    act_rule: tuple[tuple[str, str, str], ...]  # the same for its ActRule
    norm_rule: tuple[tuple[str, str, str], ...]  # and its NormRule
    raw: tuple[Buffer, ...]  # small weights copied as fp32 as they are (router / correction bias)
    kernel_order: tuple[str, ...] = field(default=("router (+ route)", "route", "gate_up", "down + combine"))
    prefill_from: int = 0  # the first bucket (its max_tokens) that runs the prefill kernels; 0: none
    # their GEMMs' (bm, bn, stages, ws, down_stages, fp8, a8, down_pair, bulk_a, fp4, fp8_tensor, stage_y): prefill.GemmTiles
    prefill_tiles: tuple[int, int, int, bool, int, bool, bool, bool, bool, str, bool, bool] | tuple[()] = ()
    tensor_maps: tuple[TensorMap, ...] = ()  # what the kernels copy weights with (the weights' buffer "tmaps")

    def kernel(self, name: str) -> Kernel:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)

    @property
    def parts(self) -> int:
        """The programs the layer's source is compiled as, at once (moegen.nvrtc.compile_parts)."""
        return 1 + max((k.part for k in self.kernels), default=0)


# The layer's kernels are compiled as COMPILE_PARTS programs at once, one thread each: on a 2-core
# machine Qwen3-30B-A3B's 23 kernels took 2.25 s as one program with --split-compile=2 (its front
# end and the uneven split leave a core idle), 1.55 s as two. The kernels are dealt out by the
# seconds one of each family takes to compile alone (measured there, 2026-11-30, on Qwen3-30B-A3B,
# Qwen3-Next-80B-A3B, Mixtral-8x7B and DeepSeek-V3-FP8; the prefill GEMMs with their producer
# warpgroup), longest first, each to the lightest part so far; a family not listed weighs 0.1.
# FP8 block weights change three families' costs ("+fp8"; Qwen3-30B-A3B-FP8, the same day), FP8
# activations the prefill GEMMs' ("+fp8a8", Qwen3-30B-A3B-FP8-a8); the down GEMMs as the analytic
# plan has them, on row-group pairs (two accumulator sets a warp: 0.47 s against 0.26, FP8 0.31
# against 0.19; remeasured the same way, 2026-11-30).
# A gate/up or down kernel with the shared expert's tiles took 1.3-1.8 times its family's cost
# (Qwen1.5-MoE-A2.7B, DeepSeek-V2-Lite, Qwen2-57B-A14B, Qwen3-Next-80B-A3B, DeepSeek-V3-FP8-a8, each
# kernel alone, 2026-11-30), and the shared expert's prefill GEMMs as much as the routed ones; both
# were dealt at the default 0.1 or their family's before.
# The one-token kernel with down by columns: 0.49-0.63 s in a program of its own (Qwen3-30B-A3B,
# OLMoE, DeepSeek-V2-Lite, Qwen1.5-MoE-A2.7B, GLM-4.5-Air, Qwen3-Next-80B-A3B, Mixtral-8x7B;
# 2026-12-01), about 0.45 s past a program's own start; 0.31 before, which left the part holding it
# the longer (the two parts of five specs compiled one after another: the longer 8.98 s in all at
# 0.31, 8.74 s at 0.45).
# A kernel that routes (the route kernel, a router whose last block routes, the one-token kernel) over
# more than ROUTE_BOUND experts (zero experts counted; not hash-routed) takes about ROUTE_BOUND_COST
# more: route_one's bound over 32 lanes of up to 16 experts each, the groups' maxima and the ranks
# above the bound, unrolled per lane's experts (each such kernel alone, 2026-12-01, against its
# family's cost: the route kernel 0.07-0.21 s more, the router with the route 0.04-0.19, the
# one-token kernel 0.00-0.23; Qwen3-Next-80B-A3B, Kimi-K2, DeepSeek-V3 and -V4-Flash/-Pro, GLM-4.5,
# Qwen3-Coder-480B-A35B, LongCat-Flash), which had left DeepSeek-V4-Flash's parts at 1.77 and 1.10 s.
# The two-token kernel ("single+x2": its name's "x2") compiles in about 0.73 of the one-token kernel's
# time, and the down GEMM with its Y tile staged ("+sy", GemmTiles.stage_y) in about 0.57 of the
# gate/up GEMM's (Qwen3-30B-A3B, each kernel alone, 2026-12-01: 0.40-0.41 against 0.53-0.59 s, 0.25-0.28
# against 0.42-0.53 s); dealt at the common 0.45 and 0.47 they had left its part 0 0.2-0.3 s the longer.
# The one- and two-token kernels are dealt together, at 0.55 and 0.40 (Qwen3-30B-A3B's part holding
# them, at 0.45 and 0.33, took 2.55 s against the other's 2.14, medians of 4 each alone, 2026-12-01;
# the two in different parts took 2.97 s against 2.73 for both parts at once, median of 5: the
# program holding both instantiates their templates once). Each part alone, medians of 3, the
# dealing before -> this one: Qwen3-30B-A3B 2.45 / 2.85 -> 2.61 / 2.66 s, Mixtral-8x7B 1.97 / 2.19
# -> 2.11 / 2.13, Qwen3-Next-80B-A3B 3.94 / 3.27 -> 3.67 / 3.67, OLMoE 1.92 / 2.13 -> 2.01 / 2.15.
COMPILE_PARTS = 2
SHARED_COST = 1.45
ROUTE_BOUND = 128
ROUTE_BOUND_COST = 0.12
COMPILE_COST = {"prefill_gemm_gate_up": 0.50, "single": 0.55, "expert": 0.30, "prefill_gemm_down": 0.47,
                "router+route": 0.23, "router": 0.11, "down": 0.17, "route": 0.14, "gate_up": 0.12, "combine": 0.06,
                "pack": 0.05, "prefill_scan": 0.045, "prefill_combine": 0.02, "prefill_place": 0.02,
                "prefill_count": 0.01, "prefill_permute": 0.01, "prefill_quant": 0.02,
                "single+fp8": 0.44, "prefill_gemm_gate_up+fp8": 0.31, "prefill_gemm_down+fp8": 0.31,
                "prefill_gemm_gate_up+fp8a8": 0.34, "prefill_gemm_down+fp8a8": 0.34,
                "single+x2": 0.40, "prefill_gemm_down+sy": 0.28}


def compile_cost(k: Kernel) -> float:
    """COMPILE_COST of a kernel: its family's, a router whose last block routes (its name carries the
    route) as "router+route", a kernel on FP8 block weights (its name says so: "fp8", or "fp8a8" with
    FP8 activations) as "<family>+fp8" or "<family>+fp8a8" where that is listed; the shared expert's
    prefill GEMMs as the routed ones; gate/up and down with a shared expert's tiles beside the
    routed ones (their names carry "si<width>") SHARED_COST times their family's; a kernel that routes
    over more than ROUTE_BOUND experts, unless by hash, ROUTE_BOUND_COST more."""
    fused = k.family == "router" and "_route_" in k.name
    family = k.family.removesuffix("_shared")
    tokens = k.name.split("_")
    fmt = next((f for f in ("fp8a8", "fp8", "x2", "sy") if f in tokens and f"{family}+{f}" in COMPILE_COST), "")
    cost = COMPILE_COST.get(family + (f"+{fmt}" if fmt else "+route" if fused else ""), 0.1)
    shared = any(t.startswith("si") and t[2:].isdigit() for t in tokens)
    if family in ("gate_up", "down") and shared:
        cost *= SHARED_COST
    routed = re.search(r"_e(\d+)(?:z(\d+))?_k\d+_", k.name) if family in ("route", "single") or fused else None
    if routed and int(routed[1]) + int(routed[2] or 0) > ROUTE_BOUND and not any(t.startswith("hash") for t in tokens):
        cost += ROUTE_BOUND_COST
    return cost


def _deal(kernels: tuple[Kernel, ...]) -> tuple[Kernel, ...]:
    """The kernels with their parts (COMPILE_PARTS, fewer for fewer kernels), in their order. The
    one- and two-token kernels are dealt as one, to one part: most of their code is the same
    templates, instantiated once in a program that holds both."""
    parts = min(COMPILE_PARTS, len(kernels))
    load = [0.0] * parts
    part: dict[str, int] = {}
    units: dict[str, list[Kernel]] = {}
    for k in kernels:
        units.setdefault("single" if k.family == "single" else k.name, []).append(k)
    cost = {u: sum(compile_cost(k) for k in ks) for u, ks in units.items()}
    for u in sorted(units, key=lambda u: (-cost[u], u)):
        p = min(range(parts), key=lambda i: (load[i], i))
        load[p] += cost[u]
        for k in units[u]:
            part[k.name] = p
    return tuple(replace(k, part=part[k.name]) for k in kernels)


def _buckets(spec: Spec) -> tuple[int, ...]:
    if spec.buckets is not None:
        return spec.buckets
    out, b = [], 1
    while b < spec.max_tokens:
        out.append(b)
        b *= 2
    return (*out, spec.max_tokens)


def _nt(tokens: int) -> int:
    """Token groups of 8 per pass for up to `tokens` tokens sharing one weight tile."""
    return max(1, min(MAX_NT, math.ceil(tokens / 8)))


def _routing_desc(spec: Spec) -> str:
    r, e = spec.routing, spec.experts
    logits = f"{spec.router.logits_dtype} logits" + (" with bias" if spec.router.bias else "")
    if r.select is Select.scores:
        s = f"{r.score.value} over {e.count} experts ({logits})"
        if r.correction_bias:
            s += " + correction bias for selection"
        if r.n_group > 1:
            s += f" -> best {r.topk_group} of {r.n_group} groups (sum of each group's top-2)"
        s += f" -> top-{e.top_k}"
    else:
        s = f"top-{e.top_k} of {e.count} raw logits ({logits}) -> {r.score.value} over the {e.top_k}"
    if r.renormalize:
        s += " -> renormalize"
    if r.routed_scaling_factor != 1.0:
        s += f" -> x{r.routed_scaling_factor:g}"
    return s


def _check_shapes(spec: Spec) -> None:
    checks = [("hidden_size", spec.hidden_size), ("experts.intermediate_size", spec.experts.intermediate_size)]
    if spec.shared_expert:
        checks.append(("shared_expert.intermediate_size", spec.shared_expert.intermediate_size))
    for name, v in checks:
        if v % 32:
            raise PlanError(f"{name}={v}: the bf16 kernels need a multiple of 32")
    if spec.hidden_size < 32 * WARPS:
        raise PlanError(f"hidden_size={spec.hidden_size}: the router kernel's {WARPS} warps need at least "
                        f"{32 * WARPS} (one 32-wide chunk each)")
    fp8 = [spec.experts.format.value == "fp8_block", bool(spec.shared_expert and spec.shared_expert.format.value == "fp8_block")]
    for name, v in checks:
        uses_fp8 = fp8[1] if name.startswith("shared") else (fp8[0] or (fp8[1] and name == "hidden_size"))
        if uses_fp8 and v % 128:
            raise PlanError(f"{name}={v}: FP8 128x128 block weights need a multiple of 128")
    ep = spec.parallel.ep_size
    if ep > spec.experts.count:
        raise PlanError(f"parallel.ep_size={ep}: more ranks than the {spec.experts.count} experts to spread")
    if spec.experts.top_k > 32:
        raise PlanError(f"experts.top_k={spec.experts.top_k}: the route kernel keeps one choice per lane (<= 32)")


def make_plan(spec: Spec, target: Target | None = None, tuning: F.Tuning | None = None) -> Plan:
    """The plan of `spec` for `target` (default: the spec's arch), with `tuning`'s revisions of the
    analytic choices (moegen tune) where given."""
    try:
        return _make_plan(spec, target or TARGETS[spec.arch], tuning)
    except F.TuningError as exc:
        raise PlanError(f"{spec.name}: {exc}") from None


def _make_plan(spec: Spec, target: Target, tuning: F.Tuning | None) -> Plan:
    _check_shapes(spec)
    if tuning is not None:
        tuning.check(spec)
    c = F.Layer.of(spec, target, tuning)
    kernels: dict[str, Kernel] = {}

    def add(kernel: Kernel) -> str:
        kernels.setdefault(kernel.name, kernel)
        return kernel.name

    norm = F.norm_kernel(c)
    norm_name = add(norm) if norm else ""
    add(F.pack_kernel(spec.arch))
    sizes = _buckets(spec)
    pf = P.prefill_from(c)
    if (cut := P.prefill_split(c)) and spec.buckets is None and cut not in sizes:
        sizes = tuple(sorted((*sizes, cut)))  # the GEMV path up to the crossover inside pf's bucket
    nf = F.fused_max(c, target, sizes)
    # one route kernel: it groups the tokens by expert up to the largest decode bucket (every N
    # where no bucket reaches the prefill crossover: first_pf, the first prefill bucket, 0)
    first_pf = min((s for s in sizes if pf and s >= pf), default=0)
    route_name = add(F.route_kernel(c, _routing_desc(spec), max((s for s in sizes if s < first_pf), default=1)
                                    if first_pf else 0))
    buckets = tuple(_bucket(c, target, nb, add, norm_name, route_name, nf, pf) for nb in sizes)
    pf = first_pf
    gemv_max = max((s for s in sizes if not pf or s < pf), default=1)  # the GEMV path's largest bucket
    plan = Plan(
        arch=spec.arch, hidden=c.h, experts=c.e, scored=c.e + c.z, top_k=c.k, inter=c.i, shared_inter=c.si,
        shared_gate=c.gated, rows_pad=c.rows_pad, ksplit=c.ksplit, max_tokens=c.nmax,
        slots_max=min(c.e_local, c.nmax * c.k), local_experts=c.e_local, expert_offset=c.ep_lo, ep_size=c.ep_size,
        routing_desc=_routing_desc(spec), expert_bytes=3 * c.h * c.i * 2,
        kernels=_deal(tuple(kernels.values())), buckets=buckets, workspace=_workspace(c, target, nf, pf > 0, gemv_max), prefill_from=pf,
        prefill_tiles=astuple(P.tiles(c)) if pf else (),
        weights=_weights(c), asserts=_asserts(c), route_rule=F.route_rule(c), act_rule=F.act_rule(c),
        tensor_maps=P.a8_tensor_maps(c) if pf else (),
        norm_rule=F.norm_rule(c), raw=_raw(c),
        **({"kernel_order": (f"up to {nf} tokens: router + route", "expert (gate/up + down per K chunk)",
                             "combine; more tokens: router (+ route)", "route", "gate_up", "down + combine")}
           if nf else {"kernel_order": ("router (+ route)", "route",
                                         *(("tensor_quant (FP8 per-tensor: x's rows)",) if any(k.family == "tensor_quant" for k in kernels.values()) else ()),
                                         "gate_up", "down + combine",
                                         *((f"from {pf} tokens: router, permute (FP8 activations: quantize) beside it, route",
                                            "count", "scan", "place", "gate/up GEMM", "down GEMM", "combine") if pf else ()))}),
    )
    if any(kernels[ln.kernel].family == "single" for ln in buckets[0].launches):
        # (the one-token kernel reads its maps at 0 and 1: it takes no FP8 activations, whose prefill
        # GEMMs have theirs there, prefill_plan.a8_tensor_maps)
        assert not plan.tensor_maps, "the one-token kernel beside the FP8-activation GEMMs' tensor maps"
        plan = replace(plan, kernel_order=("one token: single (router, route, gate/up, down + sum)",
                                           f"more tokens: {plan.kernel_order[0]}", *plan.kernel_order[1:]),
                       tensor_maps=S.single_tensor_maps(c, target))
    return plan


def _bucket(c: F.Layer, target: Target, nb: int, add: Callable[[Kernel], str], norm_name: str, route_name: str, nf: int,
            pf: int) -> Bucket:
    """The launches for calls of up to nb tokens: the norm (where the layer has it), the router
    (and the route), then up to nf (fused_max) the fused expert kernel and the combine, from pf
    (prefill_from, 0: never) the prefill kernels, between them gate/up and down."""
    slots = min(c.e_local, nb * c.k)
    nt_dense = _nt(nb)
    fused = nb <= FUSED_ROUTE_MAX  # (fused_max stays within it: the fused buckets route in the router)
    norm = (Launch(norm_name, ("n", 1), NORM_THREADS, pdl=True),) if norm_name else ()
    if nb <= 2 and nb > nf and S.single_layout(c, target, nb):  # one token (two: single_two): one launch
        kernel, smem = S.single_kernel(c, target, nb)
        return Bucket(nb, (*norm, Launch(add(kernel), ("sms", 1), kernel.threads, pdl=True, smem=smem,
                                       coop=c.tune.single_coop)))
    if pf and nb >= pf:  # the router's grid splits the tokens (not K); the route does not group them
        rt = F.router_tiles(c)
        router = F.router_kernel(c, nt_dense, False, ksplit=1, tiles=rt)
        early, rest = P.launches(c, nb, add)  # early: needs no routing, beside the router (prefill_pdl)
        beside = c.tune.prefill_pdl
        return Bucket(nb, (
            *norm,
            Launch(add(router), (c.rows_pad // (16 * rt), -(-nb // (8 * nt_dense))), WARPS * 32, pdl=True),
            *(early if beside else ()),
            Launch(route_name, (-(-nb // (F.ROUTE_THREADS // 32)), 1), F.ROUTE_THREADS, pdl=True),
            *(() if beside else early), *rest))
    head = (
        *norm,
        # past the fused buckets the router takes 32-token passes (one kernel for them all: a pass
        # of 16 tokens costs the same), its grid's y one pass a block
        Launch(add(F.router_kernel(c, nt_dense if fused else MAX_NT, fused)),
               ((c.rows_pad // 16) * c.ksplit, 1 if fused else -(-nb // (8 * MAX_NT))), WARPS * 32, pdl=True),
        *(() if fused else (Launch(route_name, (-(-nb // (F.ROUTE_THREADS // 32)), 1), F.ROUTE_THREADS,
                                   pdl=True),)),
    )
    if nb <= nf:
        fk, ck = F.fused_kernel(c, nf), F.combine_kernel(c, nf)
        return Bucket(nb, (*head, Launch(add(fk), (slots * (c.i // 16) + c.si // 16, 1), fk.threads, pdl=True),
                           Launch(add(ck), ("n", c.h // 32), ck.threads, pdl=True)))
    # Token groups per pass for the routed experts: twice the mean tokens per expert; the shared
    # expert takes every token. (One NT for both, the bucket's, had the routed blocks of layers with
    # a shared expert carry 32-token passes for a few tokens each, and their ring a quarter of the
    # chunks in flight: DeepSeek-V3-FP8 at N = 64 / 256 streamed at 66% / 59% of the roofline on
    # the H200, against 92% at N = 8.)
    nt_routed = min(c.tune.routed_nt, nt_dense) if c.tune.routed_nt else _nt(min(nb, 2 * math.ceil(nb * c.k / c.e)))
    nt_shared = nt_dense if c.si else nt_routed  # without a shared expert its token groups are unused
    groups = c.h // (16 * c.tune.down_tiles)
    gu_grid = slots * (c.i // 16) + c.si // 16
    gu_wave = F.gate_up_wave(c, target, nt_routed, nt_shared, gu_grid)  # a ring shallower where that makes one wave
    launches = (
        *head,
        *((Launch(add(xq), (F.quant_blocks(nb * (c.h // 128)), 1), xq.threads, pdl=True),)
          if (xq := F.act_quant_kernel(c, "x")) else ()),
        *((Launch(add(tq), (F.tensor_quant_blocks(c, nb), 1), tq.threads, pdl=True),)
          if (tq := F.tensor_quant_kernel(c)) else ()),
        Launch(add(gate_up := F.gate_up_kernel(c, nt_routed, nt_shared, gu_wave)), (gu_grid, 1),
               gate_up.threads, pdl=True),
        *((Launch(add(aq), (F.quant_blocks(nb * c.k * (c.i // 128) * c.a8_routed + nb * (c.si // 128) * c.a8_shared), 1), aq.threads, pdl=True),)
          if (aq := F.act_quant_kernel(c, "act")) else ()),
        Launch(add(down := F.down_kernel(c, nt_routed, nt_shared)), (slots * groups + (groups if c.si else 0), 1),
               down.threads, pdl=True),
    )
    return Bucket(nb, launches)


def _workspace(c: F.Layer, target: Target, nf: int = 0, prefill: bool = False, gemv_max: int = 0) -> tuple[Buffer, ...]:
    nmax, k, h, i, si = c.nmax, c.k, c.h, c.i, c.si
    slots_max = min(c.e_local, nmax * k)
    a8, a8e, a8s = c.a8, c.a8_routed, c.a8_shared
    vb = S.single_cols(c, target) if S.single_layout(c, target) else 0  # down by columns' unit groups
    ntok = 2 if nmax >= 2 and S.single_layout(c, target, 2) else 1  # tokens of the largest one-launch bucket
    return (
        Buffer("logits", "float32", (c.ksplit, nmax, c.rows_pad)),
        Buffer("topk_ids", "int32", (nmax, k)),
        Buffer("topk_w", "float32", (nmax, k)),
        Buffer("pair_pos", "int32", (nmax, k)),
        Buffer("gate_s", "float32", (nmax,)),
        Buffer("num_slots", "int32", (4,)),
        Buffer("slot_expert", "int32", (slots_max,)),
        Buffer("slot_begin", "int32", (slots_max + 1,)),
        Buffer("slot_token", "int32", (nmax * k,)),
        Buffer("act", "uint16", (nmax * k, i)),
        Buffer("act_s", "uint16", (nmax, max(si, 1))),
        Buffer("y", "float32", (nmax * k, h)),
        Buffer("ys", "float32", (nmax, h)),
        Buffer("tile_done", "int32", (h // (16 * c.tune.down_tiles),)),  # counters: zero between calls, the last block resets
        # the route's counter, then each router tile's for each y of the router's grid
        Buffer("route_done", "int32", (1 + (c.rows_pad // 16) * -(-nmax // (8 * MAX_NT)),)),
        Buffer("route_cnt", "int32", (c.e,)),  # tokens per expert, summed over the route's blocks (zero between calls)
        Buffer("gbar", "int32", (1,)),  # the one-token kernel's grid barrier (a word whose top bit flips)
        # its tagged words (tuning single_tags): partial logits (value, epoch), activations (bf16,
        # epoch), and the epoch with the count of blocks that have read it
        Buffer("stl", "uint64", (max(c.ksplit, ntok * S.single_ksplit(c)), c.rows_pad)),
        Buffer("stact", "uint32", (k * i + si,)),
        Buffer("sepoch", "uint32", (2,)),
        # down by columns (single.single_cols): each unit group's partial sum of the output (value, epoch)
        Buffer("spart", "uint64", (vb * ntok, h) if vb else (1,)),
        Buffer("xr", "uint16", (nmax, h) if c.spec.router.norm else (1,)),  # RMSNorm(x) for the router
        Buffer("xe", "uint16", (nmax, h) if c.spec.pre_expert_norm else (1,)),  # RMSNorm(x) for the experts
        Buffer("slot_w", "float32", (nmax * k if c.woi or c.hashed else 1,)),  # routing weight per expert row
        Buffer("out", "uint16", (nmax, h)),
        # FP8 activations: x, the routed and the shared activations as e4m3 codes (bf16), with scales
        Buffer("xq", "uint16", (nmax, h) if a8 else (1,)), Buffer("sx", "float32", (nmax, h // 128) if a8 else (1,)),
        Buffer("actq", "uint16", (nmax * k, i) if a8e else (1,)),
        Buffer("sa", "float32", (nmax * k, i // 128) if a8e else (1,)),
        Buffer("actq_s", "uint16", (nmax, si) if a8s else (1,)),
        Buffer("sas", "float32", (nmax, si // 128) if a8s else (1,)),
        # FP8 per-tensor weights: x's rows quantized by the input scales for the GEMV path (its buckets
        # up to gemv_max tokens): a row per routed pair in slot order, a row per token for the shared expert
        Buffer("xt", "uint16", ((gemv_max or nmax) * k, h) if c.t8_routed else (1,)),
        Buffer("xt_s", "uint16", ((gemv_max or nmax), h) if c.t8_shared else (1,)),
        # the fused kernel's partial sums over down's K chunks (buckets up to nf tokens)
        Buffer("part", "float32", (i // 32, nf * k, h) if nf else (1,)),
        Buffer("part_s", "float32", (si // 32, nf, h) if nf and si else (1,)),
        *P.workspace(c, prefill),
    )


def _raw(c: F.Layer) -> tuple[Buffer, ...]:
    """Small weights copied as they are (fp32, or the int32 hash table)."""
    spec, e, z, h, i = c.spec, c.e, c.z, c.h, c.i
    raw = []
    if spec.routing.correction_bias:
        raw.append(Buffer("corr_bias", "float32", (e + z,)))
    if spec.router.bias:
        raw.append(Buffer("router_bias", "float32", (e + z,)))
    if spec.router.norm:
        raw.append(Buffer("rnorm_w", "float32", (h,)))
    if spec.pre_expert_norm:
        raw.append(Buffer("enorm_w", "float32", (h,)))
    if c.hashed:
        raw.append(Buffer("tid2eid", "int32", (spec.routing.hash_vocab_size, c.k)))
    if c.bias:
        el = c.e_local
        raw += [Buffer("b_gate", "float32", (el, i)), Buffer("b_up", "float32", (el, i)),
                Buffer("b_down", "float32", (el, h))]
    return tuple(raw)


def _weights(c: F.Layer) -> tuple[PackedWeight, ...]:
    e, h, i, si = c.e_local, c.h, c.i, c.si
    router_sources = ("gate.weight",) + (("shared_expert_gate.weight",) if c.gated else ())
    weights = [
        PackedWeight("router", router_sources, 1, False, 0, c.e + c.z + int(c.gated), c.rows_pad, h),
        PackedWeight("w13", ("experts.gate_proj", "experts.up_proj"), 2, False, e, i, i, h, c.fmt_e, "s13",
                     c.a8_routed),
        PackedWeight("w2", ("experts.down_proj",), c.tune.down_tiles, True, e, h, h, i, c.fmt_e, "s2", c.a8_routed),
    ]
    if si:
        weights += [
            PackedWeight("ws13", ("shared_expert.gate_proj", "shared_expert.up_proj"), 2, False, 0, si, si, h,
                         c.fmt_s, "ss13", c.a8_shared),
            PackedWeight("ws2", ("shared_expert.down_proj",), c.tune.down_tiles, True, 0, h, h, si, c.fmt_s, "ss2",
                         c.a8_shared),
        ]
    return tuple(weights)


def _asserts(c: F.Layer) -> tuple[Assert, ...]:
    h, i, si, k = c.h, c.i, c.si, c.k
    return (
        Assert(f"{h} % 32 == 0", "hidden size: whole 32-wide K chunks and down row groups"),
        Assert(f"{i} % 32 == 0", "expert width: whole 16-row tiles and 32-wide K chunks"),
        Assert(f"{si} % 32 == 0", "shared expert width: whole tiles and chunks"),
        Assert(f"{c.rows_pad} % 16 == 0 && {c.rows_pad} >= {c.e + c.z + int(c.gated)}",
               "router rows padded to whole tiles"),
        Assert(f"({h} / 32) % {c.ksplit} == 0 && ({h} / 32) / {c.ksplit} >= {WARPS}", "router K split into whole chunks"),
        Assert(f"{k} <= 32", "route: one choice per lane"),
    )


def _b(v: bool) -> str:
    return "true" if v else "false"


def plan_from_dict(d: dict) -> Plan:
    """Rebuild a Plan from dataclasses.asdict output (what the generated launcher carries)."""
    d = dict(d)
    d["kernels"] = tuple(Kernel(**{k: tuple(v) if isinstance(v, list) else v for k, v in x.items()})
                         for x in d["kernels"])
    d["buckets"] = tuple(Bucket(b["max_tokens"], tuple(Launch(x["kernel"], tuple(x["grid"]), x["block"], x["pdl"],
                                                             x.get("smem", 0), x.get("coop", False))
                                                      for x in b["launches"])) for b in d["buckets"])
    d["workspace"] = tuple(Buffer(b["name"], b["dtype"], tuple(b["shape"])) for b in d["workspace"])
    d["weights"] = tuple(PackedWeight(**{k: tuple(v) if isinstance(v, list) else v for k, v in w.items()})
                         for w in d["weights"])
    d["asserts"] = tuple(Assert(**a) for a in d["asserts"])
    d["route_rule"] = tuple(tuple(x) for x in d["route_rule"])
    d["act_rule"] = tuple(tuple(x) for x in d["act_rule"])
    d["norm_rule"] = tuple(tuple(x) for x in d["norm_rule"])
    d["raw"] = tuple(Buffer(b["name"], b["dtype"], tuple(b["shape"])) for b in d["raw"])
    d["kernel_order"] = tuple(d["kernel_order"])
    d["prefill_tiles"] = tuple(d.get("prefill_tiles", ()))
    d["tensor_maps"] = tuple(TensorMap(m["weight"], *(tuple(m[f]) for f in ("dims", "strides", "box")),
                                       m.get("elem", 4), m.get("swizzle", 0), m.get("workspace", False))
                             for m in d.get("tensor_maps", ()))
    return Plan(**d)
