"""`moegen check`: the per-spec regression run, one readable report.

validate -> build (NVRTC, into a temporary directory unless --out) -> on a GPU: the layer against
moegen.reference at several token counts (fresh random inputs, NaN-poisoned outputs, per-row
relative error, chosen experts equal away from near-ties), CUDA-graph replay and bitwise
determinism. Random weights by default, a checkpoint's layer with --weights/--layer. Without a
CUDA device (or PyTorch, which makes the device tensors) the GPU part is reported as skipped and
the exit status covers validation and build only.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import reference
from .build import BuildResult, build
from .nvrtc import nvrtc_version
from .plan import Plan
from .samples import host_bf16 as _host
from .samples import random_weights
from .spec import Spec, load_spec

ROW_TOL = 1e-2  # DESIGN.md: per row, bf16 outputs
FP8_ROW_TOL = 2e-2  # DESIGN.md: where activations are quantized to FP8
TIE_TOL = 1e-4  # selection values closer than this may flip in fp32


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failed: int = 0
    skipped: int = 0
    echo: Callable[[str], None] | None = None  # each line as it is added (a large layer's check takes a while)

    def add(self, stage: str, ok: bool | None, text: str) -> None:
        mark = {True: "ok", False: "FAILED", None: "skipped"}[ok]
        self.failed += ok is False
        self.skipped += ok is None
        self.lines.append(f"{stage:<12} {mark:<8} {text}")
        if self.echo is not None:
            self.echo(self.lines[-1])


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device and PyTorch are here; else why not."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - no driver library at all raises its own type
        return f"no CUDA driver here ({type(exc).__name__})"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"no CUDA driver/device here ({err.name})"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        return "no CUDA device here"
    try:
        import torch  # noqa: F401 - the device tensors are made with PyTorch
    except ImportError:
        return "PyTorch (which makes the device tensors) is not installed"
    return None


def _checkpoint_weights(spec: Spec, path: str, layer: int) -> tuple[dict[str, Any], dict[str, Any]]:
    from .checkpoint import load_layer
    from .formats import FP8BlockWeight

    given = load_layer(path, spec, layer)
    ref = {k: v for k, v in given.items() if not k.endswith("_scale_inv")}
    for k in ref:
        if f"{k}_scale_inv" in given:
            ref[k] = FP8BlockWeight(given[k], given[f"{k}_scale_inv"]).dequantize()
    return given, ref


def _accuracy(spec: Spec, layer: Any, ref_w: dict[str, Any], n: int, rng: np.random.Generator) -> tuple[bool, str]:
    import torch

    from .bench import token_ids_host

    x = torch.from_numpy(rng.standard_normal((n, spec.hidden_size), np.float32)).to("cuda", torch.bfloat16)
    tids = token_ids_host(spec, n, rng)  # hash-routed layers: the tokens' ids (None otherwise)
    out = torch.full_like(x, float("nan"))  # an element the layer does not write stays NaN
    layer(x, out=out, stream=torch.cuda.current_stream(),
          token_ids=None if tids is None else torch.from_numpy(tids).to("cuda"))
    ids, _ = layer.routing(n)
    got, xh, ids = _host(out).astype(np.float64), _host(x), ids.astype(np.int64)
    r = reference.route(spec, xh, ref_w, token_ids=tids)
    off = ~(np.sort(r.ids, 1) == np.sort(ids, 1)).all(1) & (r.margin >= TIE_TOL)
    if off.any():
        t = int(np.nonzero(off)[0][0])
        return False, f"N={n}: token {t} routed to {sorted(ids[t])}, reference {sorted(r.ids[t])}"
    want = reference.moe_forward(spec, xh, ref_w, ids=ids, token_ids=tids)
    if not np.isfinite(got).all():
        return False, f"N={n}: NaN/Inf in the output (an element not written?)"
    err = np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-30)
    tol = FP8_ROW_TOL if spec.experts.fp8_activations else ROW_TOL
    return bool(err.max() <= tol), f"N={n}: max row error {err.max():.2e} (tolerance {tol:g})"


def _replay(spec: Spec, layer: Any, n: int) -> tuple[bool, str]:
    import torch

    from .bench import _random_ids

    x = torch.randn(n, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    t = _random_ids(spec, n, np.random.default_rng())  # hash-routed layers: fixed ids for every call (else None)
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x, out=out, stream=side, token_ids=t)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, out=out, stream=torch.cuda.current_stream(), token_ids=t)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    eager = torch.empty_like(x)
    layer(x.clone(), out=eager, stream=torch.cuda.current_stream(), token_ids=t)
    again = torch.empty_like(x)
    layer(x.clone(), out=again, stream=torch.cuda.current_stream(), token_ids=t)
    torch.cuda.synchronize()
    same_graph = torch.equal(out.view(torch.int16), eager.view(torch.int16))
    same_runs = torch.equal(eager.view(torch.int16), again.view(torch.int16))
    return same_graph and same_runs, (f"N={n}: graph replay {'equals' if same_graph else 'DIFFERS FROM'} eager, "
                                      f"two runs {'bitwise equal' if same_runs else 'DIFFER'}")


def _load_checkpoint(spec: Spec, plan: Plan, weights: str, layer_idx: int,
                     report: Report) -> tuple[dict[str, Any], dict[str, Any]]:
    """The layer's tensors from the checkpoint, checked against what the layer takes (no GPU needed)."""
    from .weights import collect

    given, ref = _checkpoint_weights(spec, weights, layer_idx)
    collect(given, plan, lambda obj, key: (np.shape(obj), np.asarray(obj).dtype.name, False))
    report.add("weights", True, f"{weights} layer {layer_idx}: {len(given)} tensors, as the layer takes them")
    return given, ref


def _gpu(spec: Spec, built: BuildResult, loaded: tuple[dict[str, Any], dict[str, Any]] | None, source: str,
         tokens: list[int], report: Report) -> None:
    from .runtime import load

    rng = np.random.default_rng()  # fresh inputs every run
    if loaded is not None:
        given, ref = loaded
    else:
        given, ref = random_weights(built.plan)  # drawn on the device, every format the layer takes
        source = "random weights"
    layer = load(built.out_dir, given)
    report.add("device", True, f"{source} loaded on {_device_name()}")
    for n in tokens:
        ok, text = _accuracy(spec, layer, ref, n, rng)
        report.add("reference", ok, text)
    ok, text = _replay(spec, layer, min(7, spec.max_tokens))
    report.add("graph", ok, text)


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def _stage(report: Report, stage: str, fn: Callable[[], Any]) -> Any:
    """Run one stage; a user error becomes its FAILED line instead of a traceback."""
    try:
        return fn()
    except (ValueError, RuntimeError, OSError) as exc:
        report.add(stage, False, " ".join(str(exc).split()))
        return None


def run_check(spec_path: str, weights: str | None = None, layer: int | None = None,
              tokens: list[int] | None = None, out_root: str | None = None,
              echo: Callable[[str], None] | None = None) -> tuple[int, Report]:
    """(exit status, report). Status 0: everything that could run here passed. `echo` is given
    each line of the report as it is made."""
    report = Report(echo=echo)
    if weights and layer is None:
        report.add("arguments", False, "--weights needs --layer N (the MoE layer to load)")
        return 1, report
    spec = _stage(report, "validate", lambda: load_spec(spec_path))
    if spec is None:
        return 1, report
    report.add("validate", True, f"{spec.name} ({spec.model}): H={spec.hidden_size}, E={spec.experts.count}, "
                                 f"k={spec.experts.top_k}, I={spec.experts.intermediate_size}, "
                                 f"experts {spec.experts.format.value}")
    with tempfile.TemporaryDirectory(prefix="moegen-check-") as tmp:
        built = _stage(report, "build", lambda: build(spec_path, out_root or tmp))
        if built is None:
            return 1, report
        spilled = {k: r.spill_stores + r.spill_loads for k, r in built.compiled.resources.items()
                   if r.spill_stores + r.spill_loads}
        # Spills are a cost, not a fault: the catalog compiles without any under the NVRTC its
        # tests pin, and another NVRTC may spill a few bytes; they are named, and the check goes on.
        note = (f" (NVRTC {nvrtc_version()} spilled in " + ", ".join(f"{k}: {b} bytes" for k, b in spilled.items())
                + ")") if spilled else ""
        report.add("build", True, f"{len(built.plan.kernels)} kernels for {built.plan.arch}, "
                                  f"{'cached' if built.compiled.cached else 'compiled'} in "
                                  f"{built.seconds:.2f} s, {sum(spilled.values())} spill bytes{note} -> "
                                  f"{built.out_dir if out_root else '(temporary directory)'}")
        loaded = None
        if weights:
            loaded = _stage(report, "weights", lambda: _load_checkpoint(spec, built.plan, weights, layer, report))
            if loaded is None:
                return 1, report
        reason = gpu_unavailable_reason()
        if reason:
            report.add("gpu", None, f"{reason}: the layer was validated and built, not run "
                                    "(reference comparison, graph replay and determinism need a GPU)")
            return int(report.failed > 0), report
        counts = sorted({min(n, spec.max_tokens) for n in (tokens or [1, 7, 64])})
        _stage(report, "gpu", lambda: _gpu(spec, built, loaded, f"{weights} layer {layer}", counts, report))
    return int(report.failed > 0), report
