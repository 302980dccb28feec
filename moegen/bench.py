"""moegen bench: whole-layer time per token count against the memory roofline, on this GPU.

Method (DESIGN.md): the device bandwidth is measured in the same run (a large device-to-device
copy, bytes read + written over time). A CUDA graph holds L >= 4 layers whose weights lie at
distinct addresses (the first layer's random weights, copied on the device; with --compare each
layer draws its own), so no layer's weights sit in L2 from the previous one; the median of many replays over L is the
time per layer, each replay queued behind a spin kernel (the GPU's time, not the host's submission
too). The floor is the bytes that must be read: the distinct experts the routing hit,
the router, the shared expert, and the activations in and out.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from .build import render_all, tuned_plan, write_dir
from .plan import Plan
from .prefill import GemmTiles
from .runtime import Layer, _driver, _ok, _StreamRef, load
from .spec import load_spec, not_generated
from .weights import tensors

REPLAYS = 50


# Held ahead of each timed interval: a kernel that spins on the global timer, so that the start
# event and the work behind it are all queued before the GPU reaches them, and the interval is the
# GPU's time for the work, not also the host's time to submit it (cuGraphLaunch, the first kernel's
# launch: several microseconds, which a decode loop's host spends ahead of the GPU).
_HOLD_SOURCE = r"""
extern "C" __global__ void moegen_bench_hold(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
"""
HOLD_NS = 200_000  # far longer than the host takes to queue one timed interval


class _Timer:
    def __init__(self, device: Any) -> None:
        from cuda.core import LaunchConfig, ObjectCode

        from .nvrtc import compile_cuda

        drv = _driver()
        self.drv = drv
        self.stream = _ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
        self.start = _ok(drv.cuEventCreate(0), "event")
        self.stop = _ok(drv.cuEventCreate(0), "event")
        arch = "sm_" + "".join(str(v) for v in device.compute_capability)
        cubin = compile_cuda(_HOLD_SOURCE, arch, "bench_hold.cu").cubin
        self._hold = ObjectCode.from_cubin(cubin).get_kernel("moegen_bench_hold")
        self._hold_cfg = LaunchConfig(grid=1, block=1)
        self._hold_stream = _StreamRef(int(self.stream))

    def hold(self) -> None:
        from cuda.core import launch

        launch(self._hold_stream, self._hold_cfg, self._hold, np.uint64(HOLD_NS))

    def median_ms(self, fn: Any, repeats: int) -> float:
        """Median over `repeats` of the GPU time of fn's work: each interval queued behind a hold."""
        times = []
        for _ in range(repeats):
            self.hold()
            _ok(self.drv.cuEventRecord(self.start, self.stream), "record")
            fn()
            _ok(self.drv.cuEventRecord(self.stop, self.stream), "record")
            _ok(self.drv.cuEventSynchronize(self.stop), "sync")
            times.append(_ok(self.drv.cuEventElapsedTime(self.start, self.stop), "elapsed"))
        return statistics.median(times)

    def graph(self, body: Any) -> Any:
        drv = self.drv
        _ok(drv.cuStreamBeginCapture(self.stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "begin capture")
        body(int(self.stream))
        g = _ok(drv.cuStreamEndCapture(self.stream), "end capture")
        return _ok(drv.cuGraphInstantiate(g, 0), "instantiate")

    def replay(self, exe: Any) -> None:
        _ok(self.drv.cuGraphLaunch(exe, self.stream), "graph launch")


def weight_bytes(plan: Plan) -> int:
    """Bytes of one layer's input tensors (tensors(plan)), as given to Layer.load_weights."""
    size = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4, "int32": 4, "uint8": 1}
    return sum(math.prod(shape) * size[dtype] for shape, dtype in tensors(plan).values())


def _layer_count(plan: Plan, wanted: int, device: Any) -> int:
    """Layers per graph replay: `wanted`, fewer where their weights (stored twice while one
    layer loads) would not fit in 60% of the device memory; at least one."""
    per_layer = weight_bytes(plan)
    drv = _driver()
    dev = _ok(drv.cuDeviceGet(int(device.device_id)), "getting the device")
    total = _ok(drv.cuDeviceTotalMem(dev), "querying the device memory")
    return max(1, min(wanted, int(0.6 * total / per_layer) - 1))


def copy_bandwidth(timer: _Timer, device: Any, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    drv = timer.drv
    a, b = _ok(drv.cuMemAlloc(nbytes), "alloc"), _ok(drv.cuMemAlloc(nbytes), "alloc")

    def copy() -> None:
        _ok(drv.cuMemcpyDtoDAsync(b, a, nbytes, timer.stream), "copy")

    copy()
    ms = timer.median_ms(copy, 20)
    _ok(drv.cuMemFree(a), "free")
    _ok(drv.cuMemFree(b), "free")
    return 2 * nbytes / (ms * 1e-3)


def matrix_rate(timer: _Timer, fp8: bool = False) -> float | None:
    """FLOP/s of a dense 8192^3 matrix product (PyTorch's, on the timer's stream), the ceiling the
    prefill buckets are measured against: bf16, or with fp8 e4m3 codes times e4m3 codes into bf16
    (torch._scaled_mm, unit scales), the rate of layers whose GEMMs take FP8 activations. None
    without PyTorch, or where this PyTorch or GPU has no such product."""
    try:
        import torch
    except ImportError:
        return None
    m = 8192
    a, b = (torch.randn(m, m, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if fp8:
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()  # (B column-major)
        one = torch.ones((), device="cuda", dtype=torch.float32)
        product = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        c = torch.empty(m, m, device="cuda", dtype=torch.bfloat16)
        product = lambda: torch.mm(a, b, out=c)
    stream = torch.cuda.ExternalStream(int(timer.stream))
    with torch.cuda.stream(stream):
        try:
            product()  # (warm-up; FP8: whether this PyTorch and GPU have the product)
        except (AttributeError, RuntimeError, TypeError):
            if not fp8:
                raise
            return None
        ms = timer.median_ms(product, 20)
    return 2.0 * m**3 / (ms * 1e-3)


def expert_flops(plan: Plan, n: int) -> float:
    """FLOPs of the routed experts for n tokens (gate, up and down for each of the top_k choices)
    and of the shared expert: what the prefill buckets' TFLOP/s count."""
    return 2.0 * n * 3 * plan.hidden * (plan.top_k * plan.inter + plan.shared_inter)


def _random_weights(plan: Plan, rng: np.random.Generator) -> dict[str, Any]:
    """Random weights of the plan's formats (FP8 block: e4m3 codes with per-block scales),
    made on the device with PyTorch when it is there (host NumPy is slow at these sizes)."""
    import ml_dtypes

    try:
        import torch
    except ImportError:
        torch = None
    out: dict[str, Any] = {}
    for name, (shape, dtype) in tensors(plan).items():
        if name.endswith("_scale_inv"):
            out[name] = rng.uniform(0.5, 1.0, shape).astype(np.float32) / 448.0
        elif name.endswith("_input_scale"):  # FP8 per-tensor: activations of O(1) within +-448 steps
            out[name] = np.full(shape, 5.0 / 448.0, np.float32)
        elif name.endswith("_scale") and dtype == "float32":  # FP8 per-tensor weight scale: codes of 64 w
            out[name] = np.full(shape, 1.0 / 64.0, np.float32)
        elif dtype == "uint8":  # FP4: random e2m1 pairs; MXFP4's E8M0 scales near 1/sqrt(K)
            k = shape[-1] * (2 if not name.endswith("_scale") else 32)
            lo = 127 - int(math.log2(math.sqrt(k))) - 3
            out[name] = (rng.integers(lo, lo + 2, shape) if name.endswith("_scale")
                         else rng.integers(0, 256, shape)).astype(np.uint8)
        elif dtype == "int32":  # a hash table: k distinct random experts per row
            out[name] = rng.random((shape[0], plan.experts)).argsort(1)[:, : shape[1]].astype(np.int32)
        elif name == "gate.e_score_correction_bias":  # a tenth of the scores' spread (1/E for softmax)
            out[name] = (0.1 / plan.scored if ("int", "SCORE", "MOE_SCORE_SOFTMAX") in plan.route_rule else 0.01) * rng.standard_normal(shape, np.float32)
        elif dtype == "float32":  # biases and norm weights
            out[name] = (1.0 if name.endswith("norm.weight") else 0.0) + 0.1 * rng.standard_normal(shape, np.float32)
        elif torch is not None:
            w = torch.randn(shape, device="cuda") / math.sqrt(shape[-1])
            if dtype == "bfloat16":
                out[name] = w.to(torch.bfloat16)
            else:  # codes of O(1) values; the runtime packs FP8 on the host
                out[name] = (w * 64).to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy().view(dtype)
        else:
            w = rng.standard_normal(shape, np.float32) / math.sqrt(shape[-1])
            out[name] = w.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else ml_dtypes.float8_e4m3fn)
    # PyTorch's allocator keeps the fp32 temporaries' blocks (21 GB for one of Llama-4-Maverick's
    # expert tensors): given back, so that the layers' own allocations find the memory
    release_torch_cache()
    return out


def release_torch_cache() -> None:
    """Hand PyTorch's cached device blocks back to the driver, where PyTorch has made any."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def token_ids_host(spec: Any, n: int, rng: np.random.Generator) -> np.ndarray | None:
    """Hash-routed layers (routing.hash_vocab_size): n random token ids in [0, vocab), int32, the
    call's token_ids; None for the other layers."""
    vocab = spec.routing.hash_vocab_size
    return None if vocab is None else rng.integers(0, vocab, n, dtype=np.int32)


def _random_ids(spec: Any, n: int, rng: np.random.Generator) -> Any:
    """token_ids_host on the device (PyTorch), or None."""
    ids = token_ids_host(spec, n, rng)
    if ids is None:
        return None
    import torch

    return torch.from_numpy(ids).to("cuda")


def _random_x(plan: Plan, n: int, rng: np.random.Generator) -> Any:
    try:
        import torch

        return torch.randn(n, plan.hidden, device="cuda", dtype=torch.bfloat16)
    except ImportError as exc:
        raise RuntimeError("moegen bench makes its device inputs with PyTorch or CuPy") from exc


def floor_bytes(plan: Plan, n: int, distinct_experts: int) -> int:
    """Bytes a layer call must move: the hit experts and the shared expert in their stored format
    (FP8 block: one byte per weight plus the fp32 scale of each 128x128 block), the router, and
    x in and out."""
    h, i, si = plan.hidden, plan.inter, plan.shared_inter
    fmt = {pw.name: pw.format for pw in plan.weights}

    def matrix(rows: int, cols: int, f: str) -> int:
        if f == "fp8_block":
            return rows * cols + 4 * -(-rows // 128) * -(-cols // 128)
        if f == "fp8_tensor":  # a byte per weight, two fp32 scales per matrix
            return rows * cols + 8
        if f == "mxfp4":  # half a byte per weight, one E8M0 byte per 32
            return rows * cols // 2 + rows * cols // 32
        if f == "nvfp4":  # half a byte per weight, one e4m3 byte per 16
            return rows * cols // 2 + rows * cols // 16
        return 2 * rows * cols

    experts = distinct_experts * (2 * matrix(i, h, fmt["w13"]) + matrix(h, i, fmt["w2"]))
    shared = 2 * matrix(si, h, fmt["ws13"]) + matrix(h, si, fmt["ws2"]) if si else 0
    router = (plan.experts + int(plan.shared_gate)) * h * 2
    return experts + router + shared + 2 * n * h * 2


def run_bench(spec_path: str, tokens: list[int] | None = None, layers: int = 4, json_path: str | None = None,
              compare: bool = False, stages: bool = False, out_root: str = "generated", pending: bool = False,
              vs: str | None = None) -> int:
    from cuda.core import Device

    device = Device()
    device.set_current()
    timer = _Timer(device)
    bw = copy_bandwidth(timer, device)
    result = _measure(spec_path, tokens, layers, compare, stages, out_root, pending, device, timer, bw)
    if vs:  # another spec (e.g. the BF16 layer of a quantized one) in the same run, same token counts
        other = _measure(vs, [r["tokens"] for r in result["rows"]], layers, False, stages, out_root, pending,
                         device, timer, bw)
        result["vs"] = {"spec": other["spec"], "rows": other["rows"],
                        "time_ratio": {str(a["tokens"]): a["us"] / b["us"] for a, b in zip(result["rows"], other["rows"])}}
        print(f"time {result['spec']} / {other['spec']}: "
              + ", ".join(f"N={n} {r:.2f}" for n, r in result["vs"]["time_ratio"].items()))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def timed_dir(spec: Any, plan: Plan, out_root: Path) -> Path:
    """The generated directory to time: out_root/<name> where it holds what this moegen builds from
    the spec (its CUDA source and launcher as rendered now), else a fresh one in a temporary
    directory, said on stdout (a directory built by another version or from other templates would
    time other kernels)."""
    files = render_all(spec, plan)
    gen = out_root / spec.name
    if all((gen / name).is_file() and (gen / name).read_text() == text for name, text in files.items()):
        return gen
    if (gen / "launcher.py").is_file():
        print(f"{gen} is not what this moegen builds from the spec (rebuild it with moegen build): "
              "timing a fresh build")
    fresh = Path(tempfile.mkdtemp()) / spec.name
    write_dir(fresh, files)
    return fresh


def _measure(spec_path: str, tokens: list[int] | None, layers: int, compare: bool, stages: bool, out_root: str,
             pending: bool, device: Any, timer: _Timer, bw: float) -> dict[str, Any]:
    """One spec's rows: us per layer, distinct experts, floor bytes and roofline per token count,
    each printed as soon as it is measured (a run cut short keeps what it has shown)."""
    spec = load_spec(spec_path, check_generated=not pending)
    if pending and not_generated(spec):
        print(f"{spec.name}: timing a refused spec ({'; '.join(not_generated(spec))}): its results are not checked here")
    plan = tuned_plan(spec, out_root)  # as the build into out_root made it
    gen = timed_dir(spec, plan, Path(out_root))
    rng = np.random.default_rng()
    compare = compare and _can_compare(spec)
    layers = _layer_count(plan, layers, device)
    # One set of random weights: the first layer's, copied on the device into the others (no host
    # packing: a DeepSeek-V3 FP8 layer's codes took minutes a layer), and given to the baselines,
    # whose prepare makes each layer's operands at their own addresses too.
    w = _random_weights(plan, rng)
    stack = [load(gen, w, device=device)]
    for _ in range(layers - 1):
        stack.append(load(gen, device=device))
        stack[-1].load_weights_from(stack[0])
    weights = [w] * layers if compare else []
    del w
    props = device.properties
    result = {"spec": spec.name, "gpu": device.name, "sm_count": getattr(props, "multiprocessor_count", 0),
              "date": date.today().isoformat(), "copy_bandwidth_gbps": bw / 1e9, "layers_per_replay": layers,
              "rows": []}
    _print_header(result)
    tokens = tokens or [b.max_tokens for b in plan.buckets]
    rows = result["rows"]
    rate: float | None = None
    rate_dtype = "e4m3" if plan.prefill_tiles and GemmTiles(*plan.prefill_tiles).a8 else "bf16"  # (e4m3 x e4m3 GEMMs)
    prepared: list[Any] | None = None
    for n in tokens:
        xs = [_random_x(plan, n, rng) for _ in stack]
        ids = [_random_ids(spec, n, rng) for _ in stack]  # (hash-routed layers; else None each)
        ms = time_stack(timer, stack, xs, ids) / 1e3
        # routed experts only: a zero (identity) expert's index, >= E, reads no weights
        distinct = [int(np.count_nonzero(np.unique(layer.routing(n)[0]) < plan.experts)) for layer in stack]
        need = statistics.mean(floor_bytes(plan, n, d) for d in distinct)
        row = {"tokens": n, "us": ms * 1e3, "distinct_experts": statistics.mean(distinct),
               "floor_bytes": need, "gbps": need / (ms * 1e-3) / 1e9, "roofline_fraction": need / bw / (ms * 1e-3)}
        marginal = (marginal_us(timer, stack, xs, ms * 1e3, ids) if not plan.prefill_from or n <= _decode_max(plan)
                    else 0.0)
        if marginal > 0:  # (the decode buckets: a prefill bucket's time dwarfs the replay's start)
            row["us_marginal"] = marginal
            row["roofline_fraction_marginal"] = need / bw / (marginal * 1e-6)
        if plan.prefill_from and n > _decode_max(plan):  # a prefill bucket: tensor-core throughput
            row["tflops"] = expert_flops(plan, n) / (ms * 1e-3) / 1e12
            if rate is None:
                rate = matrix_rate(timer, fp8=rate_dtype == "e4m3") or 0.0
            if rate:
                row["matrix_rate_tflops"] = rate / 1e12
                row["matrix_rate_dtype"] = rate_dtype
                row["matrix_fraction"] = row["tflops"] * 1e12 / rate
        if stages:
            row["stages_us"] = _stage_times(timer, stack, xs, n, ids)
        if compare:
            from .baselines import prepare_layers, time_baselines

            if prepared is None:  # once for every N (FP8 block: dequantized to BF16 here), then the host codes go
                prepared = prepare_layers(spec, weights)  # type: ignore[arg-type]
                weights = []
            for name, us in time_baselines(spec, plan, weights, xs, timer, prepared).items():
                row[f"{name}_us"] = us
                row[f"speedup_vs_{name}"] = us / row["us"]
        rows.append(row)
        _print_row(row)
    for layer in stack:
        layer.close()
    if compare:
        from .baselines import describe

        result["baselines"] = describe(spec)
        print(f"({result['baselines']})")
    return result


def _decode_max(plan: Plan) -> int:
    """The largest token count of the decode buckets (those before prefill_from)."""
    return max((b.max_tokens for b in plan.buckets if b.max_tokens < plan.prefill_from), default=0)


def time_stack(timer: _Timer, stack: list[Layer], xs: list[Any], ids: list[Any] | None = None) -> float:
    """Microseconds per layer: one CUDA graph calls every layer of the stack on its input (and, for
    hash-routed layers, its tokens' ids); the median of REPLAYS replays, divided by the layers."""
    ids = ids or [None] * len(stack)
    exe = timer.graph(lambda s: [layer(x, stream=s, token_ids=t) for layer, x, t in zip(stack, xs, ids)])
    timer.replay(exe)
    return timer.median_ms(lambda: timer.replay(exe), REPLAYS) / len(stack) * 1e3


def marginal_us(timer: _Timer, stack: list[Layer], xs: list[Any], us: float, ids: list[Any] | None = None) -> float:
    """Microseconds one more layer adds: the stack replayed twice over in one graph (2L layers, each
    layer's weights read again only after L - 1 others') against the stack once (`us` a layer), so
    that the replay's own start (the graph launch, its first kernel's launch: about 6 us on the H200,
    which `us` spreads over the L layers) drops out. A decode step's graph runs every layer of a
    model, where that start is shared by dozens of layers."""
    ids = ids or [None] * len(stack)
    return 2 * time_stack(timer, stack + stack, xs + xs, ids + ids) - us


def _can_compare(spec: Any) -> bool:
    """The PyTorch baselines run BF16 and FP8 block layers (the latter dequantized to BF16) routed
    by softmax or DeepSeek-V3's sigmoid rule, where PyTorch is importable; anything else they would
    compute differently from the layer, so they are skipped, saying why."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("--compare: PyTorch is not importable here; baselines skipped")
        return False
    from .baselines import unsupported

    why = unsupported(spec)
    if why:
        print(f"--compare: the PyTorch baselines do not compute {'; '.join(why)}: skipped for this spec")
        return False
    return True


def _stage_times(timer: _Timer, stack: list[Layer], xs: list[Any], n: int,
                 ids: list[Any] | None = None) -> dict[str, float]:
    """Time added by each kernel in the pipeline: graphs of the first j kernels of every layer,
    j = 1 .. all, and the differences of their per-layer times (outputs are not valid here)."""
    from .arrays import view

    layer0 = stack[0]
    bi = layer0._bucket_of[n]
    launches = layer0.plan.buckets[bi].launches
    out: dict[str, float] = {}
    prev = 0.0
    for j in range(1, len(launches) + 1):
        def body(s: int, j: int = j) -> None:
            for layer, x, t in zip(stack, xs, ids or [None] * len(stack)):
                layer._launch(n, view(x, "x").ptr, layer.workspace.ptr("out"), s, limit=j,
                              token_ids=0 if t is None else view(t, "token_ids").ptr)
        exe = timer.graph(body)
        timer.replay(exe)
        t = timer.median_ms(lambda exe=exe: timer.replay(exe), REPLAYS) * 1e3 / len(stack)
        out[layer0.plan.kernel(launches[j - 1].kernel).family] = t - prev
        prev = t
    return out


def _print_header(r: dict) -> None:
    print(f"{r['spec']} on {r['gpu']} ({r['sm_count']} SMs), {r['date']}: copy bandwidth "
          f"{r['copy_bandwidth_gbps']:.0f} GB/s, {r['layers_per_replay']} layers per graph replay")
    print(f"{'N':>5} {'us/layer':>9} {'experts':>8} {'MB':>8} {'GB/s':>7} {'roofline':>9} {'+layer':>8} {'roofline':>9}"
          "  stages (us) / baselines", flush=True)


def _print_row(row: dict) -> None:
    st = " ".join(f"{k}={v:.1f}" for k, v in row.get("stages_us", {}).items())
    for name in ("torch_loop", "torch_grouped_mm"):
        if f"{name}_us" in row:
            st += f" {name}={row[f'{name}_us']:.1f}us (x{row[f'speedup_vs_{name}']:.2f})"
    if "tflops" in row:
        st = (f"{row['tflops']:.0f} TFLOP/s" + (f" ({row['matrix_fraction']:.0%} of {row['matrix_rate_tflops']:.0f}"
                                                  f"{' e4m3' if row.get('matrix_rate_dtype') == 'e4m3' else ''})"
                                                if "matrix_fraction" in row else "") + " " + st)
    more = (f"{row['us_marginal']:>8.1f} {row['roofline_fraction_marginal']:>8.1%}" if "us_marginal" in row
            else f"{'-':>8} {'-':>8}")
    print(f"{row['tokens']:>5} {row['us']:>9.1f} {row['distinct_experts']:>8.1f} {row['floor_bytes'] / 1e6:>8.1f} "
          f"{row['gbps']:>7.0f} {row['roofline_fraction']:>8.1%} {more}  {st.strip()}", flush=True)
