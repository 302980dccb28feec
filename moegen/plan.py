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
  tiles cover the multiprocessors; the route kernel adds the partial sums in a fixed order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .spec import Select, Spec

WARPS = 4  # warps per GEMV block: K is split over them, partial sums added in warp order
A_FRAGMENTS = {"bf16": 2, "fp8_block": 1}  # 16-byte A fragments per lane, matrix and 32-wide chunk
FMT_MACRO = {"bf16": "MOE_W_BF16", "fp8_block": "MOE_W_FP8_BLOCK"}
SCORE_MACRO = {"softmax": "MOE_SCORE_SOFTMAX", "sigmoid": "MOE_SCORE_SIGMOID", "sqrt_softplus": "MOE_SCORE_SQRT_SOFTPLUS",
               "sparsemixer": "MOE_SCORE_SPARSEMIXER"}
ACT_MACRO = {"silu_gated": "MOE_ACT_SILU", "gelu_gated": "MOE_ACT_GELU", "swiglu_clamped": "MOE_ACT_SWIGLU_CLAMPED"}
STATIC_SMEM = 48 * 1024  # the cp.async ring of a GEMV block stays within static shared memory
MAX_DEPTH = 8  # chunks per warp in the ring (DEPTH-1 in flight while one is consumed)
PACK_THREADS = 256
NORM_THREADS = 256
ROUTE_THREADS = 1024  # the route kernel: one warp per token
DOWN_TILES = 2  # 16-row tiles per down block: fewer, longer blocks (one wave at N=1)
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


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int | str, int]  # "n" = the call's token count
    block: int
    pdl: bool  # programmatic dependent launch on the previous kernel


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
    format: str = "bf16"  # "fp8_block": e4m3 codes, 16 bytes per lane and chunk, fp32 128x128 block scales
    scale_name: str = ""  # the device buffer of its scales [MATS sources][E][R/128][K/128] (FP8)


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

    def kernel(self, name: str) -> Kernel:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)


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


def _depth(mats: int, nt: int, fmt: str = "bf16") -> int:
    """Ring depth: as many 32-wide chunks in flight per warp as static shared memory holds."""
    af = A_FRAGMENTS[fmt]
    chunk_bytes = (mats * af + nt) * 512  # per warp: A fragments of MATS matrices, B of NT token groups
    return max(2, min(MAX_DEPTH, STATIC_SMEM // (WARPS * chunk_bytes)))


def _ksplit(tiles: int, kc: int, target: Target) -> int:
    """Smallest split of the router's K that gives every multiprocessor a block."""
    best = 1
    for s in range(1, kc + 1):
        if kc % s or kc // s < WARPS:
            continue
        best = s
        if tiles * s >= target.sm_count:
            break
    return best


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
    fp8 = [spec.experts.format.value == "fp8_block", bool(spec.shared_expert and spec.shared_expert.format.value == "fp8_block")]
    for name, v in checks:
        uses_fp8 = fp8[1] if name.startswith("shared") else (fp8[0] or (fp8[1] and name == "hidden_size"))
        if uses_fp8 and v % 128:
            raise PlanError(f"{name}={v}: FP8 128x128 block weights need a multiple of 128")
    if spec.experts.top_k > 32:
        raise PlanError(f"experts.top_k={spec.experts.top_k}: the route kernel keeps one choice per lane (<= 32)")


def make_plan(spec: Spec, target: Target | None = None) -> Plan:
    target = target or TARGETS[spec.arch]
    _check_shapes(spec)
    h, e, k, i = spec.hidden_size, spec.experts.count, spec.experts.top_k, spec.experts.intermediate_size
    sh = spec.shared_expert
    si = sh.intermediate_size if sh else 0
    gated = bool(sh and sh.gate == "sigmoid")
    nmax = spec.max_tokens
    z = spec.experts.zero_experts
    rows_pad = math.ceil((e + z + int(gated)) / 16) * 16
    kc_h, kc_i, kc_s = h // 32, i // 32, si // 32
    ksplit = _ksplit(rows_pad // 16, kc_h, target)
    slots_max = min(e, nmax * k)
    suffix = f"bf16_{spec.arch}"  # the router is bf16
    fmt_e = spec.experts.format.value
    fmt_s = sh.format.value if sh else "bf16"

    kernels: dict[str, Kernel] = {}
    rnorm, enorm = spec.router.norm, spec.pre_expert_norm
    x_router = "ws.xr" if rnorm else "x"  # what the router reads: x, or its RMSNorm
    x_expert = "ws.xe" if enorm else "x"  # what the experts (and zero experts) read
    norm_rule = (("float", "ROUTER_EPS", f"{float(rnorm.eps if rnorm else 1e-6)!r}f"),
                 ("float", "EXPERT_EPS", f"{float(enorm.eps if enorm else 1e-6)!r}f"))
    norm_name = ""
    if rnorm or enorm:
        norm_name = (f"moe_rmsnorm_h{h}" + (f"_router_eps{rnorm.eps:g}" if rnorm else "")
                     + (f"_expert_eps{enorm.eps:g}" if enorm else "")).replace(".", "p").replace("-", "m")
        norm_name += f"_{spec.arch}"
        kernels[norm_name] = Kernel(
            norm_name, "norm", NORM_THREADS, targs=(str(h), str(NORM_THREADS), _b(bool(rnorm)), _b(bool(enorm))),
            params=("const bf16_t* __restrict__ x", "const float* __restrict__ w_router",
                    "const float* __restrict__ w_expert", "bf16_t* __restrict__ xr", "bf16_t* __restrict__ xe",
                    "int n"),
            args=("x", "w_router", "w_expert", "xr", "xe", "n"),
            arg_keys=("x", "w.rnorm_w", "w.enorm_w", "ws.xr", "ws.xe", "n"),
            body="rmsnorm_body", comment="RMSNorm of x before the router and/or the experts",
        )
    act = spec.experts.activation
    shared_limit = bool(sh and sh.clamp)
    act_tag = act.kind.value + (f"_a{act.alpha:g}" if act.alpha else "") + (f"_l{act.limit:g}" if act.limit else "")
    act_tag = act_tag.replace(".", "p") + ("_sclamp" if shared_limit else "") + ("_bias" if spec.experts.bias else "")
    act_rule = (
        ("int", "KIND", ACT_MACRO[act.kind.value]),
        ("float", "LIMIT", f"{float(act.limit or 0.0)!r}f"),
        ("float", "ALPHA", f"{float(act.alpha or 1.0)!r}f"),
        ("bool", "SHARED_LIMIT", _b(shared_limit)),
        ("bool", "EXPERT_BIAS", _b(spec.experts.bias)),
    )

    r = spec.routing
    select_logits = r.select is Select.logits
    scale = r.routed_scaling_factor
    woi, bias = r.weight_on_input, spec.experts.bias
    route_tag = (f"e{e}{f'z{z}' if z else ''}_k{k}_{r.score.value}_{'logits' if select_logits else 'scores'}"
                 f"{'_winput' if woi else ''}{'_hash' if r.hash_vocab_size else ''}"
                 f"{'_cbias' if r.correction_bias else ''}{'_rbias' if spec.router.bias else ''}"
                 f"{f'_g{r.n_group}of{r.topk_group}' if r.n_group > 1 else ''}"
                 f"{'_renorm' if r.renormalize else ''}{'_x' + f'{scale:g}'.replace('.', 'p') if scale != 1.0 else ''}"
                 f"{'_sgate' if gated else ''}_{spec.router.logits_dtype}")
    route_params = ("const float* __restrict__ corr_bias", "const float* __restrict__ router_bias",
                    "int* __restrict__ topk_ids", "float* __restrict__ topk_w", "int* __restrict__ pair_pos",
                    "float* __restrict__ gate_s", "int* __restrict__ num_slots", "int* __restrict__ slot_expert",
                    "int* __restrict__ slot_begin", "int* __restrict__ slot_token", "int n")
    route_args = ("corr_bias", "router_bias", "topk_ids", "topk_w", "pair_pos", "gate_s", "num_slots",
                  "slot_expert", "slot_begin", "slot_token", "n")
    route_keys = ("w.corr_bias", "w.router_bias", "ws.topk_ids", "ws.topk_w", "ws.pair_pos", "ws.gate_s",
                  "ws.num_slots", "ws.slot_expert", "ws.slot_begin", "ws.slot_token", "n")
    # Parameters that only some layers have go last (the bodies default them to nullptr), so a
    # layer without the feature compiles to the code it had before the feature existed.
    hashed = r.hash_vocab_size is not None
    if woi or hashed:
        route_params += ("float* __restrict__ slot_w",)
        route_args += ("slot_w",)
        route_keys += ("ws.slot_w",)
    if hashed:  # the call's token ids and the static table [vocab, k] pick the experts
        route_params += ("const int* __restrict__ token_ids", "const int* __restrict__ tid2eid")
        route_args += ("token_ids", "tid2eid")
        route_keys += ("token_ids", "w.tid2eid")
    gu_extra = (("const float* __restrict__ slot_w", "slot_w", "ws.slot_w"),) if woi or bias else ()
    if bias:
        gu_extra += (("const float* __restrict__ b_gate", "b_gate", "w.b_gate"),
                     ("const float* __restrict__ b_up", "b_up", "w.b_up"))
    down_extra = (("const float* __restrict__ b_down", "b_down", "w.b_down"),) if bias or z else ()
    if z:
        down_extra += (("const bf16_t* __restrict__ x", "x", x_expert), ("const int* __restrict__ topk_ids", "topk_ids",
                                                                     "ws.topk_ids"))

    def router(nt: int, fused: bool) -> str:
        name = (f"moe_router_r{rows_pad}_h{h}_ks{ksplit}_nt{nt}_n{nmax}" + (f"_route_{route_tag}" if fused else "")
                + f"_{suffix}")
        # Without the route, the route's parameters are fixed placeholders: the name carries all that shapes the code.
        rt = (str(e), str(k), _b(gated)) if fused else ("1", "1", "false")
        kernels.setdefault(name, Kernel(
            name, "router", WARPS * 32,
            targs=(*map(str, (kc_h, nt, WARPS, _depth(1, nt), ksplit, rows_pad, nmax)), _b(fused), *rt),
            params=("const uint4* __restrict__ wr", "const bf16_t* __restrict__ x", "float* logits",
                    "int* route_done", *route_params),
            args=("wr", "x", "logits", "route_done", *route_args),
            arg_keys=("w.router", x_router, "ws.logits", "ws.route_done", *route_keys),
            body="router_logits_body",
            comment=f"router: {rows_pad} rows x {h}, K split {ksplit} ways, {8 * nt} tokens per pass"
            + ("; the last block routes" if fused else ""),
        ))
        return name

    route_name = f"moe_route_{route_tag}_ks{ksplit}_n{nmax}_{spec.arch}"
    kernels[route_name] = Kernel(
        route_name, "route", ROUTE_THREADS,
        targs=(str(e), str(rows_pad), str(k), str(ksplit), str(nmax), _b(gated), str(ROUTE_THREADS)),
        params=("const float* __restrict__ logits", *route_params),
        args=("logits", *route_args),
        arg_keys=("ws.logits", *route_keys),
        body="route_kernel_body", comment=f"route: {_routing_desc(spec)}; tokens grouped by expert",
    )
    route_rule = (
        ("int", "SCORE", SCORE_MACRO[r.score.value]),
        ("int", "E_REAL", str(e)),
        ("int", "ZERO", str(z)),
        ("bool", "WEIGHT_ON_INPUT", _b(woi)),
        ("bool", "HASH", _b(hashed)),
        ("float", "SPARSEMIXER_EPS", f"{r.sparsemixer_eps!r}f"),
        ("bool", "SELECT_LOGITS", _b(select_logits)),
        ("bool", "CORR_BIAS", _b(r.correction_bias)),
        ("bool", "ROUTER_BIAS", _b(spec.router.bias)),
        ("int", "NGROUP", str(r.n_group)),
        ("int", "TOPK_GROUP", str(r.topk_group)),
        ("bool", "RENORM", _b(r.renormalize)),
        ("float", "SCALE", f"{scale!r}f"),
        ("bool", "LOGITS_BF16", _b(spec.router.logits_dtype == "bf16")),
    )

    def gate_up(nt: int, nts: int) -> str:
        name = (f"moe_gate_up_e{e}_h{h}_i{i}_nt{nt}_{fmt_e}" + (f"_si{si}_nts{nts}_{fmt_s}" if si else "")
                + f"_{act_tag}{'_winput' if woi else ''}_{spec.arch}")
        kernels.setdefault(name, Kernel(
            name, "gate_up", WARPS * 32,
            targs=(*map(str, (kc_h, nt, nts, WARPS, _depth(2, max(nt, nts), fmt_e), i // 16, si // 16, i, max(si, 1))),
                   FMT_MACRO[fmt_e], FMT_MACRO[fmt_s], str(e)),
            params=("const uint4* __restrict__ w13", "const uint4* __restrict__ ws13", "const float* __restrict__ s13",
                    "const float* __restrict__ ss13", "const bf16_t* __restrict__ x",
                    "const int* __restrict__ num_slots", "const int* __restrict__ slot_expert",
                    "const int* __restrict__ slot_begin", "const int* __restrict__ slot_token",
                    "bf16_t* __restrict__ act", "bf16_t* __restrict__ act_s", "int n", *(x[0] for x in gu_extra)),
            args=("w13", "ws13", "s13", "ss13", "x", "num_slots", "slot_expert", "slot_begin", "slot_token", "act",
                  "act_s", "n", *(x[1] for x in gu_extra)),
            arg_keys=("w.w13", "w.ws13", "w.s13", "w.ss13", x_expert, "ws.num_slots", "ws.slot_expert", "ws.slot_begin",
                      "ws.slot_token", "ws.act", "ws.act_s", "n", *(x[2] for x in gu_extra)),
            body="gate_up_body",
            comment=f"gate/up + {act_tag}: expert slots x {i // 16} tiles" + (f" + shared {si // 16} tiles" if si else ""),
        ))
        return name

    def down(nt: int, nts: int) -> str:
        name = (f"moe_down_e{e}_h{h}_i{i}_k{k}_nt{nt}_{fmt_e}" + (f"_si{si}_nts{nts}_{fmt_s}" if si else "")
                + ("_sgate" if gated else "") + ("_bias" if bias else "") + (f"_z{z}" if z else "")
                + ("_winput" if woi else "") + f"_{spec.arch}")
        depth = _depth(DOWN_TILES, max(nt, nts), fmt_e)
        kernels.setdefault(name, Kernel(
            name, "down", WARPS * 32,
            targs=(*map(str, (kc_i, kc_s, nt, nts, WARPS, depth, DOWN_TILES, h // (16 * DOWN_TILES), h, k)), _b(gated),
                   FMT_MACRO[fmt_e], FMT_MACRO[fmt_s]),
            params=("const uint4* __restrict__ w2", "const uint4* __restrict__ ws2", "const float* __restrict__ s2",
                    "const float* __restrict__ ss2", "const bf16_t* __restrict__ act",
                    "const bf16_t* __restrict__ act_s", "const int* __restrict__ num_slots",
                    "const int* __restrict__ slot_expert", "const int* __restrict__ slot_begin",
                    "float* y", "float* ys", "const float* __restrict__ topk_w",
                    "const int* __restrict__ pair_pos", "const float* __restrict__ gate_s", "int* tile_done",
                    "bf16_t* __restrict__ out", "int n", *(x[0] for x in down_extra)),
            args=("w2", "ws2", "s2", "ss2", "act", "act_s", "num_slots", "slot_expert", "slot_begin", "y", "ys",
                  "topk_w", "pair_pos", "gate_s", "tile_done", "out", "n", *(x[1] for x in down_extra)),
            arg_keys=("w.w2", "w.ws2", "w.s2", "w.ss2", "ws.act", "ws.act_s", "ws.num_slots", "ws.slot_expert",
                      "ws.slot_begin", "ws.y", "ws.ys", "ws.topk_w", "ws.pair_pos", "ws.gate_s", "ws.tile_done", "out",
                      "n", *(x[2] for x in down_extra)),
            body="down_body",
            comment=f"down: expert slots x {h // 16} tiles of {i}" + (f" + shared ({si})" if si else "")
            + "; the last block of each tile writes the weighted sum",
        ))
        return name

    for mats, inter in ((1, False), (2, False), (DOWN_TILES, True)):
        name = f"moe_pack_tiles_m{mats}{'_interleaved' if inter else ''}_{spec.arch}"
        kernels[name] = Kernel(
            name, "pack", PACK_THREADS, targs=(str(mats), _b(inter)),
            params=("const bf16_t* __restrict__ src0", "const bf16_t* __restrict__ src1", "uint4* __restrict__ dst",
                    "int experts", "int rows", "int rows_pad", "int k"),
            args=("src0", "src1", "dst", "experts", "rows", "rows_pad", "k"),
            arg_keys=("src0", "src1", "dst", "experts", "rows", "rows_pad", "k"),
            body="pack_body", comment=f"weight packing, {mats} {'consecutive tiles' if inter else 'matrices'} per tile"
            " (runs once, at load)",
        )

    buckets = []
    for nb in _buckets(spec):
        slots = min(e, nb * k)
        nt_dense = _nt(nb)
        # Token groups per pass for the routed experts: twice the mean tokens per expert. With a
        # shared expert (all tokens) one NT serves both, which halves the kernels to compile.
        nt_routed = nt_dense if si else _nt(min(nb, 2 * math.ceil(nb * k / e)))
        fused = nb <= FUSED_ROUTE_MAX
        groups = h // (16 * DOWN_TILES)
        launches = (
            *((Launch(norm_name, ("n", 1), NORM_THREADS, pdl=True),) if norm_name else ()),
            Launch(router(nt_dense, fused), ((rows_pad // 16) * ksplit, 1), WARPS * 32, pdl=True),
            *(() if fused else (Launch(route_name, (1, 1), ROUTE_THREADS, pdl=True),)),
            Launch(gate_up(nt_routed, nt_dense), (slots * (i // 16) + si // 16, 1), WARPS * 32, pdl=True),
            Launch(down(nt_routed, nt_dense), (slots * groups + (groups if si else 0), 1), WARPS * 32,
                   pdl=True),
        )
        buckets.append(Bucket(nb, launches))

    workspace = (
        Buffer("logits", "float32", (ksplit, nmax, rows_pad)),
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
        Buffer("tile_done", "int32", (h // (16 * DOWN_TILES),)),
        Buffer("route_done", "int32", (1,)),
        Buffer("xr", "uint16", (nmax, h) if rnorm else (1,)),  # RMSNorm(x) for the router
        Buffer("xe", "uint16", (nmax, h) if enorm else (1,)),  # RMSNorm(x) for the experts
        Buffer("slot_w", "float32", (nmax * k if woi or hashed else 1,)),  # routing weight per expert row (Llama-4)  # zero between calls: the last block resets it
        Buffer("out", "uint16", (nmax, h)),
    )
    raw = []
    if r.correction_bias:
        raw.append(Buffer("corr_bias", "float32", (e + z,)))
    if spec.router.bias:
        raw.append(Buffer("router_bias", "float32", (e + z,)))
    if rnorm:
        raw.append(Buffer("rnorm_w", "float32", (h,)))
    if enorm:
        raw.append(Buffer("enorm_w", "float32", (h,)))
    if r.hash_vocab_size is not None:
        raw.append(Buffer("tid2eid", "int32", (r.hash_vocab_size, k)))
    if spec.experts.bias:
        raw += [Buffer("b_gate", "float32", (e, i)), Buffer("b_up", "float32", (e, i)),
                Buffer("b_down", "float32", (e, h))]
    router_sources = ("gate.weight",) + (("shared_expert_gate.weight",) if gated else ())
    weights = [
        PackedWeight("router", router_sources, 1, False, 0, e + z + int(gated), rows_pad, h),
        PackedWeight("w13", ("experts.gate_proj", "experts.up_proj"), 2, False, e, i, i, h, fmt_e, "s13"),
        PackedWeight("w2", ("experts.down_proj",), DOWN_TILES, True, e, h, h, i, fmt_e, "s2"),
    ]
    if sh:
        weights += [
            PackedWeight("ws13", ("shared_expert.gate_proj", "shared_expert.up_proj"), 2, False, 0, si, si, h, fmt_s,
                         "ss13"),
            PackedWeight("ws2", ("shared_expert.down_proj",), DOWN_TILES, True, 0, h, h, si, fmt_s, "ss2"),
        ]
    asserts = (
        Assert(f"{h} % 32 == 0", "hidden size: whole 32-wide K chunks and down row groups"),
        Assert(f"{i} % 32 == 0", "expert width: whole 16-row tiles and 32-wide K chunks"),
        Assert(f"{si} % 32 == 0", "shared expert width: whole tiles and chunks"),
        Assert(f"{rows_pad} % 16 == 0 && {rows_pad} >= {e + z + int(gated)}", "router rows padded to whole tiles"),
        Assert(f"({h} / 32) % {ksplit} == 0 && ({h} / 32) / {ksplit} >= {WARPS}", "router K split into whole chunks"),
        Assert(f"{k} <= 32", "route: one choice per lane"),
    )
    return Plan(
        arch=spec.arch, hidden=h, experts=e, scored=e + z, top_k=k, inter=i, shared_inter=si, shared_gate=gated,
        rows_pad=rows_pad, ksplit=ksplit, max_tokens=nmax, slots_max=slots_max,
        routing_desc=_routing_desc(spec), expert_bytes=3 * h * i * 2,
        kernels=tuple(kernels.values()), buckets=tuple(buckets), workspace=workspace,
        weights=tuple(weights), asserts=asserts, route_rule=route_rule, act_rule=act_rule, norm_rule=norm_rule, raw=tuple(raw),
    )


def _b(v: bool) -> str:
    return "true" if v else "false"


def plan_from_dict(d: dict) -> Plan:
    """Rebuild a Plan from dataclasses.asdict output (what the generated launcher carries)."""
    d = dict(d)
    d["kernels"] = tuple(Kernel(**{k: tuple(v) if isinstance(v, list) else v for k, v in x.items()})
                         for x in d["kernels"])
    d["buckets"] = tuple(Bucket(b["max_tokens"], tuple(Launch(x["kernel"], tuple(x["grid"]), x["block"], x["pdl"])
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
    return Plan(**d)
