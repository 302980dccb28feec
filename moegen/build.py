"""The build: spec file -> plan -> rendered files -> cubin -> generated/<name>/, all or nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .nvrtc import Compiled, compile_cuda, nvrtc_version, options_of
from .plan import Plan, make_plan
from .render import CUDA_FILE, LAUNCHER_FILE, render_cuda, render_launcher
from .spec import Spec, load_spec

MANIFEST_FILE = "manifest.json"


class BuildError(RuntimeError):
    """The build could not write its output; nothing was left half-written."""


@dataclass(frozen=True)
class BuildResult:
    spec: Spec
    plan: Plan
    out_dir: Path
    compiled: Compiled
    seconds: float


def render_all(spec: Spec, plan: Plan) -> dict[str, str]:
    """The generated files that depend only on the spec and moegen's version."""
    return {CUDA_FILE: render_cuda(spec, plan), LAUNCHER_FILE: render_launcher(spec, plan)}


def manifest(spec: Spec, plan: Plan, compiled: Compiled) -> dict:
    res = compiled.resources
    return {
        "name": spec.name,
        "model": spec.model,
        "spec_sha256": spec.digest(),
        "moegen": __version__,
        "arch": plan.arch,
        "nvrtc": nvrtc_version(),
        "options": options_of(plan.arch),
        "kernels": [
            {"name": k.name, "family": k.family, "threads": k.threads,
             **(dataclasses.asdict(res[k.name]) if k.name in res else {})}
            for k in plan.kernels
        ],
        "buckets": [
            {"max_tokens": b.max_tokens,
             "launches": [{"kernel": ln.kernel, "grid": list(ln.grid), "block": ln.block, "pdl": ln.pdl}
                          for ln in b.launches]}
            for b in plan.buckets
        ],
        "workspace_bytes": sum(_nbytes(b.shape, b.dtype) for b in plan.workspace),
    }


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = {"float32": 4, "int32": 4, "uint16": 2}[dtype]
    for s in shape:
        n *= s
    return n


def build(spec_path: str | Path, out_root: str | Path = "generated", arch: str | None = None,
          use_cache: bool = True) -> BuildResult:
    t0 = time.perf_counter()
    spec = load_spec(spec_path)
    if arch is not None and arch != spec.arch:
        spec = Spec.model_validate({**spec.model_dump(), "arch": arch})
    plan = make_plan(spec)
    out_dir = Path(out_root) / spec.name
    files = render_all(spec, plan)
    compiled = compile_cuda(files[CUDA_FILE], plan.arch, display=str(out_dir / CUDA_FILE), use_cache=use_cache)
    files[MANIFEST_FILE] = json.dumps(manifest(spec, plan, compiled), indent=1) + "\n"
    write_dir(out_dir, files)
    return BuildResult(spec, plan, out_dir, compiled, time.perf_counter() - t0)


def write_dir(out_dir: Path, files: dict[str, str]) -> None:
    """Replace out_dir by exactly `files`, atomically: a failure leaves the old directory as it was."""
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=parent))
    except OSError as exc:
        raise BuildError(f"{parent}: cannot write the output directory: {exc.strerror}") from None
    old = None
    try:
        for name, text in files.items():
            (tmp / name).write_text(text)
        if out_dir.exists():
            old = parent / f".{out_dir.name}.old-{os.getpid()}"
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    except OSError as exc:
        if old is not None and not out_dir.exists():
            os.replace(old, out_dir)
        raise BuildError(f"{out_dir}: cannot write the generated files: {exc.strerror}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
