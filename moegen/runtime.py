"""Runtime: load a generated layer's cubin, own its weights and workspace, run it on a stream.

forward() allocates nothing, never synchronizes and reads no device value on the host: the token
count picks the bucket, every pointer is known, so a call can be captured in a CUDA graph and
replayed. No framework is imported: arrays come in through DLPack / the CUDA Array Interface.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from . import weights as W
from .arrays import ArrayError, DeviceArray, View, check, view
from .plan import Plan, plan_from_dict

ALIGN = 256
_PDL = os.environ.get("MOEGEN_PDL", "1") != "0"  # MOEGEN_PDL=0 launches without programmatic dependence


class DeviceError(RuntimeError):
    """No CUDA device to run a layer on (no NVIDIA driver, or no device): building needs none, running does."""


def _device(device: Any) -> Any:
    """The cuda.core Device to run on: the one given, else the current one; a DeviceError where this
    machine has no CUDA driver or device (cuda-python raises its own types for each)."""
    from cuda.core import Device

    if device is not None:
        return device
    try:
        return Device()
    except Exception as exc:  # a missing driver library, a failed cuInit, no device: all one answer
        raise DeviceError(f"moegen: a layer runs on an NVIDIA GPU, and this machine offers none "
                          f"({type(exc).__name__}: {exc})") from exc


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _ok(result: Any, what: str) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA error in {what}: {err}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else None


class _StreamRef:
    """Adapts a raw stream handle to cuda.core's __cuda_stream__ protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def stream_handle(stream: Any) -> int:
    """A raw CUstream from None (the legacy default stream), an int, or any __cuda_stream__ object."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        proto = stream.__cuda_stream__
        return int((proto() if callable(proto) else proto)[1])
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream before it spoke __cuda_stream__
        return int(stream.cuda_stream)
    raise ArrayError(f"stream: a {type(stream).__name__} is not a CUDA stream (expected __cuda_stream__ or a handle)")


class Memory:
    """One device allocation carved into named, 256-byte aligned buffers."""

    def __init__(self, device: Any, sizes: Mapping[str, int]) -> None:
        self.offsets: dict[str, int] = {}
        total = 0
        for name, size in sizes.items():
            self.offsets[name] = total
            total += -(-max(size, 1) // ALIGN) * ALIGN
        # Plain cuMemAlloc (what cudaMalloc is): the frameworks' allocators stay out of it.
        self.base = int(_ok(_driver().cuMemAlloc(total), f"allocating {total} bytes")) if total else 0
        self.size = total

    def close(self) -> None:
        if self.base:
            _ok(_driver().cuMemFree(self.base), "freeing device memory")
            self.base = 0

    def ptr(self, name: str) -> int:
        return self.base + self.offsets[name]

    def copy(self) -> Memory:
        """A new allocation of the same buffers, its contents copied on the device."""
        new = Memory(None, {})
        new.base = int(_ok(_driver().cuMemAlloc(self.size), f"allocating {self.size} bytes"))
        new.size, new.offsets = self.size, dict(self.offsets)
        try:
            _ok(_driver().cuMemcpyDtoD(new.base, self.base, self.size), "copying device memory")
        except BaseException:
            new.close()
            raise
        return new


def _check_hash_table(table: np.ndarray, experts: int) -> None:
    """tid2eid [vocab, k]: every row k distinct experts in [0, E) (the kernels index with them)."""
    bad = np.nonzero(((table < 0) | (table >= experts)).any(axis=1))[0]
    if bad.size:
        raise W.WeightError(f"tid2eid: row {bad[0]} is {table[bad[0]].tolist()}: experts must be in [0, {experts})")
    srt = np.sort(table, axis=1)
    dup = np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0]
    if dup.size:
        raise W.WeightError(f"tid2eid: row {dup[0]} is {table[dup[0]].tolist()}: a row's experts must be distinct")


def to_host(obj: Any, name: str = "array") -> np.ndarray:
    """A NumPy copy of any host or device array (bf16 arrives as ml_dtypes.bfloat16)."""
    if isinstance(obj, (np.ndarray, np.generic)):  # a NumPy scalar (e.g. a scale_2) is a 0-d array
        return np.asarray(obj)
    v = view(obj, name)
    dtype = np.dtype(W.BF16) if v.dtype == "bfloat16" else np.dtype(v.dtype)
    out = np.empty(v.shape, dtype)
    if v.strides is not None and v.strides != tuple(out.strides[i] // out.itemsize for i in range(out.ndim)):
        raise ArrayError(f"{name}: give weights contiguous (strides {list(v.strides)})")
    if v.on_device:
        _ok(_driver().cuMemcpyDtoH(out.ctypes.data, v.ptr, out.nbytes), f"copying {name} to the host")
    else:
        import ctypes

        ctypes.memmove(out.ctypes.data, v.ptr, out.nbytes)
    return out


def _by_experts(pieces: Mapping[str, list[tuple[str, Any]]], sources: tuple[str, ...],
                pack: Callable[[dict[str, np.ndarray]], np.ndarray], step: int = 4) -> np.ndarray:
    """pack({source: uint8 codes [E, R, K']}) for expert-stacked weights, `step` experts at a time
    on a thread pool (NumPy's copies release the GIL: packing a large checkpoint's codes is a
    strided permutation of gigabytes), into one array; a matrix without an expert axis at once."""
    hosts = {src: [to_host(obj, key) for key, obj in pieces[src]] for src in sources}

    def codes(src: str, a: int, b: int) -> np.ndarray:
        parts = hosts[src]
        c = np.stack(parts[a:b]) if len(parts) > 1 else parts[0][a:b]
        return np.ascontiguousarray(c).view(np.uint8)

    first = hosts[sources[0]]
    if len(first) == 1 and first[0].ndim == 2:  # the shared expert: no expert axis
        return pack({src: np.ascontiguousarray(hosts[src][0]).view(np.uint8) for src in sources})
    n = len(first) if len(first) > 1 else first[0].shape[0]
    head = pack({src: codes(src, 0, min(step, n)) for src in sources})
    out = np.empty((n, *head.shape[1:]), head.dtype)
    out[: len(head)] = head

    def fill(a: int) -> None:
        out[a : a + step] = pack({src: codes(src, a, min(a + step, n)) for src in sources})

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # bounded temporaries
        list(pool.map(fill, range(step, n, step)))
    return out


def allow_smem(kernel: Any, size: int, device: Any) -> None:
    """Let `kernel` have `size` bytes of dynamic shared memory. Unasked, a kernel gets 48 KB of
    shared memory in all, its static share included: one whose static and dynamic shares pass that
    together (the one-token kernel of a small FP4 layer: 46 KB dynamic, 8 KB static) would fit no
    block a multiprocessor, so every kernel with a dynamic share asks."""
    drv = _driver()
    _ok(drv.cuKernelSetAttribute(drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, size,
                                 kernel.handle, drv.CUdevice(int(device.device_id))),
        "allowing a kernel its dynamic shared memory")


def _write_tensor_maps(plan: Plan, packed: Memory, workspace: Memory) -> None:
    """Encode the plan's tensor maps over the packed weights (and the layer's workspace) and store
    them in the weights' buffer "tmaps" (128 bytes each, in plan order), where the kernels read them."""
    if not plan.tensor_maps:
        return
    drv = _driver()
    words = np.zeros((len(plan.tensor_maps), 16), np.uint64)
    kinds = {4: drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT32, 1: drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8}
    swizzles = {0: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE, 128: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}
    for i, m in enumerate(plan.tensor_maps):
        tmap = _ok(drv.cuTensorMapEncodeTiled(
            kinds[m.elem], len(m.dims), (workspace if m.workspace else packed).ptr(m.weight),
            [drv.cuuint64_t(v) for v in m.dims], [drv.cuuint64_t(v) for v in m.strides],
            [drv.cuuint32_t(v) for v in m.box], [drv.cuuint32_t(1)] * len(m.dims),
            drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzles[m.swizzle],
            drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), f"encoding the tensor map over {m.weight}")
        words[i] = [int(w) for w in tmap.opaque]
    _ok(drv.cuMemcpyHtoD(packed.ptr("tmaps"), words.ctypes.data, words.nbytes), "copying the tensor maps")


class _Code:
    """The loaded modules of one compiled layer on one device, and its kernels (their shared
    memory allowance set). Layers of the same generated output share one (_code): a model's many
    layers run one copy of the code, which stays in the caches from one layer to the next."""

    def __init__(self, plan: Plan, cubins: Sequence[bytes], kernel_names: list[str], device: Any) -> None:
        from cuda.core import ObjectCode

        # one module per compiled part (moegen.plan.Kernel.part), or one for the whole source
        self.modules = [ObjectCode.from_cubin(c) for c in cubins]
        part = {k.name: k.part if len(self.modules) > 1 else 0 for k in plan.kernels}
        self.kernels = {name: self.modules[part[name]].get_kernel(name) for name in kernel_names}
        smem: dict[str, int] = {}
        for b in plan.buckets:
            for ln in b.launches:
                smem[ln.kernel] = max(smem.get(ln.kernel, 0), ln.smem)
        for name, size in smem.items():
            if size > 0:
                allow_smem(self.kernels[name], size, device)


_CODE: weakref.WeakValueDictionary[tuple, _Code] = weakref.WeakValueDictionary()


def _code(plan: Plan, cubins: Sequence[bytes], kernel_names: list[str], device: Any) -> _Code:
    """The loaded code of these cubins on this device: loaded once while any layer holds it."""
    key = (int(device.device_id), tuple(hashlib.sha256(c).digest() for c in cubins), tuple(kernel_names),
           tuple(ln.smem for b in plan.buckets for ln in b.launches))
    code = _CODE.get(key)
    if code is None:
        code = _CODE[key] = _Code(plan, cubins, kernel_names, device)
    return code


class Layer:
    """One MoE layer of a generated spec. Weights in the Hugging Face layout (see load_weights)."""

    def __init__(self, plan: Plan, cubins: bytes | Sequence[bytes], kernel_names: list[str], device: Any = None) -> None:
        self.plan = plan
        self.device = _device(device)
        self.device.set_current()
        self.device_id = int(self.device.device_id)
        self._code = _code(plan, (cubins,) if isinstance(cubins, bytes) else tuple(cubins), kernel_names, self.device)
        self._kernels = self._code.kernels
        sizes = {b.name: int(np.prod(b.shape)) * np.dtype(b.dtype).itemsize for b in plan.workspace}
        self.workspace = Memory(self.device, sizes)
        # Counters (tile_done) start at zero and the kernels leave them at zero.
        _ok(_driver().cuMemsetD8(self.workspace.base, 0, self.workspace.size), "clearing the workspace")
        self._weights: Memory | None = None
        self._streams: dict[int, _StreamRef] = {}
        self._configs: dict[tuple[int, int], Any] = {}
        self._bucket_of = [0] * (plan.max_tokens + 1)
        lo = 1
        for bi, b in enumerate(plan.buckets):
            for n in range(lo, b.max_tokens + 1):
                self._bucket_of[n] = bi
            lo = b.max_tokens + 1
        self._outs = {}
        self._hashed = any("token_ids" in k.arg_keys for k in plan.kernels)
        self._allreduce: Any = None

    # ---- weights ----
    def load_weights(self, weights: Mapping[str, Any]) -> None:
        """Copy the layer's weights to the device and pack them into the kernels' layout there.

        Names (Hugging Face layout): `gate.weight` [E, H]; `experts.{gate,up}_proj` [E, I, H] and
        `experts.down_proj` [E, H, I], or per expert `experts.<e>.gate_proj` [I, H], ...; where
        the spec has them `shared_expert.{gate,up,down}_proj` and `shared_expert_gate.weight`
        [1, H]. Host (NumPy: bfloat16 or float, rounded to bf16) or device (DLPack / CUDA Array
        Interface: bfloat16, contiguous) arrays. Synchronizes: this is set-up, not the hot path.
        """
        plan = self.plan
        pieces = W.collect(weights, plan, self._describe)
        on_device = [pw for pw in plan.weights if pw.format == "bf16"]  # packed by a kernel
        on_host = [pw for pw in plan.weights if pw.format != "bf16"]  # quantized: packed with NumPy
        sizes = {pw.name: W.packed_nbytes(pw) for pw in plan.weights}
        host = {pw.name: self._pack_on_host(pw, pieces) for pw in on_host}
        for pw in on_host:
            sizes[pw.scale_name] = host[pw.name][1].nbytes
        raw = {b.name: np.ascontiguousarray(np.concatenate(
            [np.asarray(to_host(obj, key), b.dtype).reshape(-1) for key, obj in pieces[W.RAW_SOURCES[b.name]]]))
            for b in plan.raw}
        if "tid2eid" in raw:
            _check_hash_table(raw["tid2eid"].reshape(-1, plan.top_k), plan.experts)
        sizes.update({name: a.nbytes for name, a in raw.items()})
        if plan.tensor_maps:
            sizes["tmaps"] = 128 * len(plan.tensor_maps)
        packed = Memory(self.device, sizes)
        drv = _driver()
        for name, a in raw.items():
            _ok(drv.cuMemcpyHtoD(packed.ptr(name), a.ctypes.data, a.nbytes), f"copying {name}")
        for pw in on_host:
            codes, scales = host[pw.name]
            _ok(drv.cuMemcpyHtoD(packed.ptr(pw.name), codes.ctypes.data, codes.nbytes), f"copying {pw.name}")
            _ok(drv.cuMemcpyHtoD(packed.ptr(pw.scale_name), scales.ctypes.data, scales.nbytes), "copying scales")
        # bf16 sources are staged contiguously (a concatenated matrix, router + gate row, is one
        # buffer), except a whole tensor already on this device: the pack kernel reads it in place.
        src_ptr: dict[str, int] = {}
        stage_of: dict[str, str] = {}
        stage_sizes: dict[str, int] = {}
        for pw in on_device:
            groups = [pw.sources] if (pw.mats == 1 and len(pw.sources) > 1) else [(s_,) for s_ in pw.sources]
            for grp in groups:
                if len(grp) == 1 and (ptr := self._in_place(pieces[grp[0]], W.expected(plan)[grp[0]])):
                    src_ptr[grp[0]] = ptr
                    continue
                for src in grp:
                    stage_of[src] = grp[0]
                stage_sizes[grp[0]] = sum(int(np.prod(W.expected(plan)[src])) * 2 for src in grp)
        stage = Memory(self.device, stage_sizes)
        fill: dict[str, int] = dict.fromkeys(stage_sizes, 0)
        for src, head in stage_of.items():  # a group's sources in order, one after the other
            src_ptr[src] = stage.ptr(head) + fill[head]
            for key, obj in pieces[src]:
                fill[head] += self._copy_in(obj, key, stage.ptr(head) + fill[head])
        for pw in on_device:
            self._pack(pw, src_ptr, packed)
        _write_tensor_maps(self.plan, packed, self.workspace)
        _ok(drv.cuCtxSynchronize(), "packing weights")
        stage.close()
        if self._weights is not None:
            self._weights.close()
        self._weights = packed

    def load_weights_from(self, other: Layer) -> None:
        """This layer's weights: a device copy of another loaded layer's packed weights (the same
        packed layout: the same plan, or one that differs only in its kernels), with no host work.
        moegen bench stacks layers this way: the same values at other addresses keep each layer's
        weights out of L2 as well as new values would."""
        if (other.plan.weights, other.plan.raw, other.plan.tensor_maps) != (
                self.plan.weights, self.plan.raw, self.plan.tensor_maps):
            raise ValueError("load_weights_from: the other layer's packed weights have another layout "
                             "(another spec, or a tuning that packs them otherwise)")
        if (self.plan.prefill_from and not other.plan.prefill_from
                and any(pw.format == "mxfp4" for pw in self.plan.weights)):
            raise ValueError("load_weights_from: MXFP4 weights loaded without prefill buckets were not checked "
                             "against the prefill GEMMs' scale limit (moegen.weights.MX_PREFILL_MAX_SCALE); load "
                             "them into this layer with load_weights")
        if other._weights is None:
            raise RuntimeError("load_weights_from: the other layer has no weights loaded")
        self.device.set_current()
        packed = other._weights.copy()
        _write_tensor_maps(self.plan, packed, self.workspace)  # over this copy's weights, not the other layer's
        if self._weights is not None:
            self._weights.close()
        self._weights = packed

    def _pack_on_host(self, pw: Any, pieces: Mapping[str, list[tuple[str, Any]]]) -> tuple[np.ndarray, np.ndarray]:
        """Quantized weights, packed with NumPy: FP8 e4m3 codes in the tile layout with their fp32
        block scales, or (per-tensor) each matrix's weight and input scale; MXFP4 and NVFP4 e2m1
        codes in the tile layout with their scales by tile."""
        def whole(name: str) -> np.ndarray:
            parts = [to_host(obj, key) for key, obj in pieces[name]]
            return np.stack(parts) if len(parts) > 1 else parts[0]

        if pw.format in ("mxfp4", "nvfp4"):
            from .formats import unpack_nibbles

            extra = ("_scale", "_scale_2") if pw.format == "nvfp4" else ("_scale",)
            scale = {f"{src}{x}": whole(f"{src}{x}") for src in pw.sources for x in extra}
            codes = _by_experts(pieces, pw.sources, lambda c: W.pack_fp4(pw, {k: unpack_nibbles(v) for k, v in c.items()}))
            if pw.format == "nvfp4":
                return codes, W.nv_scale_tiles(pw, scale)
            return codes, W.mx_scale_tiles(pw, scale, prefill=self.plan.prefill_from > 0)
        codes = _by_experts(pieces, pw.sources, lambda c: (W.pack_fp8_core if pw.core else W.pack_fp8)(pw, c))
        if pw.format == "fp8_tensor":
            scales = {f"{src}{x}": whole(f"{src}{x}") for src in pw.sources for x in ("_scale", "_input_scale")}
            return codes, W.fp8_tensor_scales(pw, scales)
        scales = {f"{src}_scale_inv": whole(f"{src}_scale_inv") for src in pw.sources}
        return codes, W.fp8_scales(pw, scales)

    def _describe(self, obj: Any, key: str) -> tuple[tuple[int, ...], str, bool]:
        if isinstance(obj, (np.ndarray, np.generic)):  # NumPy scalars: 0-d host arrays
            return np.shape(obj), np.asarray(obj).dtype.name, False
        v = view(obj, key)
        return v.shape, v.dtype, v.on_device

    def _copy_in(self, obj: Any, key: str, dst: int) -> int:
        """Copy one weight tensor (as bf16) to device address dst; returns its size in bytes."""
        drv = _driver()
        if isinstance(obj, np.ndarray):
            bits = W.bf16_bits(obj, key)
            _ok(drv.cuMemcpyHtoD(dst, bits.ctypes.data, bits.nbytes), f"copying {key}")
            return bits.nbytes
        v = view(obj, key)
        check(v, key, v.shape, "bfloat16", self.device_id)
        nbytes = int(np.prod(v.shape)) * 2
        _ok(drv.cuMemcpyDtoD(dst, v.ptr, nbytes), f"copying {key}")
        return nbytes

    def _in_place(self, parts: list[tuple[str, Any]], shape: tuple[int, ...]) -> int:
        """The device address of a source given as one whole bf16 tensor on this device, else 0."""
        if len(parts) != 1 or isinstance(parts[0][1], np.ndarray):
            return 0
        key, obj = parts[0]
        v = view(obj, key)
        if not v.on_device:
            return 0
        check(v, key, shape, "bfloat16", self.device_id)
        return v.ptr

    def _pack(self, pw: Any, src_ptr: dict[str, int], packed: Memory) -> None:
        from cuda.core import LaunchConfig, launch

        units = W.packed_nbytes(pw) // 16
        kernel = self._kernels[f"moe_pack_tiles_{self.plan.arch}"]
        src1 = src_ptr[pw.sources[1]] if len(pw.sources) == 2 and pw.mats == 2 else 0
        cfg = LaunchConfig(grid=min(-(-units // 256), 65535), block=256)
        launch(_StreamRef(0), cfg, kernel, np.uint64(src_ptr[pw.sources[0]]), np.uint64(src1),
               np.uint64(packed.ptr(pw.name)), np.int32(max(pw.experts, 1)), np.int32(pw.rows),
               np.int32(pw.rows_padded), np.int32(pw.cols), np.int32(pw.mats), np.int32(pw.interleaved))

    # ---- forward ----
    def __call__(self, x: Any, out: Any = None, stream: Any = None, token_ids: Any = None) -> Any:
        return self.forward(x, out, stream, token_ids)

    def forward(self, x: Any, out: Any = None, stream: Any = None, token_ids: Any = None) -> Any:
        """out[N, H] = MoE(x[N, H]) for bf16 x on this device, enqueued on `stream`.
        Hash-routed layers also take the tokens' ids, token_ids [N] int32 on the device."""
        if self._weights is None:
            raise RuntimeError("the layer has no weights: call load_weights first")
        xv = view(x, "x")
        n = xv.shape[0] if len(xv.shape) == 2 else -1
        if not 1 <= n <= self.plan.max_tokens:
            raise ArrayError(f"x: shape {list(xv.shape)}, expected [N, {self.plan.hidden}] with 1 <= N <= "
                             f"{self.plan.max_tokens} (the spec's max_tokens)")
        check(xv, "x", (n, self.plan.hidden), "bfloat16", self.device_id)
        if out is None:
            result = self._outs.get(n)
            if result is None:
                result = self._outs[n] = DeviceArray(self.workspace.ptr("out"), (n, self.plan.hidden),
                                                     self.device_id, self)
            out_ptr = result.ptr
        else:
            ov = view(out, "out")
            check(ov, "out", (n, self.plan.hidden), "bfloat16", self.device_id)
            out_ptr, result = ov.ptr, out
        tid_ptr = 0
        if self._hashed:
            if token_ids is None:
                raise ArrayError(f"token_ids: this layer is hash-routed: give the tokens' ids, [{n}] int32")
            tv = view(token_ids, "token_ids")
            check(tv, "token_ids", (n,), "int32", self.device_id)
            tid_ptr = tv.ptr
        handle = stream_handle(stream)
        self._launch(n, xv.ptr, out_ptr, handle, token_ids=tid_ptr)
        if self._allreduce is not None:  # expert parallelism: sum the ranks' partial outputs
            self._allreduce(result, handle)
        return result

    def close(self) -> None:
        """Free the layer's device memory (weights and workspace) now rather than at exit."""
        for mem in (self._weights, self.workspace):
            if mem is not None:
                mem.close()
        self._weights = None

    def set_allreduce(self, fn: Any) -> None:
        """Expert parallelism: fn(out, stream_handle) sums `out` over the ranks in place, enqueued on
        the stream (e.g. moegen.parallel.torch_allreduce(group)). Each rank's layer computes its own
        experts' share; the shared expert is added on rank 0 only. A function with a `ranks`
        attribute (as torch_allreduce's) must have one rank per expert-parallel rank."""
        ranks = getattr(fn, "ranks", None)
        if ranks is not None and ranks != self.plan.ep_size:
            raise ValueError(f"the communicator has {ranks} ranks, the spec's parallel.ep_size is {self.plan.ep_size}")
        self._allreduce = fn

    def _launch(self, n: int, x_ptr: int, out_ptr: int, stream: int, limit: int | None = None,
                token_ids: int = 0) -> None:
        from cuda.core import launch

        s = self._streams.get(stream)
        if s is None:
            s = self._streams[stream] = _StreamRef(stream)
        bi = self._bucket_of[n]
        for li, ln in enumerate(self.plan.buckets[bi].launches[:limit]):
            launch(s, self._config(bi, li, n), self._kernels[ln.kernel],
                   *self._args(ln.kernel, n, x_ptr, out_ptr, token_ids))

    def _config(self, bi: int, li: int, n: int) -> Any:
        from cuda.core import LaunchConfig

        key = (bi * 16 + li, n)
        cfg = self._configs.get(key)
        if cfg is None:
            ln = self.plan.buckets[bi].launches[li]
            # "sms": one block per multiprocessor of this device (a cooperative launch: all resident)
            gx = (n if ln.grid[0] == "n" else int(self.device.properties.multiprocessor_count) if ln.grid[0] == "sms"
                  else int(ln.grid[0]))
            cfg = self._configs[key] = LaunchConfig(grid=(gx, int(ln.grid[1])), block=ln.block, shmem_size=ln.smem,
                                                     is_cooperative=ln.coop,
                                                     programmatic_stream_serialization=ln.pdl and _PDL)
        return cfg

    def _args(self, kernel: str, n: int, x_ptr: int, out_ptr: int, token_ids: int = 0) -> list[Any]:
        k = self.plan.kernel(kernel)
        args: list[Any] = []
        for key in k.arg_keys:
            if key == "n":
                args.append(np.int32(n))
            elif key == "token_ids":
                args.append(np.uint64(token_ids))
            elif key == "x":
                args.append(np.uint64(x_ptr))
            elif key == "out":
                args.append(np.uint64(out_ptr))
            elif key.startswith("ws."):
                args.append(np.uint64(self.workspace.ptr(key[3:])))
            elif key.startswith("w."):
                name = key[2:]
                has = self._weights is not None and name in self._weights.offsets
                args.append(np.uint64(self._weights.ptr(name) if has else 0))
            else:
                raise AssertionError(f"unknown argument key {key}")
        return args

    # ---- inspection (synchronizes: for tests and debugging, not for the hot path) ----
    def routing(self, n: int, stream: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """The last call's routing: expert indices [n, k] int32 and weights [n, k] float32."""
        _ok(_driver().cuCtxSynchronize(), "synchronizing")
        k = self.plan.top_k
        ids = np.empty((n, k), np.int32)
        w = np.empty((n, k), np.float32)
        _ok(_driver().cuMemcpyDtoH(ids.ctypes.data, self.workspace.ptr("topk_ids"), ids.nbytes), "reading ids")
        _ok(_driver().cuMemcpyDtoH(w.ctypes.data, self.workspace.ptr("topk_w"), w.nbytes), "reading weights")
        return ids, w


def load(path: str | Path, weights: Mapping[str, Any] | None = None, device: Any = None) -> Layer:
    """The layer of a generated directory (e.g. generated/qwen3-30b-a3b), compiled for this GPU."""
    p = Path(path)
    launcher = p / "launcher.py"
    if not launcher.is_file():
        raise FileNotFoundError(f"{p}: no launcher.py (run `moegen build` on the spec first)")
    spec = importlib.util.spec_from_file_location(f"moegen_generated_{p.name.replace('-', '_').replace('.', '_')}",
                                                  launcher)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Layer(weights=weights, device=device)


def layer_from_files(cuda_file: Path, plan_data: dict, weights: Mapping[str, Any] | None, device: Any) -> Layer:
    """What a generated launcher calls: compile (or fetch from the cache) its CUDA, build the layer."""
    from .nvrtc import compile_parts

    plan = plan_from_dict(plan_data)
    compiled = compile_parts(cuda_file.read_text(), plan.arch, plan.parts, display=str(cuda_file))
    layer = Layer(plan, compiled.cubins, [k.name for k in plan.kernels], device)
    if weights is not None:
        layer.load_weights(weights)
    return layer


__all__ = ["DeviceError", "Layer", "View", "load", "to_host"]
