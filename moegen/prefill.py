"""Prefill building blocks: the grouped GEMM on wgmma (templates/grouped_gemm.cu.j2) and the
token permutation it reads.

For large token counts the experts' GEMMs are real matrix products: the tokens of each expert
are grouped (a stable sort by expert: token order inside an expert, so a token's row, and
therefore its result, does not depend on the other tokens), and one block computes BM token rows
times BN weight rows of one expert on the warpgroup tensor cores. This module renders and
compiles that kernel and makes its tile table; it is not yet part of a generated layer (the
plan's buckets stop at the decode path), so a layer's N stays within its spec's max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from .render import env

if TYPE_CHECKING:  # numpy is imported where it is used: a build does not need it
    import numpy as np


PREFILL_STAGES = (3, 4, 5, 6, 7, 8)  # the GEMMs' ring depths (those that fit: moegen.prefill_plan.unsupported)
PREFILL_BN = (128, 160)  # the BF16 GEMMs' token rows a tile (prefill_gemm_w's FINE fragments past 128)


@dataclass(frozen=True)
class GemmTiles:
    """Block shape of the grouped GEMM: BM token rows (64 per warpgroup) x BN weight rows, a
    STAGES-deep shared-memory ring of 64-wide K tiles."""

    bm: int = 128
    bn: int = 128
    stages: int = 4
    # The GEMMs on packed weights with a producer warpgroup (cp.async into the ring, mbarriers)
    # beside the bm / 64 consumer warpgroups, instead of every thread loading and a block barrier
    # per k-tile.
    ws: bool = False
    # The down GEMM's stages (0: as gate/up's). Its block needs half gate/up's registers and ring
    # (4 fragments a warp and k-tile, not 8): with 3 stages two blocks fit a multiprocessor, one's
    # prologue and epilogue under the other's k-loop, which matters where K = I is short.
    down_stages: int = 0
    # FP8 block weights (e4m3 codes, 128 x 128 block scales) with bf16 activations: half the A
    # fragments a stage; each K block's products in their own accumulators before they are scaled
    # into the sums, so two sets of accumulators (with a producer warpgroup only, bn <= 64).
    fp8: bool = False
    # FP8 activations too (with fp8): the tokens' rows as e4m3 codes in A8_ORDER with a scale per
    # token and 128 channels, multiplied on the tensor cores as codes (wgmma e4m3, k-tiles 128 wide,
    # each a K block), the scales in each stage. The operands swapped (prefill_gemm_a8): the tokens
    # are wgmma's M (a 64-row tile a consumer warpgroup, two consecutive tiles a block: bm 128, bn
    # 64; in the large buckets a 128-row tile's halves, bn 128: prefill_plan.a8_halves) and a
    # block's 128 weight rows its N (gate/up: 64 columns of H; down: 128 of Y, with down_pair),
    # both from shared memory, the weights in the core-matrix layout (moegen.weights.pack_fp8_core)
    # by a TMA box a k-tile and expert
    a8: bool = False
    # The down GEMMs on whole row groups of two tiles (down_tiles 2, with the producer warpgroup):
    # each warp holds both tiles' accumulators, as gate/up holds gate's and up's (the same ring).
    down_pair: bool = False
    # The GEMMs with a producer warpgroup (gate/up; down with down_pair): each warp's weight run of
    # a k-tile by one bulk copy (the copy engine) instead of the producers' cp.async.
    bulk_a: bool = False
    # FP4 weights ("mxfp4" or "nvfp4"; with the producer warpgroup, bulk_a and down_pair): e2m1
    # codes and their row scales in each stage (a quarter of BF16's A bytes, and 1 KB of scales),
    # each code times its scale a bf16 A fragment, exactly; the products as BF16's
    fp4: str = ""
    # FP8 per-tensor weights (ModelOpt FP8; with the producer warpgroup): e4m3 codes as FP8 block's,
    # half the A fragments a stage, but one scale a matrix: the products summed as BF16's over all
    # of K, times weight_scale * input_scale at the end; the tokens' rows already quantized by the
    # matrix's static input scale (e4m3 values held in bf16, exactly)
    fp8_tensor: bool = False
    # The down GEMM's Y tile (down_pair) staged in shared memory behind the ring and written by bulk
    # copies, a token row's run of the block's columns each, instead of each thread's 4-byte stores
    # to the token rows: the consumers return to the next block's k-loop once it is staged
    stage_y: bool = False

    def __post_init__(self) -> None:
        if self.bm not in (64, 128, 192, 256):
            raise ValueError(f"bm={self.bm}: 64 token rows per warpgroup, 1 to 4 warpgroups")
        if self.bn % 16 or not 16 <= self.bn <= 256 or (self.bn * 8) % self.threads:
            raise ValueError(f"bn={self.bn}: a multiple of 16 in [16, 256] (wgmma's N), whole chunks per thread")
        if self.stages not in PREFILL_STAGES or self.down_stages not in (0, *PREFILL_STAGES):
            raise ValueError(f"stages={self.stages}, down_stages={self.down_stages}: 3 to 8 (down 0: as stages)")
        if self.a8 and not (self.fp8 and self.ws and self.bm == 128 and self.bn in (64, 128) and self.down_pair):
            raise ValueError(f"a8 with fp8={self.fp8}, ws={self.ws}, bm={self.bm}, bn={self.bn}, down_pair={self.down_pair}: "
                             "FP8 activations need FP8 block weights, the producer warpgroup, two consumer warpgroups "
                             "(bm 128) of a 64-row tile each (bn 64; 128: a tile's two halves) and the down GEMM on "
                             "row-group pairs")
        if self.fp8 and not self.a8 and not (self.ws and self.bn <= 64):
            raise ValueError(f"fp8 with ws={self.ws}, bn={self.bn}: FP8 weights need the producer warpgroup and bn <= 64 "
                             "(a K block's accumulators beside the sums)")
        if self.down_pair and not self.ws:
            raise ValueError("down_pair without the producer warpgroup")
        if self.bulk_a and not self.ws:
            raise ValueError("bulk_a: the GEMMs with the producer warpgroup only")
        if self.fp4 not in ("", "mxfp4", "nvfp4") or (self.fp4 and (self.fp8 or not (self.bulk_a and self.down_pair))):
            raise ValueError(f"fp4={self.fp4!r}: mxfp4 or nvfp4, not with fp8, with bulk_a and down_pair (each warp's "
                             "fragments hold two matrices)")
        if self.stage_y and not self.down_pair:
            raise ValueError("stage_y: the down GEMM on row-group pairs (down_pair) only")
        if self.fp8_tensor and (self.fp8 or self.fp4 or not self.ws):
            raise ValueError("fp8_tensor: FP8 per-tensor weights, not with fp8 or fp4, with the producer warpgroup")

    @property
    def dstages(self) -> int:
        """The down GEMM's ring stages."""
        return self.down_stages or self.stages

    @property
    def threads(self) -> int:
        return self.bm // 64 * 128

    @property
    def packed_threads(self) -> int:
        """Threads of the GEMMs on packed weights: the consumer warpgroups, and the producer one."""
        return self.threads + (128 if self.ws else 0)

    @property
    def packed_rows(self) -> int:
        """Token rows per tile of the GEMMs on packed weights (gate/up, down): the tokens are their
        N, BN wide, and bm sets only their warps. Their tile tables are cut at this size."""
        return self.bn

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the ring, plus 1 KB to align it to the swizzle's 1024 bytes."""
        return self.stages * (self.bm + self.bn) * 64 * 2 + 1024

    @property
    def name(self) -> str:
        return f"moe_grouped_gemm_bm{self.bm}_bn{self.bn}_s{self.stages}_bf16"

    @property
    def scaled(self) -> bool:
        """Whether the GEMMs take the weights' scales as an argument (FP8 block, FP4, FP8 per-tensor)."""
        return self.fp8 or bool(self.fp4) or self.fp8_tensor

    @property
    def wfmt(self) -> str:
        """The weights' format in the kernels' names."""
        return "fp8a8" if self.a8 else "fp8" if self.fp8 else "fp8t" if self.fp8_tensor else self.fp4 or "bf16"

    @property
    def gate_up_name(self) -> str:
        return f"moe_prefill_gate_up_w{self.bm // 64}_bn{self.bn}_s{self.stages}{'_ws' if self.ws else ''}_{self.wfmt}"

    @property
    def down_name(self) -> str:
        return f"moe_prefill_down_w{self.bm // 64}_bn{self.bn}_s{self.dstages}{'_ws' if self.ws else ''}_{self.wfmt}"

    def persistent(self, k_dim: int) -> bool:
        """Whether a GEMM over K = k_dim runs persistent (a block a multiprocessor taking the GEMM's
        blocks in turn; with a producer warpgroup only): where a block's k-loop is short enough that
        its ring's filling and its epilogue weigh. Measured on the H200 (2026-11-30, `moegen tune`,
        N = 8192, against the plain kernel in the same run): every GEMM persistent, Qwen3-30B-A3B
        (K = 2048 and 768) 1686 against 1781 us, Mixtral-8x7B (K = 4096 and 14336) 12199 against
        12304 us; a block per GEMM block (an earlier run), 1783 against 1851 us and 11602 against
        12352 us."""
        return self.ws and k_dim // 64 <= PERSISTENT_KTILES

    def _stage(self, units: int, barriers_in_pad: bool = False) -> int:
        """A stage of the ring: the tokens' B tile, each warp's `units` 16-byte fragments a lane (FP8
        weight-only: half of them; FP4 a quarter), the tokens' scales (A8: 1 KB) or the weights' row
        scales (FP4: 1 KB) and the stage's two barriers (barriers_in_pad: in the staged Y rows' padding)."""
        per_warp = units // 2 if self.fp8 and not self.a8 or self.fp8_tensor else units // 4 if self.fp4 else units
        # (A8: 128 token rows, and 128 weight rows x 128 K for each of the two tiles' experts)
        weights = 2 * 128 * 128 if self.a8 else self.threads // 32 * per_warp * 512
        return ((128 if self.a8 else self.bn) * 128 + weights + (1024 if self.a8 or self.fp4 else 0)
                + (16 if self.ws and not barriers_in_pad else 0))

    @property
    def y_stage_bytes(self) -> int:
        """The down GEMM's staged Y half tile (stage_y): bn token rows of a warpgroup's half of its
        down_rows bf16 columns, each row 16 bytes longer (the 8 rows of a stmatrix piece then lie in
        distinct banks; the ring's barriers in that padding)."""
        return self.bn * (self.down_rows + 16) if self.stage_y else 0

    @property
    def down_smem_bytes(self) -> int:
        return self.dstages * self._stage(8 if self.down_pair else 4, self.stage_y) + self.y_stage_bytes + 1024

    @property
    def down_rows(self) -> int:
        """Weight rows of a down GEMM block: a 16-row tile a warp, or a row group of two (down_pair);
        A8: 128 (the block's N)."""
        return 128 if self.a8 else self.threads // 32 * (32 if self.down_pair else 16)

    @property
    def gate_up_rows(self) -> int:
        """Columns of H a gate/up GEMM block computes: a 16-row tile a warp; A8: 64 (gate's and up's
        64 rows, the block's N of 128)."""
        return 64 if self.a8 else self.threads // 32 * 16

    @property
    def gate_up_smem_bytes(self) -> int:
        """The gate/up kernel's ring: per stage the tokens' B tile and each warp's 8 fragments (FP8: 4)."""
        return self.stages * self._stage(8) + 1024


PERSISTENT_KTILES = 32  # 64-wide k-tiles up to which a GEMM with a producer warpgroup runs persistent
# FP8 activations: the column of each 32-wide chunk at logical K position L. The activations' codes
# are stored in this order, and the weights' codes in the core-matrix layout too
# (moegen.weights.pack_fp8_core), so that the e4m3 A fragment of lane t (K 4t .. 4t + 3 and 16 + 4t
# .. 16 + 4t + 3, through ldmatrix) holds columns 8t + 0, 2, 1, 3 and 8t + 4 + those: each row word's
# bytes 0, 2 and 1, 3 (e4m3x4_to_bf16x4's pairs) are the bf16 fragments' column pairs of pack_fp8
# (common.cuh.j2 a8_frags), the decode path's X' unchanged.
A8_ORDER = tuple(8 * ((L % 16) // 4) + 4 * (L // 16) + (0, 2, 1, 3)[L % 4] for L in range(32))
DOWN_MATS = (1, 2, 4)  # the down weights' GEMV layouts (16-row tiles grouped 1, 2 or 4 at a time)
# X' permute blocks a multiprocessor (grid-strided, all resident: in a layer it waits for the router at its end)
PERMUTE_PER_SM = 4
MAX_EXPERTS = 512  # routed experts the grouping kernels handle (shared-memory tables)

# SiLU-gated experts (the activation rule of a plan, templates/act.cuh.j2)
SILU = (("int", "KIND", "MOE_ACT_SILU"), ("float", "LIMIT", "0.0f"), ("float", "ALPHA", "1.0f"),
        ("bool", "SHARED_LIMIT", "false"), ("bool", "EXPERT_BIAS", "false"))


def grouped_args(t: GemmTiles, standalone: bool = True, down_mats: tuple[int, ...] = DOWN_MATS,
                 other_bn: int = 0, a8: bool | None = None) -> dict:
    """The arguments of templates/grouped_gemm.cu.j2 for tile shape t: standalone adds the extern
    kernels of this module (the plain GEMM, gate/up and down for each of down_mats, grouping,
    combine, permute); a layer's source calls the device functions from its own kernels.
    other_bn: a second tile width (tokens) some GEMMs take (the shared expert's FP8 block tile
    beside FP4 routed experts), whose register-A wgmma wrappers are rendered too. a8: whether some
    GEMM takes FP8 activations (default t's), where the FP8-activation GEMM is rendered."""
    def shape(bn: int) -> dict:
        return {"bn": bn, "acc_regs": ", ".join(f"%{i}" for i in range(bn // 2)),
                "acc_constraints": ", ".join(f'"+f"(d[{i}])' for i in range(bn // 2))}

    return {
        "shapes": [shape(b) for b in dict.fromkeys((t.bn, other_bn)) if b],
        "name": t.name, "gate_up_name": t.gate_up_name, "bm": t.bm, "bn": t.bn, "stages": t.stages,
        "down_stages": t.dstages, "a8": t.a8 if a8 is None else a8,
        "threads": t.threads, "gate_up": t.bn <= max(PREFILL_BN), "down_name": t.down_name, "down_mats": down_mats,
        "standalone": standalone, "ws": t.ws, "packed_threads": t.packed_threads,
        "group_name": "moe_prefill_group", "combine_name": "moe_prefill_combine",
        "permute_name": "moe_prefill_permute", "max_experts": MAX_EXPERTS,
        **{k: v for k, v in shape(t.bn).items() if k != "bn"},  # the layer's tile's (the plain GEMM's wrapper)
    }


def render_grouped_gemm(t: GemmTiles, act_rule: tuple[tuple[str, str, str], ...] = SILU) -> str:
    """The CUDA source of the grouped-GEMM kernels of one tile shape (the common header and the
    activation rule included), for NVRTC: the plain GEMM, and with bn <= 160 (two accumulator sets
    in registers) the gate/up GEMM on packed weights."""
    g = grouped_args(t)
    parts = [env().get_template("common.cuh.j2").render(),
             env().get_template("act.cuh.j2").render(plan=SimpleNamespace(act_rule=act_rule)),
             env().get_template("grouped_gemm.cu.j2").render(g=g)]
    return "\n".join(parts)


def k_permutation() -> np.ndarray:
    """[32] int: position q of a 32-wide K chunk of X' holds column perm[q] of X. It is the order
    in which the GEMV tiles (moegen.weights.pack_tiles) put a row's K into the A fragments of
    the chunk's two k-steps: k-step s, fragment position p (k 0-15 of the m16n8k16 step) holds
    column 8*(p%8//2) + 4s + p%2 (+2 for p >= 8)."""
    import numpy as np
    return np.array([8 * (p % 8 // 2) + 4 * s + p % 2 + (2 if p >= 8 else 0) for s in range(2) for p in range(16)])


def permute_k(x: np.ndarray) -> np.ndarray:
    """X' from X [..., K] (K a multiple of 32): every 32-wide chunk in k_permutation() order."""
    import numpy as np
    k = x.shape[-1]
    if k % 32:
        raise ValueError(f"K={k} is not a multiple of 32")
    idx = (np.arange(0, k, 32)[:, None] + k_permutation()[None, :]).reshape(-1)
    return x[..., idx]


def group_by_expert(ids: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Routing ids [N, k] -> (tok [N*k] int32: the token of each permuted row, grouped by expert
    and in token order within an expert; slot [N*k] int32: the permuted row of each (token, slot)
    pair, flattened; counts [E] int64)."""
    import numpy as np
    ids = np.asarray(ids)
    flat = ids.reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= experts):
        raise ValueError(f"expert ids must lie in [0, {experts})")
    order = np.argsort(flat, kind="stable")  # (token, slot) pairs by expert, token order kept
    tok = (order // ids.shape[1]).astype(np.int32)
    slot = np.empty_like(order)
    slot[order] = np.arange(order.size)
    return tok, slot.astype(np.int32), np.bincount(flat, minlength=experts)


TILE_INTS = 8  # int32 a tile table's entry (32 bytes)


def tile_table(counts: np.ndarray, bm: int) -> np.ndarray:
    """[tiles, 8] int32 (expert, first permuted row, rows, group word, group's first row, rows of
    the group's last tile, 0, 0): each expert's rows in BM-row tiles, as the device scan writes
    them. A tile's group (the word: its first tile + its tiles << 16) orders the GEMMs' blocks
    (gemm_tile: a group's tiles side by side, one weight row block after another): an expert's
    tiles, cut into parts of equal size (the first ones a tile more) where it has more than two
    over the experts' average."""
    import numpy as np
    counts = np.asarray(counts, np.int64)
    ntiles = [-(-int(c) // bm) for c in counts]
    gmax = -(-sum(ntiles) // max(len(counts), 1)) + 2
    rows, start, tile = [], 0, 0
    for e, (c, n) in enumerate(zip(counts, ntiles)):
        parts = -(-n // gmax)
        sizes = [n // parts + (j < n % parts) for j in range(parts)]
        groups = [(sum(sizes[:j]), size) for j, size in enumerate(sizes) for _ in range(size)]
        rows += [(e, start + r * bm, min(bm, int(c) - r * bm), (tile + g0) | size << 16,
                  start + g0 * bm, int(c) - (g0 + size - 1) * bm if g0 + size == n else bm, 0, 0)
                 for r, (g0, size) in enumerate(groups)]
        start += int(c)
        tile += n
    return np.array(rows, np.int32).reshape(-1, TILE_INTS)


def _load(tiles: GemmTiles, arch: str, device: object) -> tuple[object, object]:
    """(device, module): the kernels of `tiles` compiled (NVRTC, cached) and loaded on device."""
    from cuda.core import Device, ObjectCode

    from .nvrtc import compile_cuda

    device = device if device is not None else Device()
    device.set_current()
    compiled = compile_cuda(render_grouped_gemm(tiles), arch, display="grouped_gemm.cu")
    return device, ObjectCode.from_cubin(compiled.cubin)


def _sms(device: object) -> int:
    """The device's multiprocessors: a persistent GEMM's grid."""
    return int(device.properties.multiprocessor_count)


class GroupedGemm:
    """One compiled grouped-GEMM kernel on a device: y[p, :] = x[tok[p], :] @ w[e].T for the
    rows p of each tile (expert e). Pointers are raw device addresses (bf16 x [T, K], int32 tok
    [P], bf16 w [E, n_out, K], int32 tiles [n_tiles, 8] (tile_table), bf16 y [P, n_out]); n_out % bn == 0 and
    K % 64 == 0."""

    def __init__(self, tiles: GemmTiles = GemmTiles(), arch: str = "sm_90a", device: object = None) -> None:
        from .runtime import allow_smem

        self.tiles = tiles
        self.device, module = _load(tiles, arch, device)
        self.kernel = module.get_kernel(tiles.name)
        self.gate_up_kernel = module.get_kernel(tiles.gate_up_name) if tiles.bn <= max(PREFILL_BN) else None
        for kern, size in ((self.kernel, tiles.smem_bytes), (self.gate_up_kernel, tiles.gate_up_smem_bytes)):
            if kern is not None:
                allow_smem(kern, size, self.device)

    def __call__(self, x: int, tok: int, w: int, tile_table: int, y: int, n_tiles: int, n_out: int, k: int,
                 stream: object = None) -> None:
        import numpy as np
        from cuda.core import LaunchConfig, launch

        from .runtime import _StreamRef, stream_handle

        if n_out % self.tiles.bn or k % 64:
            raise ValueError(f"grouped GEMM: n_out={n_out} must be a multiple of {self.tiles.bn}, K={k} of 64")
        if n_tiles == 0:
            return
        cfg = LaunchConfig(grid=(n_out // self.tiles.bn, n_tiles), block=self.tiles.threads,
                           shmem_size=self.tiles.smem_bytes)
        launch(_StreamRef(stream_handle(stream)), cfg, self.kernel, np.uint64(x), np.uint64(tok), np.uint64(w),
               np.uint64(tile_table), np.uint64(y), np.int32(n_out), np.int32(k))

    def gate_up(self, xp: int, tok: int, w13: int, tile_table: int, h: int, n_tiles: int, inter: int, k: int,
                row_tiles: int, experts: int, stream: object = None) -> None:
        """h[p, i] = act(gate . x', up . x') for rows p of each tile (at most packed_rows rows a tile): w13 the GEMV tiles of gate and
        up ([E][row_tiles][K/32][2][2][32] 16-byte fragments, E = experts), x' from permute_k, h [P, inter] bf16."""
        import numpy as np
        from cuda.core import LaunchConfig, launch

        from .runtime import _StreamRef, stream_handle

        warps = self.tiles.threads // 32
        if self.gate_up_kernel is None or row_tiles % warps or k % 64:
            raise ValueError(f"gate/up GEMM: bn={self.tiles.bn} must be <= {max(PREFILL_BN)}, row_tiles={row_tiles} a multiple "
                             f"of {warps}, K={k} of 64")
        if n_tiles == 0:
            return
        grid = (_sms(self.device), 1) if self.tiles.persistent(k) else (row_tiles // warps, n_tiles)
        cfg = LaunchConfig(grid=grid, block=self.tiles.packed_threads, shmem_size=self.tiles.gate_up_smem_bytes)
        # the kernel covers (n * topk + bn - 1) / bn + extra tiles: n_tiles with n = n_tiles * bn, topk 1, extra 0
        launch(_StreamRef(stream_handle(stream)), cfg, self.gate_up_kernel, np.uint64(xp), np.uint64(tok),
               np.uint64(w13), np.uint64(tile_table), np.uint64(h), np.int32(inter), np.int32(k), np.int32(row_tiles),
               np.int32(experts), np.int32(n_tiles * self.tiles.bn), np.int32(1), np.int32(0))


def bench_grouped_gemm(tokens: int, experts: int, top_k: int, n_out: int, k: int, tiles: GemmTiles = GemmTiles(),
                       replays: int = 20) -> dict[str, float]:
    """One grouped GEMM (rows = tokens x top_k, uniformly routed) timed with CUDA events against
    torch._grouped_mm on the same grouped rows and weights: microseconds and TFLOP/s of each.
    Needs PyTorch with CUDA. Not a test: times are printed, never asserted."""
    import numpy as np
    import torch

    gemm = GroupedGemm(tiles)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(experts, n_out, k, device="cuda") / k**0.5).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda").argsort(1)[:, :top_k].cpu().numpy()
    tok, _, counts = group_by_expert(ids, experts)
    table = tile_table(counts, tiles.bm)
    tok_d, table_d = torch.from_numpy(tok).cuda(), torch.from_numpy(table.reshape(-1)).cuda()
    y = torch.empty(len(tok), n_out, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream

    def ours() -> None:
        gemm(x.data_ptr(), tok_d.data_ptr(), w.data_ptr(), table_d.data_ptr(), y.data_ptr(), len(table), n_out, k,
             stream=stream)

    xs, wt = x[tok_d.long()], w.transpose(1, 2)  # torch._grouped_mm: rows grouped by offsets, B [E, K, N]
    offs = torch.from_numpy(np.cumsum(counts)).to(torch.int32).cuda()

    def theirs() -> None:
        torch._grouped_mm(xs, wt, offs=offs)

    flop = 2.0 * len(tok) * n_out * k
    out = {"moegen_us": _time_us(ours, torch, replays)}
    out["moegen_tflops"] = flop / out["moegen_us"] / 1e6
    if hasattr(torch, "_grouped_mm"):
        out["grouped_mm_us"] = _time_us(theirs, torch, replays)
        out["grouped_mm_tflops"] = flop / out["grouped_mm_us"] / 1e6
    return out


class PrefillExperts:
    """The routed experts of a batch on the tensor cores, from the decode path's packed weights:
    X' (permute), the stable grouping by expert (count, scan, place), the gate/up GEMM with the
    activation, the down GEMM, and the weighted combine (zero experts add weight * x). Every
    size is fixed by n; nothing waits on the device (the GEMMs' grids are sized for the most
    tiles the routing can make, the extra blocks return)."""

    def __init__(self, experts: int, hidden: int, inter: int, top_k: int, down_mats: int,
                 tiles: GemmTiles = GemmTiles(), arch: str = "sm_90a", device: object = None) -> None:
        warps = tiles.threads // 32
        if experts > MAX_EXPERTS or down_mats not in DOWN_MATS or tiles.bn > max(PREFILL_BN):
            raise ValueError(f"prefill: experts={experts} (<= {MAX_EXPERTS}), down_mats={down_mats} "
                             f"(one of {DOWN_MATS}), bn={tiles.bn} (<= {max(PREFILL_BN)})")
        if inter % 64 or hidden % 64 or (inter // 16) % warps or (hidden // 16) % warps or (hidden // 16) % down_mats:
            raise ValueError(f"prefill: I={inter} and H={hidden} must be multiples of 64 with whole blocks of "
                             f"{warps} 16-row tiles")
        from .runtime import allow_smem

        self.e, self.h, self.i, self.k, self.tiles = experts, hidden, inter, top_k, tiles
        self.device, module = _load(tiles, arch, device)
        names = {"count": "moe_prefill_group_count", "scan": "moe_prefill_group_scan",
                 "place": "moe_prefill_group_place", "combine": "moe_prefill_combine",
                 "permute": "moe_prefill_permute", "gate_up": tiles.gate_up_name,
                 "down": f"{tiles.down_name}_m{down_mats}"}
        self.kern = {k: module.get_kernel(v) for k, v in names.items()}
        for k, size in (("gate_up", tiles.gate_up_smem_bytes), ("down", tiles.down_smem_bytes)):
            allow_smem(self.kern[k], size, self.device)

    def workspace(self, n: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Buffer shapes and dtypes for n tokens."""
        p = n * self.k
        chunks = -(-p // 1024)
        return {"xp": ((n, self.h), "bfloat16"), "counts": ((chunks * self.e,), "int32"),
                "first": ((self.e + 1,), "int32"), "tiles": ((self.max_tiles(n) * TILE_INTS,), "int32"),
                "tok": ((p,), "int32"), "slot": ((p,), "int32"), "h": ((p, self.i), "bfloat16"),
                "y": ((p, self.h), "bfloat16")}

    def max_tiles(self, n: int) -> int:
        return -(-n * self.k // self.tiles.packed_rows) + self.e

    def __call__(self, n: int, x: int, ids: int, wts: int, w13: int, w2: int, out: int, ws: dict[str, int],
                 stream: object = None) -> None:
        """out [n, H] bf16 = sum_j wts[t, j] * expert_{ids[t, j]}(x[t]); x bf16 [n, H], ids int32 and
        wts fp32 [n, top_k], w13 / w2 the packed GEMV tiles, ws the workspace() buffers' addresses."""
        import numpy as np
        from cuda.core import LaunchConfig, launch

        from .runtime import _StreamRef, stream_handle

        s = _StreamRef(stream_handle(stream))
        p, t = n * self.k, self.tiles
        chunks, max_tiles, warps = -(-p // 1024), self.max_tiles(n), t.threads // 32
        u64, i32 = np.uint64, np.int32

        def go(kernel: str, grid: tuple[int, int], block: int, *args: object, smem: int = 0) -> None:
            launch(s, LaunchConfig(grid=grid, block=block, shmem_size=smem), self.kern[kernel], *args)

        go("permute", (PERMUTE_PER_SM * _sms(self.device), 1), 256, u64(x), u64(ws["xp"]), i32(self.h), i32(n))
        go("count", (chunks, 1), 1024, u64(ids), i32(p), i32(self.e), u64(ws["counts"]))
        go("scan", (1, 1), 1024, u64(ws["counts"]), i32(chunks), i32(self.e), i32(t.packed_rows), i32(max_tiles),
           u64(ws["first"]), u64(ws["tiles"]))
        go("place", (chunks, 1), 1024, u64(ids), i32(p), i32(self.e), i32(self.k), u64(ws["counts"]),
           u64(ws["first"]), u64(ws["tok"]), u64(ws["slot"]))
        sms = (_sms(self.device), 1)  # a persistent GEMM's grid
        tiles_of = (i32(n), i32(self.k), i32(self.e))  # they cover (n * k + bn - 1) / bn + E tiles
        go("gate_up", sms if t.persistent(self.h) else (self.i // 16 // warps, max_tiles), t.packed_threads, u64(ws["xp"]),
           u64(ws["tok"]), u64(w13), u64(ws["tiles"]), u64(ws["h"]), i32(self.i), i32(self.h), i32(self.i // 16),
           i32(self.e), *tiles_of, smem=t.gate_up_smem_bytes)
        go("down", sms if t.persistent(self.i) else (self.h // 16 // warps, max_tiles), t.packed_threads, u64(ws["h"]), u64(w2),
           u64(ws["tiles"]), u64(ws["y"]), i32(self.h), i32(self.i), i32(self.h // 16), i32(self.e), *tiles_of,
           smem=t.down_smem_bytes)
        go("combine", (-(-self.h // 1024), n), 256, u64(ws["y"]), u64(ws["slot"]), u64(wts), u64(x), u64(out),
           i32(self.h), i32(self.k))


def bench_prefill(spec_path: str, tokens: list[int], tiles: GemmTiles = GemmTiles()) -> list[dict[str, float]]:
    """The routed experts of a BF16 spec at prefill sizes: PrefillExperts on the layer's own
    packed weights (loaded as `moegen bench` loads them) against torch._grouped_mm on the same
    weights and routing (uniform random, distinct experts per token; routing itself not timed).
    TFLOP/s count 2 * N * k * 3 * H * I. CUDA-event times of back-to-back calls; printed, not
    asserted."""
    import tempfile
    from pathlib import Path

    import numpy as np
    import torch

    from .bench import _random_weights
    from .build import render_all, write_dir
    from .plan import make_plan
    from .runtime import load
    from .spec import load_spec

    spec = load_spec(spec_path)
    plan = make_plan(spec)
    w13 = next(w for w in plan.weights if w.name == "w13")
    w2 = next(w for w in plan.weights if w.name == "w2")
    if w13.format != "bf16" or w2.format != "bf16":
        raise ValueError(f"{spec.name}: the prefill GEMMs take BF16 experts (this spec's are {w13.format})")
    out_dir = Path(tempfile.mkdtemp()) / spec.name
    write_dir(out_dir, render_all(spec, plan))
    weights = _random_weights(plan, np.random.default_rng(0))
    layer = load(out_dir, weights)
    e, h, i, k = plan.experts, plan.hidden, w13.rows, plan.top_k
    pe = PrefillExperts(e, h, i, k, w2.mats, tiles)
    w13_t = torch.cat([weights["experts.gate_proj"], weights["experts.up_proj"]], 1).transpose(1, 2).contiguous()
    w2_t = weights["experts.down_proj"].transpose(1, 2).contiguous()  # [E, I, H]
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    for n in tokens:
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(n, e, device="cuda").argsort(1)[:, :k].to(torch.int32).contiguous()
        wts = torch.rand(n, k, device="cuda", dtype=torch.float32)
        ws = {name: torch.empty(shape, device="cuda", dtype=getattr(torch, dt)) for name, (shape, dt) in pe.workspace(n).items()}
        out = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
        ptrs = {key: v.data_ptr() for key, v in ws.items()}

        def ours(n=n, x=x, ids=ids, wts=wts, out=out, ptrs=ptrs) -> None:
            pe(n, x.data_ptr(), ids.data_ptr(), wts.data_ptr(), layer._weights.ptr("w13"), layer._weights.ptr("w2"),
               out.data_ptr(), ptrs, stream=stream)

        def theirs(x=x, ids=ids, wts=wts) -> None:
            flat = ids.reshape(-1).long()
            order = flat.argsort(stable=True)
            offs = torch.bincount(flat, minlength=e).cumsum(0).to(torch.int32)
            hh = torch._grouped_mm(x[order // k], w13_t, offs=offs)
            act = torch.nn.functional.silu(hh[:, :i]) * hh[:, i:]
            y = torch._grouped_mm(act, w2_t, offs=offs)
            torch.zeros(x.shape, device="cuda", dtype=torch.float32).index_add_(
                0, order // k, y.float() * wts.reshape(-1)[order, None])

        flop = 2.0 * n * k * 3 * h * i
        row = {"tokens": n, "us": _time_us(ours, torch)}
        row["tflops"] = flop / row["us"] / 1e6
        row["grouped_mm_us"] = _time_us(theirs, torch)
        row["vs_grouped_mm"] = row["grouped_mm_us"] / row["us"]
        rows.append(row)
    layer.close()
    return rows


def _time_us(fn: object, torch: object, replays: int = 10) -> float:
    for _ in range(2):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / replays


if __name__ == "__main__":  # python3 -m moegen.prefill specs/<model>.yaml [N,...]: the prefill experts' speed
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python3 -m moegen.prefill specs/<model>.yaml [tokens,...]")
    counts = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "512,2048,8192,16384").split(",")]
    print(f"{sys.argv[1]}: routed experts on the tensor cores (wgmma), BF16, uniform routing")
    for r in bench_prefill(sys.argv[1], counts):
        print(f"{r['tokens']:>6} {r['us']:>10.1f} us {r['tflops']:>7.1f} TFLOP/s   torch._grouped_mm "
              f"{r['grouped_mm_us']:>10.1f} us  (x{r['vs_grouped_mm']:.2f})")
