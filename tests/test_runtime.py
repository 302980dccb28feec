"""The runtime's plumbing without a GPU: the CUDA driver and cuda.core's launch are replaced by
recorders, so these tests check what the layer would allocate, copy and launch (every kernel of
the bucket, in order, with every pointer it needs set) and how it refuses bad arguments. What the
kernels compute is the GPU tier's job."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cuda.core
import ml_dtypes
import numpy as np
import pytest
from test_features import BASE, CASES

from moegen import runtime
from moegen.arrays import ArrayError, View
from moegen.families import Tuning
from moegen.plan import PlanError, make_plan
from moegen.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
from moegen.weights import MX_PREFILL_MAX_SCALE, WeightError, tensors


class FakeDriver:
    """The cuda.bindings.driver calls the runtime makes, recorded; memory is fake addresses."""

    CUresult = SimpleNamespace(CUDA_SUCCESS=0)
    CUfunction_attribute = SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="max_dynamic_smem")

    def __init__(self) -> None:
        self.top = 1 << 32
        self.live: dict[int, int] = {}
        self.copies: list[tuple[str, int, int]] = []
        self.smem: dict[str, int] = {}  # kernel -> dynamic shared memory allowed
        self.maps: list[tuple] = []  # encoded tensor maps: address, dims, strides, box

    @staticmethod
    def CUdevice(i: int) -> int:  # the driver's name
        return i

    def cuKernelSetAttribute(self, attr: str, value: int, kernel: str, dev: int) -> tuple[int]:
        assert attr == "max_dynamic_smem" and dev in (0, 1)  # the tests' devices
        self.smem[kernel] = value
        return (0,)

    def cuMemAlloc(self, size: int) -> tuple[int, int]:
        ptr, self.top = self.top, self.top + (size + 4095) // 4096 * 4096 + 4096
        self.live[ptr] = size
        return 0, ptr

    def cuMemFree(self, ptr: int) -> tuple[int]:
        assert ptr in self.live, "freeing memory that was not allocated"
        del self.live[ptr]
        return (0,)

    def cuMemsetD8(self, ptr: int, value: int, n: int) -> tuple[int]:
        return (0,)

    def cuMemcpyHtoD(self, dst: int, src: int, n: int) -> tuple[int]:
        assert self._inside(dst, n), "copy outside any allocation"
        self.copies.append(("htod", dst, n))
        return (0,)

    def cuMemcpyDtoD(self, dst: int, src: int, n: int) -> tuple[int]:
        assert self._inside(dst, n)
        self.copies.append(("dtod", dst, n))
        return (0,)

    def cuCtxSynchronize(self) -> tuple[int]:
        return (0,)

    # tensor maps: the documented limits of cuTensorMapEncodeTiled (no interleave; the 128-byte
    # swizzle takes an inner box of at most 128 bytes)
    CUtensorMapDataType = SimpleNamespace(CU_TENSOR_MAP_DATA_TYPE_UINT32="u32", CU_TENSOR_MAP_DATA_TYPE_UINT8="u8")
    CUtensorMapInterleave = SimpleNamespace(CU_TENSOR_MAP_INTERLEAVE_NONE="none")
    CUtensorMapSwizzle = SimpleNamespace(CU_TENSOR_MAP_SWIZZLE_NONE="none", CU_TENSOR_MAP_SWIZZLE_128B="128B")
    CUtensorMapL2promotion = SimpleNamespace(CU_TENSOR_MAP_L2_PROMOTION_L2_256B="256B")
    CUtensorMapFloatOOBfill = SimpleNamespace(CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE="none")
    cuuint64_t = cuuint32_t = staticmethod(int)

    def cuTensorMapEncodeTiled(self, dtype, rank, addr, dims, strides, box, estrides, interleave, swizzle, l2, oob):
        size = {"u32": 4, "u8": 1}[dtype]
        assert interleave == oob == "none" and swizzle in ("none", "128B") and 1 <= rank <= 5
        assert len(dims) == len(box) == len(estrides) == rank and len(strides) == rank - 1
        assert addr % 16 == 0 and all(0 < d <= 1 << 32 for d in dims)
        for i, st in enumerate(strides):
            assert st % 16 == 0 and st < 1 << 40, f"stride {i + 1}: {st}"
        # bytes up to the last element (the strides need not grow with the dims: the FP8-activation
        # maps take a group's row halves before the K halves, measured on the H200)
        extent = [size * dims[0] + sum(st * (d - 1) for st, d in zip(strides, dims[1:]))]
        assert all(0 < b <= 256 and b <= d for b, d in zip(box, dims)) and (size * box[0]) % 16 == 0
        assert swizzle == "none" or size * box[0] <= 128
        assert all(e == 1 for e in estrides)
        assert self._inside(addr, extent[-1]), "the tensor reaches past its allocation"
        self.maps.append((addr, tuple(dims), tuple(strides), tuple(box)))
        return 0, SimpleNamespace(opaque=[len(self.maps)] * 16)

    def _inside(self, ptr: int, n: int) -> bool:
        return any(base <= ptr and ptr + n <= base + size for base, size in self.live.items())


class FakeKernel(str):
    """A loaded kernel: its name, and its name as the driver's handle."""

    @property
    def handle(self) -> str:
        return str(self)


class Recorder:
    def __init__(self) -> None:
        self.launches: list[tuple[str, Any, tuple[Any, ...]]] = []

    def launch(self, stream: Any, config: Any, kernel: str, *args: Any) -> None:
        self.launches.append((kernel, config, args))


class FakeArray:
    """A device array as the runtime sees it through DLPack."""

    def __init__(self, shape: tuple[int, ...], dtype: str, ptr: int = 0x7000_0000_0000) -> None:
        self.v = View(ptr, shape, None, dtype, True, 0)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeDriver, Recorder]:
    drv, rec = FakeDriver(), Recorder()
    monkeypatch.setattr(runtime, "_driver", lambda: drv)
    monkeypatch.setattr(cuda.core, "launch", rec.launch)
    monkeypatch.setattr(cuda.core, "LaunchConfig", lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setattr(cuda.core, "ObjectCode", SimpleNamespace(from_cubin=lambda b: SimpleNamespace(
        get_kernel=FakeKernel)))
    real_view = runtime.view
    monkeypatch.setattr(runtime, "view", lambda o, name: o.v if isinstance(o, FakeArray) else real_view(o, name))
    return drv, rec


def _host_weights(plan: Any) -> dict[str, np.ndarray]:
    rng = np.random.default_rng()
    out = {}
    for name, (shape, dtype) in tensors(plan).items():
        if dtype == "uint8":  # MXFP4 codes (any byte) and E8M0 scales (up to what prefill GEMMs take)
            top = MX_PREFILL_MAX_SCALE + 1 if name.endswith("_scale") and plan.prefill_from else 255
            out[name] = rng.integers(0, top, shape, dtype=np.uint8)
        elif dtype == "int32":  # tid2eid: k distinct experts per row
            out[name] = rng.random((shape[0], plan.experts)).argsort(1)[:, : shape[1]].astype(np.int32)
        elif dtype == "float32" and name.endswith(("_scale", "_input_scale")):  # FP8 per-tensor: positive
            out[name] = rng.uniform(0.5, 2.0, shape).astype(np.float32)
        elif dtype == "float32":
            out[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            out[name] = rng.standard_normal(shape).astype(np.dtype(getattr(ml_dtypes, dtype)))
    for name in [n for n in out if n.endswith("gate_proj_input_scale")]:  # FP8 per-tensor: gate's and up's equal
        out[name.replace("gate_proj", "up_proj")] = out[name].copy()
    return out


def _layer(plan: Any) -> runtime.Layer:
    device = SimpleNamespace(device_id=0, set_current=lambda: None,
                             properties=SimpleNamespace(multiprocessor_count=132))
    return runtime.Layer(plan, b"", [k.name for k in plan.kernels], device=device)


# Small layers of the catalog's kinds (host weights of the real sizes would take minutes to make),
# and every rule of tests/test_features.py.
SMALL = {
    "shared_gate": {"experts": {"count": 64, "top_k": 10, "intermediate_size": 256},
                    "shared_expert": {"intermediate_size": 256, "gate": "sigmoid"}, "routing": {"renormalize": True}},
    "grouped": {"experts": {"count": 64, "top_k": 8, "intermediate_size": 256}, "shared_expert": {"intermediate_size": 256},
                "routing": {"score": "sigmoid", "correction_bias": True, "n_group": 8, "topk_group": 4,
                            "renormalize": True, "routed_scaling_factor": 2.5}},
    "fp8": {"experts": {"count": 16, "top_k": 4, "intermediate_size": 256, "format": "fp8_block"},
            "shared_expert": {"intermediate_size": 256, "format": "fp8_block"}},
    "prefill": {"experts": {"count": 16, "top_k": 2, "intermediate_size": 256}, "max_tokens": 1024},
}
SPECS = [(name, parse_spec({**BASE, **d}, check_generated=False)) for name, d in {**SMALL, **CASES}.items()]


def test_a_layer_without_a_device_is_a_typed_error(monkeypatch):
    """Where cuda.core finds no driver or device (its own exception types: a missing driver library,
    a failed cuInit), making a layer raises moegen's DeviceError, which names the cause; building
    needed no GPU, running does."""
    class NoDriver(Exception):
        pass

    def no_device() -> None:
        raise NoDriver("the driver library is not on this machine")

    monkeypatch.setattr(cuda.core, "Device", no_device)
    plan = make_plan(dict(SPECS)["shared_gate"])
    with pytest.raises(runtime.DeviceError, match=r"runs on an NVIDIA GPU.*NoDriver: the driver library is not"):
        runtime.Layer(plan, b"", [k.name for k in plan.kernels])


@pytest.mark.parametrize("case", SPECS, ids=lambda c: c[0])
def test_every_kernel_gets_every_pointer(fake_cuda, case):
    _check_pointers(fake_cuda, case[1], make_plan(case[1]))


@pytest.mark.parametrize("tuning", [Tuning(8, 1), Tuning(2, 4), Tuning(8, 2), Tuning(4, 2, True), Tuning(router_split=4)],
                         ids=str)
@pytest.mark.parametrize("name", ["shared_gate", "fp8", "mxfp4"])
def test_tuned_plans_get_every_pointer(fake_cuda, name, tuning):
    """Plans revised by moegen tune (other warps per block, other down tiles) launch as completely."""
    spec = dict(SPECS)[name]
    if name == "mxfp4" and tuning.down_tiles % 2:
        with pytest.raises(PlanError, match="FP4 tiles pair their matrices"):
            make_plan(spec, tuning=tuning)
        return
    plan = make_plan(spec, tuning=tuning)
    blocks = {ln.block for b in plan.buckets for ln in b.launches if "gate_up" in ln.kernel and "prefill" not in ln.kernel}
    assert 32 * tuning.warps in blocks and blocks <= {32 * w for w in (2, 4, 8)}  # fewer where a ring would not fit
    assert next(w for w in plan.weights if w.name == "w2").mats == tuning.down_tiles
    _check_pointers(fake_cuda, spec, plan)


def _check_pointers(fake_cuda, spec, plan) -> None:
    drv, rec = fake_cuda
    layer = _layer(plan)
    layer.load_weights(_host_weights(plan))
    assert drv.copies, "no weight reached the device"
    hashed = spec.routing.hash_vocab_size is not None
    for n in (1, 7, plan.max_tokens):
        rec.launches.clear()
        x = FakeArray((n, plan.hidden), "bfloat16")
        tid = FakeArray((n,), "int32", ptr=0x7100_0000_0000) if hashed else None
        layer(x, out=FakeArray((n, plan.hidden), "bfloat16", ptr=0x7200_0000_0000), stream=5, token_ids=tid)
        bucket = plan.buckets[layer._bucket_of[n]]
        assert [k for k, _, _ in rec.launches] == [ln.kernel for ln in bucket.launches]
        for kernel, _, args in rec.launches:
            k = plan.kernel(kernel)
            assert len(args) == len(k.params) == len(k.arg_keys)
            for key, arg in zip(k.arg_keys, args):
                needed = key in ("x", "out", "token_ids") or key.startswith("ws.") or (
                    key.startswith("w.") and key[2:] in {w.name for w in plan.weights} | {b.name for b in plan.raw}
                    | {w.scale_name for w in plan.weights if w.format != "bf16"})
                if needed:
                    assert int(arg) != 0, f"{kernel}: argument {key} is a null pointer"
            assert dict(zip(k.arg_keys, args)).get("n", n) == n
        for (kernel, config, _), ln in zip(rec.launches, bucket.launches):
            assert config.shmem_size == ln.smem
            if ln.smem > 0:  # asked for at load (48 KB in all, static included, otherwise)
                assert drv.smem[kernel] >= ln.smem, f"{kernel}: {ln.smem} bytes of shared memory not allowed"


def test_layers_of_one_compiled_output_share_their_loaded_code(fake_cuda):
    """Two layers of the same cubins on one device share the loaded modules and kernels (one copy
    of the code for a model's layers), asking for the shared memory allowance once; other cubins,
    or the same on another device, get their own; the code is released with its last layer."""
    drv, _ = fake_cuda
    plan = make_plan(dict(SPECS)["shared_gate"])
    names = [k.name for k in plan.kernels]

    def layer(cubin: bytes, device_id: int = 0) -> runtime.Layer:
        device = SimpleNamespace(device_id=device_id, set_current=lambda: None,
                                 properties=SimpleNamespace(multiprocessor_count=132))
        return runtime.Layer(plan, cubin, names, device=device)

    a = layer(b"code one")
    asked = dict(drv.smem)
    b = layer(b"code one")
    assert b._kernels is a._kernels and b._code is a._code and drv.smem == asked
    c, d = layer(b"code two"), layer(b"code one", device_id=1)
    assert c._code is not a._code and d._code is not a._code
    key = next(k for k, v in runtime._CODE.items() if v is a._code)
    del a, b
    assert key not in runtime._CODE


def test_one_token_is_one_cooperative_launch_where_its_down_share_fits(fake_cuda):
    """The N = 1 bucket of a BF16 layer whose down goes by columns (no down rows in shared memory),
    or whose 16 down rows per chosen expert fit in a block's shared memory, is one kernel, launched
    cooperatively on one block per multiprocessor of the device, with its shared memory allowed at
    load; other layers (OLMoE by rows, whose 256 KB of rows do not fit; Qwen2-57B-A14B, whose hidden
    size does not split into whole column chunks a warp) and the tunings single=False and, for an
    FP8 layer, single_fp8=False, and batch_invariant specs (one reduction order for every N) keep
    the three kernels."""
    drv, rec = fake_cuda
    qwen = load_spec(ROOT / "specs" / "qwen3-30b-a3b.yaml")
    (ln,) = make_plan(qwen).buckets[0].launches
    assert make_plan(qwen).kernel(ln.kernel).family == "single" and ln.grid == ("sms", 1) and ln.coop
    # down by columns: no down rows in shared memory, only the gate/up sums (3 units x 16 warps x 32 floats)
    assert "_cols" in ln.kernel and 6 * 1024 <= ln.smem < 16 * 1024
    (rows,) = make_plan(qwen, tuning=Tuning(single_cols=False)).buckets[0].launches
    assert 192 * 1024 < rows.smem <= 227 * 1024  # by rows: 8 experts x 16 rows x 768 of down, and the activations
    olmoe = load_spec(ROOT / "specs" / "olmoe-1b-7b.yaml")
    assert "_cols" in make_plan(olmoe).buckets[0].launches[0].kernel
    for spec, tuning in ((qwen, Tuning(single=False)), (olmoe, Tuning(single_cols=False)),
                         (load_spec(ROOT / "specs" / "qwen2-57b-a14b.yaml"), None),
                         (load_spec(ROOT / "specs" / "qwen3-30b-a3b-fp8.yaml"), Tuning(single_fp8=False)),
                         (parse_spec({**qwen.model_dump(mode="json", exclude_none=True), "batch_invariant": True},
                                     check_generated=False), None)):
        p = make_plan(spec, tuning=tuning)
        assert [p.kernel(x.kernel).family for x in p.buckets[0].launches][-3:] == ["router", "gate_up", "down"]
    plan = make_plan(dict(SPECS)["shared_gate"])  # 64 experts, top-10, a gated shared expert
    (ln,) = plan.buckets[0].launches
    # (its N = 2 bucket: the two-token kernel, test_two_tokens_are_one_launch_where_a_group_takes_few_units)
    assert all(plan.kernel(x.kernel).family != "single" for b in plan.buckets[2:] for x in b.launches)
    layer = _layer(plan)
    layer.load_weights(_host_weights(plan))
    rec.launches.clear()  # the packing's
    layer(FakeArray((1, plan.hidden), "bfloat16"), out=FakeArray((1, plan.hidden), "bfloat16", ptr=0x7200_0000_0000),
          stream=5)
    (kernel, config, args), = rec.launches
    assert kernel == ln.kernel and config.grid == (132, 1) and config.is_cooperative
    assert config.shmem_size == ln.smem and drv.smem[kernel] >= ln.smem
    assert all(int(a) != 0 for a, key in zip(args, plan.kernel(kernel).arg_keys)
               if key not in ("w.corr_bias", "w.router_bias", "w.s13", "w.ss13", "w.s2", "w.ss2",  # BF16: no scales
                              "w.tmaps"))


def test_two_tokens_are_one_launch_where_a_group_takes_few_units(fake_cuda):
    """The N = 2 bucket of a layer whose one-token kernel goes down by columns with at most 4 units a
    group (8 unit-token pairs, moegen.single.SINGLE_TWO_PAIRS) is the same kernel for two tokens (`_x2`,
    its template argument NTOK 2), launched cooperatively on one block per multiprocessor; its
    workspace holds both tokens' tagged logits and partial sums. Layers of 6 units a group
    (DeepSeek-V2-Lite) and the tuning single_two=False keep router, gate/up and down; N = 4 never
    takes it."""
    from moegen.families import Tuning

    drv, rec = fake_cuda
    for name in ("qwen3-30b-a3b", "qwen3-next-80b-a3b", "olmoe-1b-7b"):
        plan = make_plan(load_spec(ROOT / "specs" / f"{name}.yaml"))
        one, two = (plan.kernel(b.launches[-1].kernel) for b in plan.buckets[:2])
        (ln,) = plan.buckets[1].launches
        assert two.family == "single" and "_x2_" in two.name and ln.coop and ln.grid == ("sms", 1), name
        # (targs end: ..., VB, NTOK, BROUTE: the block's route at one token only)
        assert two.targs[-2] == "2" and one.targs[-2] == "1" and two.targs[:-2] == one.targs[:-2], name
        assert two.targs[-1] == "false", name
        vb, ks = int(one.targs[-3]), int(one.targs[11])
        ws = {b.name: b.shape for b in plan.workspace}
        assert ws["spart"] == (2 * vb, plan.hidden) and ws["stl"][0] >= 2 * ks, name
        assert all(plan.kernel(x.kernel).family != "single" for b in plan.buckets[2:] for x in b.launches), name
    for spec, tuning in ((load_spec(ROOT / "specs" / "deepseek-v2-lite.yaml"), None),
                         (load_spec(ROOT / "specs" / "qwen3-30b-a3b.yaml"), Tuning(single_two=False))):
        p = make_plan(spec, tuning=tuning)
        assert [p.kernel(x.kernel).family for x in p.buckets[1].launches][-3:] == ["router", "gate_up", "down"]
    plan = make_plan(dict(SPECS)["shared_gate"])  # 64 experts, top-10, a gated shared expert: 2 units a group
    (ln,) = plan.buckets[1].launches
    layer = _layer(plan)
    layer.load_weights(_host_weights(plan))
    rec.launches.clear()  # the packing's
    layer(FakeArray((2, plan.hidden), "bfloat16"), out=FakeArray((2, plan.hidden), "bfloat16", ptr=0x7200_0000_0000),
          stream=5)
    (kernel, config, _), = rec.launches
    assert kernel == ln.kernel and "_x2_" in kernel and config.grid == (132, 1) and config.is_cooperative
    assert config.shmem_size == ln.smem and drv.smem[kernel] >= ln.smem


def test_the_one_token_kernel_routes_with_the_whole_block_where_no_shared_expert_streams_meanwhile():
    """Down by columns at one token, a layer without a shared expert and with at most 128 experts
    (each ranked directly) routes with the whole block (route_block, `_br`, the kernel's last
    template argument true); with a shared expert (whose first units some groups stream while
    warp 0 routes) or more experts, with warp 0's route_one. The tuning overrides either
    way where route_block takes the rule, and never reaches the two-token kernel or a rule it does
    not take (a softmax ahead of a correction bias)."""
    from moegen.families import Tuning

    def single(name, tuning=None):
        plan = make_plan(load_spec(ROOT / "specs" / f"{name}.yaml"), tuning=tuning)
        return plan.kernel(plan.buckets[0].launches[-1].kernel)

    for name, block in (("mixtral-8x7b", True), ("qwen3-30b-a3b", True), ("olmoe-1b-7b", True),
                        ("qwen3-235b-a22b", True), ("qwen3-coder-480b-a35b", False),  # 128 / 160 experts
                        ("qwen3-next-80b-a3b", False), ("deepseek-v2-lite", False), ("glm-4.5-air", False)):
        k = single(name)
        assert k.family == "single" and ("_br_" in k.name) == block and k.targs[-1] == str(block).lower(), name
    assert "_br_" in single("qwen3-next-80b-a3b", Tuning(single_block_route=True)).name
    assert "_br_" not in single("qwen3-30b-a3b", Tuning(single_block_route=False)).name
    plan = make_plan(load_spec(ROOT / "specs" / "qwen3-30b-a3b.yaml"))
    assert plan.kernel(plan.buckets[1].launches[-1].kernel).targs[-1] == "false"  # the two-token kernel
    spec = parse_spec({**BASE, "experts": {"count": 64, "top_k": 8, "intermediate_size": 256},
                       "routing": {"correction_bias": True}}, check_generated=False)  # softmax, then the bias
    plan = make_plan(spec, tuning=Tuning(single_block_route=True))
    k = plan.kernel(plan.buckets[0].launches[-1].kernel)
    assert k.family == "single" and "_cols_" in k.name and "_br_" not in k.name and k.targs[-1] == "false"


def test_one_token_kernel_with_tagged_words_or_barriers_compiles_and_launches(fake_cuda):
    """The one-token kernel with tagged words (the partial logits and the activations written with
    the call's epoch and read until every one is this call's; the analytic plan's), with grid
    barriers (tuning single_tags false), with the route overlapped with the first gate/up loads
    (single_overlap, the analytic plan's) and without, and down by columns (single_cols, the
    analytic plan's for BF16), compiles without spills for both catalog layers that take it, fits
    its shared memory, and gets its tagged buffers."""
    from moegen.build import render_all
    from moegen.nvrtc import compile_cuda

    for name, tags, ov, cols in (("qwen3-30b-a3b", True, True, False), ("qwen3-next-80b-a3b", True, True, False),
                                 ("qwen3-30b-a3b", False, False, False), ("qwen3-next-80b-a3b", True, False, False),
                                 ("qwen3-30b-a3b", True, True, True), ("qwen3-next-80b-a3b", True, True, True)):
        spec = load_spec(ROOT / "specs" / f"{name}.yaml")
        plan = make_plan(spec, tuning=Tuning(single_tags=tags, single_overlap=ov, single_tmap=True, single_cols=cols))
        (ln,) = plan.buckets[0].launches
        k = plan.kernel(ln.kernel)
        assert ("_barriers_" in k.name) != tags and ("_ov_" in k.name) == ov
        assert ("_cols_" in k.name) == cols and ("_tmap_" in k.name) != cols  # down by columns copies no rows
        assert k.arg_keys[-5:] == ("ws.stl", "ws.stact", "ws.sepoch", "ws.spart", "w.tmaps")
        res = compile_cuda(render_all(spec, plan)["layer.cu"], plan.arch).resources[k.name]
        assert res.spill_stores == res.spill_loads == res.stack_bytes == 0
        assert ln.smem + res.smem_bytes <= 227 * 1024
    for tuning in (Tuning(single_tags=False), Tuning(single_overlap=False, single_tmap=True)):
        _check_pointers(fake_cuda, dict(SPECS)["shared_gate"], make_plan(dict(SPECS)["shared_gate"], tuning=tuning))


def _box(words: np.ndarray, m: Any, coords: tuple[int, ...]) -> np.ndarray:
    """What a TMA copy of map m's box at `coords` reads from `words` (32-bit elements): the box's
    elements, innermost dimension fastest, each at sum((coord + i) * stride) bytes."""
    offsets = np.zeros((), np.int64)
    for d in reversed(range(len(m.dims))):  # outermost first: the box is stored in that order
        step = 4 if d == 0 else m.strides[d - 1]
        offsets = offsets[..., None] + (coords[d] + np.arange(m.box[d])) * step
    return words[offsets.reshape(-1) // 4]


def test_one_token_tensor_maps_read_what_one_copy_per_piece_reads():
    """The one-token kernel's tensor maps (tuning single_tmap, where a down row group packs two
    tiles) span each packed down weight exactly, and one box at (tile mt, row group, expert) holds,
    in order, the pieces the kernel's bulk copies take one by one (chunk c at
    (((e * groups + group) * chunks + c) * tiles + mt) pieces): emulated with NumPy on words that
    are their own indices."""
    from moegen.weights import packed_nbytes

    for name in ("qwen3-30b-a3b", "qwen3-next-80b-a3b", "qwen3-30b-a3b-fp8"):
        spec = load_spec(ROOT / "specs" / f"{name}.yaml")
        plan = make_plan(spec, tuning=Tuning(single_tmap=True, single_cols=False))  # (down by columns copies no rows)
        assert [m.weight for m in plan.tensor_maps] == ["w2"] + (["ws2"] if plan.shared_inter else [])
        for m in plan.tensor_maps:
            pw = next(w for w in plan.weights if w.name == m.weight)
            total = packed_nbytes(pw)
            assert m.strides[-1] * m.dims[-1] == total
            words = np.arange(total // 4, dtype=np.int64)
            tiles, chunks, piece = pw.mats, pw.cols // 32, 16 * 32 * (1 if pw.format == "fp8_block" else 2)
            groups, experts = pw.rows_padded // (16 * tiles), max(pw.experts, 1)
            for e in {0, experts - 1}:
                for group in {0, groups - 1}:
                    for mt in range(tiles):
                        got = _box(words, m, (0, mt, 0, group) + ((e,) if pw.experts else ()))
                        want = np.concatenate([words[(((e * groups + group) * chunks + c) * tiles + mt) * piece // 4:][:piece // 4]
                                               for c in range(chunks)])
                        assert np.array_equal(got, want), (name, m.weight, e, group, mt)


def test_tensor_maps_are_encoded_over_each_layers_own_weights(fake_cuda):
    """A layer's tensor maps point into its own packed weights, also when its weights are a device
    copy of another layer's (moegen bench's stacks): encoded again over the copy."""
    drv, _ = fake_cuda
    spec = dict(SPECS)["shared_gate"]
    plan = make_plan(spec, tuning=Tuning(single_tmap=True, single_cols=False))
    assert [m.weight for m in plan.tensor_maps] == ["w2", "ws2"]
    first, second = _layer(plan), _layer(plan)
    first.load_weights(_host_weights(plan))
    second.load_weights_from(first)
    for layer, maps in ((first, drv.maps[:2]), (second, drv.maps[2:])):
        assert [a for a, *_ in maps] == [layer._weights.ptr("w2"), layer._weights.ptr("ws2")]
    assert len(drv.maps) == 4



def test_token_code_maps_are_encoded_over_each_layers_own_workspace(fake_cuda):
    """The FP8-activation GEMMs' maps over their token codes (prefill_plan.a8_tensor_maps) point into
    the layer's own workspace, bytes in the 128-byte swizzle; the weights' maps into its weights,
    also for a layer whose weights are a device copy of another's."""
    drv, _ = fake_cuda
    plan = make_plan(dict(SPECS)["fp8_activations"])
    on_ws = [m for m in plan.tensor_maps if m.workspace]
    assert [m.weight for m in on_ws] == ["xq", "actq", "actq_s"] and all(m.elem == 1 and m.swizzle == 128 for m in on_ws)
    first, second = _layer(plan), _layer(plan)
    first.load_weights(_host_weights(plan))
    second.load_weights_from(first)
    count = len(plan.tensor_maps)
    assert len(drv.maps) == 2 * count
    for layer, maps in ((first, drv.maps[:count]), (second, drv.maps[count:])):
        want = [(layer.workspace if m.workspace else layer._weights).ptr(m.weight) for m in plan.tensor_maps]
        assert [a for a, *_ in maps] == want
    assert first.workspace.ptr("xq") != second.workspace.ptr("xq")

def test_layer_in_parts_takes_each_kernel_from_its_part(fake_cuda, monkeypatch):
    """A layer compiled in parts loads one module per cubin and takes each kernel from its part's."""
    import cuda.core

    monkeypatch.setattr(cuda.core, "ObjectCode", SimpleNamespace(from_cubin=lambda b: SimpleNamespace(
        get_kernel=lambda name: FakeKernel(f"{b.decode()}:{name}"))))
    plan = make_plan(dict(SPECS)["shared_gate"])
    assert plan.parts == 2
    device = SimpleNamespace(device_id=0, set_current=lambda: None,
                             properties=SimpleNamespace(multiprocessor_count=132))
    layer = runtime.Layer(plan, (b"part0", b"part1"), [k.name for k in plan.kernels], device=device)
    assert all(layer._kernels[k.name] == f"part{k.part}:{k.name}" for k in plan.kernels)


def test_one_token_kernel_for_fp8_block_weights_compiles_and_launches(fake_cuda):
    """The one-token bucket of an FP8 block layer is the one-token kernel on e4m3 codes and block
    scales (the tuning single_fp8 false: four launches): it compiles without spills, fits its shared
    memory (512-byte down pieces), and gets every scale; a synthetic FP8 layer with a shared
    expert launches it completely."""
    from moegen.build import render_all
    from moegen.nvrtc import compile_cuda

    spec = load_spec(ROOT / "specs" / "qwen3-30b-a3b-fp8.yaml")
    off = make_plan(spec, tuning=Tuning(single_fp8=False))
    assert off.kernel(off.buckets[0].launches[0].kernel).family != "single"
    plan = make_plan(spec)
    (ln,) = plan.buckets[0].launches
    k = plan.kernel(ln.kernel)
    assert k.family == "single" and k.name.endswith("_fp8_block_sm_90a")
    assert {"w.s13", "w.s2"} <= set(k.arg_keys)
    res = compile_cuda(render_all(spec, plan)["layer.cu"], plan.arch).resources[k.name]
    assert res.spill_stores == res.spill_loads == res.stack_bytes == 0
    assert ln.smem + res.smem_bytes <= 227 * 1024
    small = dict(SPECS)["fp8"]
    splan = make_plan(small)
    assert splan.kernel(splan.buckets[0].launches[0].kernel).family == "single"
    _check_pointers(fake_cuda, small, splan)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_one_token_kernel_for_fp4_weights_compiles_and_launches(fake_cuda, fmt):
    """The one-token bucket of an MXFP4 or NVFP4 layer is the one-token kernel on e2m1 codes and
    their row scales, a block's down rows a whole packed row group (32 rows, with their scales in
    the same bulk copies; the tuning single_fp4 false, or one down tile a group: four launches):
    it compiles without spills, fits its shared memory, and gets every scale; the small layer of
    the format with a shared expert launches it completely."""
    from moegen.build import render_all
    from moegen.nvrtc import compile_cuda

    spec = load_spec(ROOT / "specs" / f"qwen3-30b-a3b-{fmt}.yaml")
    for tuning in (Tuning(single_fp4=False), Tuning(down_tiles=4)):
        off = make_plan(spec, tuning=tuning)
        assert off.kernel(off.buckets[0].launches[0].kernel).family != "single"
    plan = make_plan(spec)
    (ln,) = plan.buckets[0].launches
    k = plan.kernel(ln.kernel)
    assert k.family == "single" and k.name.endswith(f"_{fmt}_sm_90a") and not plan.tensor_maps
    assert {"w.s13", "w.s2"} <= set(k.arg_keys)
    res = compile_cuda(render_all(spec, plan)["layer.cu"], plan.arch).resources[k.name]
    assert res.spill_stores == res.spill_loads == res.stack_bytes == 0
    assert ln.smem + res.smem_bytes <= 227 * 1024
    small = dict(SPECS)[fmt]
    splan = make_plan(small)
    assert splan.kernel(splan.buckets[0].launches[0].kernel).family == "single"
    _check_pointers(fake_cuda, small, splan)


@pytest.mark.parametrize("path", sorted((ROOT / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_prefill_launches_with_programmatic_dependence_wait_for_the_kernel_before(path):
    """A kernel launched with programmatic dependence may start before the one before it ends: every
    prefill kernel so launched waits for it (its wrapper's griddepcontrol.wait, Kernel.dep), first,
    or last where its body reads nothing this call wrote (X', x's codes a row per token): that one
    comes right after the router, whose body waits first, so every kernel it starts beside has its
    inputs, and its own end still implies the router's for the kernel after it."""
    plan = make_plan(load_spec(path))
    seen = 0
    for b in plan.buckets:
        ks = [plan.kernel(ln.kernel) for ln in b.launches]
        for i, (ln, k) in enumerate(zip(b.launches, ks)):
            if not k.family.startswith("prefill_"):
                assert k.dep == "", k.name  # (the other families' bodies wait themselves)
                continue
            assert not ln.pdl or k.dep in ("first", "last"), (b.max_tokens, k.name)
            if k.dep == "last":
                seen += 1
                assert ln.pdl and ks[i - 1].family == "router" and b.launches[i + 1].pdl, (b.max_tokens, k.name)
            if "gemm" in k.family or k.family == "prefill_combine":
                assert not ln.pdl and k.dep == "", (b.max_tokens, k.name)  # (measured slower with it)
    assert seen or not plan.prefill_from or any(k.family == "prefill_quant" and "fp8t" in k.name for k in plan.kernels)


def test_prefill_buckets_launch_the_grouped_gemms(fake_cuda):
    """From the plan's crossover (the first bucket whose every N gives the experts 10 tokens each) the
    buckets run the prefill kernels after the route (its K-split router replaced by one that
    splits the tokens; the one route kernel groups the tokens up to the largest decode bucket
    only, here 128), the GEMMs with their shared
    memory (the analytic plan's with a producer warpgroup; the tuning without one launches them as
    completely)."""
    plan = make_plan(dict(SPECS)["prefill"])
    assert plan.prefill_from == 256  # 16 experts, top-2: 10 tokens each from N = 80, the bucket of 129..256
    assert [b.max_tokens for b in plan.buckets if b.max_tokens >= plan.prefill_from] == [256, 512, 1024]
    fams = [plan.kernel(ln.kernel).family for ln in plan.buckets[-1].launches]
    # X' needs no routing: it runs beside the router, its wait at its end (prefill_pdl)
    assert fams == ["router", "prefill_permute", "route", "prefill_count", "prefill_scan", "prefill_place",
                    "prefill_gemm_gate_up", "prefill_gemm_down", "prefill_combine"]
    # programmatic dependence up to the GEMMs, each of those kernels waiting for the one before
    assert [ln.pdl for ln in plan.buckets[-1].launches] == [True] * 6 + [False] * 3
    deps = [plan.kernel(ln.kernel).dep for ln in plan.buckets[-1].launches]
    assert deps == ["", "last", "", "first", "first", "first", "", "", ""]
    names = [ln.kernel for ln in plan.buckets[-1].launches]
    assert "_ks1_" in names[0] and names[2].endswith("_g128_sm_90a")
    plain = make_plan(dict(SPECS)["prefill"], tuning=Tuning(prefill_pdl=False))  # the order before, no PDL
    assert [plain.kernel(ln.kernel).family for ln in plain.buckets[-1].launches] == [fams[0], fams[2], fams[1], *fams[3:]]
    assert [ln.pdl for ln in plain.buckets[-1].launches] == [True, True] + [False] * 7
    decode_routes = {ln.kernel for b in plan.buckets[:-3] for ln in b.launches if plan.kernel(ln.kernel).family == "route"}
    assert decode_routes == {names[2]}  # the decode buckets' route is the same kernel
    assert all("prefill" not in plan.kernel(ln.kernel).family for b in plan.buckets[:-3] for ln in b.launches)
    _check_pointers(fake_cuda, dict(SPECS)["prefill"], plan)
    assert plan.prefill_tiles[3] and any("_ws_" in k.name for k in plan.kernels)  # the producer warpgroup's
    plain = make_plan(dict(SPECS)["prefill"], tuning=Tuning(prefill_ws=False))
    assert not plain.prefill_tiles[3] and not any("_ws_" in k.name for k in plain.kernels)
    # the weight runs by bulk copies (the analytic plan's: both GEMMs, the down GEMM on row groups)
    gemm_kernels = [plan.kernel(ln.kernel) for ln in plan.buckets[-1].launches if "gemm" in plan.kernel(ln.kernel).family]
    assert all("_bulk" in k.name and k.targs[-1] == "true" for k in gemm_kernels), [k.name for k in gemm_kernels]
    cp = make_plan(dict(SPECS)["prefill"], tuning=Tuning(prefill_bulk_a=False))
    assert not any("_bulk" in k.name or len(k.targs) > 6 and k.targs[6] == "true" for k in cp.kernels if "gemm" in k.family)
    _check_pointers(fake_cuda, dict(SPECS)["prefill"], cp)
    _check_pointers(fake_cuda, dict(SPECS)["prefill"], plain)
    small = make_plan(dict(SPECS)["prefill"], tuning=Tuning(prefill_bm=64, prefill_stages=3, prefill_ws=False))
    gemms = [ln for ln in small.buckets[-1].launches if "gemm" in small.kernel(ln.kernel).family]
    assert small.prefill_tiles == (64, 128, 3, False, 0, False, False, False, False, "", False, False)
    assert {ln.block for ln in gemms} == {128}
    assert all(ln.smem <= 228 * 1024 // 2 for ln in gemms)  # two blocks a multiprocessor
    _check_pointers(fake_cuda, dict(SPECS)["prefill"], small)


def test_prefill_with_a_shared_expert(fake_cuda):
    """A BF16 shared expert (with its sigmoid gate) gets prefill buckets unless the tuning keeps it
    on the GEMV path (prefill_shared=False): its GEMM pair runs over every token after the routed
    experts' and the combine adds gate * YS, every pointer given."""
    spec = parse_spec({**BASE, "experts": {"count": 64, "top_k": 8, "intermediate_size": 256},
                       "shared_expert": {"intermediate_size": 256, "gate": "sigmoid"}, "max_tokens": 512},
                      check_generated=False)
    assert make_plan(spec, tuning=Tuning(prefill_shared=False)).prefill_from == 0
    plan = make_plan(spec)
    assert plan.prefill_from == 256  # 64 experts, top-8: 10 tokens each from N = 80
    fams = [plan.kernel(ln.kernel).family for ln in plan.buckets[-1].launches]
    assert fams[-3:] == ["prefill_gemm_gate_up_shared", "prefill_gemm_down_shared", "prefill_combine"]
    combine = plan.kernel(plan.buckets[-1].launches[-1].kernel)
    assert combine.arg_keys[-2:] == ("ws.ys", "ws.gate_s") and combine.name.endswith("_sgate_sm_90a")
    _check_pointers(fake_cuda, spec, plan)


def test_numpy_scalars_are_0d_weights(fake_cuda):
    """A per-matrix scale given as a NumPy scalar (a shared expert's NVFP4 scale_2, as loaders
    index it out of a [1] tensor) is a 0-d host array, not a foreign object."""
    drv, _ = fake_cuda
    plan = make_plan(dict(SPECS)["nvfp4"])
    w = _host_weights(plan)
    for k in [k for k in w if k.startswith("shared_expert.") and k.endswith("_scale_2")]:
        w[k] = np.float32(w[k])
        assert not isinstance(w[k], np.ndarray)
    _layer(plan).load_weights(w)
    assert drv.copies


def test_hash_layers_need_token_ids(fake_cuda):
    plan = make_plan(parse_spec({**BASE, **CASES["hash"]}, check_generated=False))
    layer = _layer(plan)
    layer.load_weights(_host_weights(plan))
    x = FakeArray((3, plan.hidden), "bfloat16")
    with pytest.raises(ArrayError, match="token_ids: this layer is hash-routed"):
        layer(x)
    with pytest.raises(ArrayError, match="token_ids: dtype int64, expected int32"):
        layer(x, token_ids=FakeArray((3,), "int64"))


@pytest.mark.parametrize("case", SPECS, ids=lambda c: c[0])
def test_random_weights_load_in_every_format(fake_cuda, case):
    """moegen.samples' random weights (`moegen check` without a checkpoint, the GPU tests) are what
    the layer takes in every format and rule (it packs and checks them: FP4 codes and scales, FP8
    block and per-tensor scales, the hash table), and what they give the reference is each
    quantized weight's value as its format defines it, an expert at a time. Drawn here on the CPU."""
    torch = pytest.importorskip("torch")
    from moegen.formats import FP8BlockWeight, MXFP4Weight, NVFP4Weight
    from moegen.samples import host_bf16, random_weights

    _, spec = case
    plan = make_plan(spec)
    given, ref = random_weights(plan, device="cpu")
    _layer(plan).load_weights({k: host_bf16(v) if isinstance(v, torch.Tensor) else v for k, v in given.items()})
    for name, (shape, dtype) in tensors(plan).items():
        stacked = len(shape) == 3 and dtype != "int32"  # an expert axis: the last expert's matrix is checked
        g, at = given.get(name), (lambda a: a[plan.experts - 1]) if stacked else (lambda a: np.asarray(a))
        if dtype == "uint8" and not name.endswith("_scale"):
            k = 2 * shape[-1]
            if f"{name}_scale_2" in given:
                value = NVFP4Weight(at(g), at(given[f"{name}_scale"]), at(given[f"{name}_scale_2"])[..., None],
                                    (shape[-2],), k).dequantize()
            else:
                value = MXFP4Weight(at(g), at(given[f"{name}_scale"]), k).dequantize()
            np.testing.assert_array_equal(at(ref[name]), value)
            assert len(np.unique(g)) > 200  # codes drawn over every byte
        elif f"{name}_input_scale" in given:
            np.testing.assert_array_equal(at(ref[name]), at(g).astype(np.float64) * at(given[f"{name}_scale"]))
            assert (given[f"{name}_input_scale"] > 0).all()
        elif f"{name}_scale_inv" in given:  # FP8 128x128 blocks: every block's amax is 448 steps
            np.testing.assert_array_equal(at(ref[name]), FP8BlockWeight(at(g), at(given[f"{name}_scale_inv"])).dequantize())
            blocks = np.abs(at(g).astype(np.float32)).reshape(shape[-2] // 128, 128, shape[-1] // 128, 128)
            assert (blocks.max(axis=(1, 3)) == 448).all()
        elif dtype == "int32":
            t = given[name]
            assert ((0 <= t) & (t < plan.experts)).all() and all(len(set(row)) == len(row) for row in t.tolist())
        elif dtype == "bfloat16":
            np.testing.assert_array_equal(ref[name], host_bf16(g))
            assert np.asarray(ref[name], np.float32).std() > 0
    gate, up = (f"experts.{m}_proj_input_scale" for m in ("gate", "up"))
    if gate in given:
        np.testing.assert_array_equal(given[gate], given[up])  # the kernels quantize x once for both
    if spec.routing.hash_vocab_size is None:
        assert not any(d == "int32" for _, d in tensors(plan).values())


def test_bench_and_check_give_hash_routed_layers_token_ids():
    """`moegen bench`, `tune` and `check` call hash-routed layers with random token ids in the
    vocabulary (int32, one a token), the other layers with none."""
    from moegen.bench import token_ids_host

    rng = np.random.default_rng()
    hashed, plain = dict(SPECS)["hash"], dict(SPECS)["shared_gate"]
    ids = token_ids_host(hashed, 300, rng)
    vocab = hashed.routing.hash_vocab_size
    assert ids.dtype == np.int32 and ids.shape == (300,) and ((0 <= ids) & (ids < vocab)).all()
    assert len(set(ids.tolist())) > 1
    assert token_ids_host(plain, 300, rng) is None


@pytest.mark.parametrize("row, why", [([3, 3, 1, 2, 4, 5], "distinct"), ([0, 1, 2, 3, 4, 64], r"in \[0, 64\)"),
                                      ([-1, 1, 2, 3, 4, 5], r"in \[0, 64\)")])
def test_hash_table_is_checked_at_load(fake_cuda, row, why):
    """A table row the kernels could not use (an expert twice, one outside [0, E)) is refused
    before anything reaches the device, naming the tensor and the row."""
    drv, _ = fake_cuda
    plan = make_plan(parse_spec({**BASE, **CASES["hash"]}, check_generated=False))
    w = _host_weights(plan)
    w["tid2eid"][17] = row
    layer = _layer(plan)
    before = dict(drv.live)  # the layer's workspace
    with pytest.raises(WeightError, match=f"tid2eid: row 17 is .*{why}"):
        layer.load_weights(w)
    assert drv.live == before and not drv.copies, "a refused load left device memory or copies behind"


def test_allreduce_runs_after_the_kernels_on_the_same_stream(fake_cuda):
    _, rec = fake_cuda
    spec = parse_spec({**BASE, "experts": {"count": 16, "top_k": 2, "intermediate_size": 512},
                       "parallel": {"ep_size": 2, "ep_rank": 1}}, check_generated=False)
    plan = make_plan(spec)
    layer = _layer(plan)
    layer.load_weights(_host_weights(plan))
    seen = []

    def allreduce(out: Any, stream: int) -> None:
        seen.append((len(rec.launches), stream, out))

    allreduce.ranks = 2
    layer.set_allreduce(allreduce)
    out = FakeArray((4, plan.hidden), "bfloat16", ptr=0x7300_0000_0000)
    layer(FakeArray((4, plan.hidden), "bfloat16"), out=out, stream=9)
    assert seen == [(len(rec.launches), 9, out)]


def test_close_frees_everything(fake_cuda):
    drv, _ = fake_cuda
    plan = make_plan(SPECS[0][1])
    layer = _layer(plan)
    layer.load_weights(_host_weights(plan))
    layer.close()
    assert drv.live == {}, "device memory left allocated"
    with pytest.raises(RuntimeError, match="no weights"):
        layer(FakeArray((1, plan.hidden), "bfloat16"))


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4"])
@pytest.mark.parametrize("per_expert", [False, True])
def test_codes_packed_by_expert_chunks_equal_one_pack(fmt, per_expert):
    """The runtime packs quantized codes a few experts at a time on threads: the result is the
    whole-array pack, for stacked and for per-expert tensors, with a last chunk that is short."""
    from moegen import weights as W
    from moegen.formats import unpack_nibbles

    spec = parse_spec({**BASE, "experts": {"count": 19, "top_k": 2, "intermediate_size": 256, "format": fmt}})
    plan = make_plan(spec)
    pw = next(w for w in plan.weights if w.name == "w13")
    rng = np.random.default_rng()  # FP8: finite codes (the packer refuses e4m3 NaN)
    codes = {src: rng.integers(0, 256, tensors(plan)[src][0], dtype=np.uint8) & (0xFE if fmt == "fp8_block" else 0xFF)
             for src in pw.sources}
    pieces = {src: [(f"{src}.{e}", c[e]) for e in range(len(c))] if per_expert else [(src, c)]
              for src, c in codes.items()}
    pack = W.pack_fp8 if fmt == "fp8_block" else (
        lambda p, c: W.pack_fp4(p, {k: unpack_nibbles(v) for k, v in c.items()}))
    want = pack(pw, codes)
    got = runtime._by_experts(pieces, pw.sources, lambda c: pack(pw, c), step=4)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_fp8_tensor_scales_must_be_positive(fake_cuda):
    """A zero or negative per-tensor scale would silently flip or zero a matrix: refused at load,
    naming the tensors, before anything reaches the device."""
    drv, _ = fake_cuda
    plan = make_plan(dict(SPECS)["fp8_tensor"])
    w = _host_weights(plan)
    w["experts.up_proj_input_scale"][3] = 0.0
    layer = _layer(plan)
    with pytest.raises(WeightError, match="experts.up_proj_scale / experts.up_proj_input_scale: expected finite positive"):
        layer.load_weights(w)
    assert not drv.copies


def test_weights_copied_from_another_layer(fake_cuda):
    """load_weights_from: one device-to-device copy of the other layer's packed weights into an
    allocation of this layer's own, the same offsets (then the tensor maps over the copy, where
    the plan has them); refused where the packed layouts differ or without weights."""
    drv, _ = fake_cuda
    plan = make_plan(SPECS[0][1])
    a, b = _layer(plan), _layer(plan)
    with pytest.raises(RuntimeError, match="no weights"):
        b.load_weights_from(a)
    a.load_weights(_host_weights(plan))
    drv.copies.clear()
    b.load_weights_from(a)
    maps = [("htod", b._weights.ptr("tmaps"), 128 * len(plan.tensor_maps))] if plan.tensor_maps else []
    assert drv.copies == [("dtod", b._weights.base, a._weights.size)] + maps
    assert b._weights.base != a._weights.base and b._weights.offsets == a._weights.offsets
    other = _layer(make_plan(SPECS[1][1]))
    with pytest.raises(ValueError, match="another layout"):
        other.load_weights_from(a)
    # a tuning that changes only kernels (the prefill GEMMs' ring) packs the weights alike
    ring = _layer(make_plan(SPECS[0][1], tuning=Tuning(prefill_stages=3)))
    assert ring.plan != plan
    ring.load_weights_from(a)
    for layer in (a, b, other, ring):
        layer.close()
    assert drv.live == {}


def test_mxfp4_weights_of_a_layer_without_prefill_are_not_copied_into_one_with_it(fake_cuda):
    """A layer with prefill buckets checks MXFP4 scales against the prefill GEMMs' limit as it
    packs them; a copy from a layer without prefill buckets (the same packed layout) would skip
    that check, so load_weights_from refuses it by name (and takes the copy the other way)."""
    spec = parse_spec({**BASE, **CASES["mxfp4"], "max_tokens": 1024}, check_generated=False)
    with_pf, without = make_plan(spec), make_plan(spec, tuning=Tuning(prefill_ws=False))
    assert with_pf.prefill_from and not without.prefill_from and with_pf.weights == without.weights
    a, b = _layer(without), _layer(with_pf)
    a.load_weights(_host_weights(without))
    with pytest.raises(ValueError, match="MX_PREFILL_MAX_SCALE"):
        b.load_weights_from(a)
    b.load_weights(_host_weights(with_pf))
    a.load_weights_from(b)
    for layer in (a, b):
        layer.close()


def test_decode_router_grid_splits_the_tokens_and_its_counters_fit():
    """Past the fused buckets the router takes one 32-token pass a block (the grid's y), and each
    (tile, y) has its own counter for the last K part's sums: the workspace holds them all."""
    for name in ("qwen3-next-80b-a3b", "qwen3-30b-a3b"):
        plan = make_plan(load_spec(ROOT / "specs" / f"{name}.yaml"))
        counters = next(b for b in plan.workspace if b.name == "route_done").shape[0]
        tiles = plan.rows_pad // 16
        for b in plan.buckets:
            for ln in b.launches:
                k = plan.kernel(ln.kernel)
                if k.family != "router" or "_route_" in k.name or "_ks1_" in k.name:
                    continue
                assert ln.grid == (tiles * plan.ksplit, -(-b.max_tokens // 32)), (name, b.max_tokens)
                assert 1 + tiles * ln.grid[1] <= counters, (name, b.max_tokens)
        # one route kernel; it groups the tokens up to the largest decode bucket (every N without prefill)
        routes = {k for k in plan.kernels if k.family == "route"}
        assert len(routes) == 1
        decode = max((b.max_tokens for b in plan.buckets if b.max_tokens < plan.prefill_from), default=0)
        assert next(iter(routes)).targs[-1] == (str(decode) if plan.prefill_from else "0"), name


def test_routed_token_groups_follow_the_routed_mean_beside_a_shared_expert():
    """A layer with a shared expert: the routed blocks pass twice the mean tokens per expert
    (Qwen3-Next-80B-A3B, 512 experts, top-10: N = 64 -> 8 tokens a pass, N = 256 -> 16), the
    shared expert the bucket's 32; each ring as deep as its own chunks allow."""
    plan = make_plan(load_spec(ROOT / "specs" / "qwen3-next-80b-a3b.yaml"))

    def gate_up(nb: int) -> str:
        b = next(b for b in plan.buckets if b.max_tokens == nb)
        return next(ln.kernel for ln in b.launches if plan.kernel(ln.kernel).family == "gate_up")

    assert "_nt1_" in gate_up(64) and "_nts4_" in gate_up(64)
    assert "_nt2_" in gate_up(256) and "_nts4_" in gate_up(256)
    k = plan.kernel(gate_up(64))
    depth, depth_s = int(k.targs[4]), int(k.targs[5])  # KC, NT, NTS, WARPS, DEPTH, DEPTHS, ...
    assert depth > depth_s
