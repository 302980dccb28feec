"""The build: spec file -> plan -> rendered files -> cubin -> generated/<name>/, all or nothing."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from . import __version__, uptodate
from .families import Tuning
from .nvrtc import Compiled, compile_parts, nvrtc_version, options_of
from .plan import Plan, PlanError, make_plan
from .render import CUDA_FILE, LAUNCHER_FILE, render_cuda, render_launcher
from .spec import Spec, load_spec, parse_spec

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


def summary(r: BuildResult, how: str | None = None) -> str:
    """The build's line: "<name>: <kernels>, <buckets>, <arch>, <how>; <registers>, <spills> -> <dir>";
    how: "cached in 0.07 s" or "compiled in 1.95 s" unless given."""
    res = r.compiled.resources
    spills = sum(x.spill_stores + x.spill_loads for x in res.values())
    regs = max((x.registers for x in res.values()), default=0)
    how = how or f"{'cached' if r.compiled.cached else 'compiled'} in {r.seconds:.2f} s"
    return (f"{r.spec.name}: {len(r.plan.kernels)} kernels, {len(r.plan.buckets)} token buckets "
            f"(N <= {r.plan.max_tokens}), {r.plan.arch}, {how}; max {regs} registers, {spills} spill bytes "
            f"-> {r.out_dir}")


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
        # NVRTC's options: part p's define MOE_PART=p (this is part 0's; one program: no define)
        "options": options_of(plan.arch, 0 if plan.parts > 1 else None),
        "parts": plan.parts,
        "kernels": [
            {"name": k.name, "family": k.family, "threads": k.threads, "part": k.part,
             **(asdict(res[k.name]) if k.name in res else {})}
            for k in plan.kernels
        ],
        "buckets": [
            {"max_tokens": b.max_tokens,
             "launches": [{"kernel": ln.kernel, "grid": list(ln.grid), "block": ln.block, "pdl": ln.pdl,
                           **({"smem": ln.smem} if ln.smem else {}), **({"coop": True} if ln.coop else {})}
                          for ln in b.launches]}
            for b in plan.buckets
        ],
        "workspace_bytes": sum(_nbytes(b.shape, b.dtype) for b in plan.workspace),
    }


TUNING_SUFFIX = ".tuning.json"  # moegen tune --write: <out_root>/<name>.tuning.json


def manifest_text(spec: Spec, plan: Plan, compiled: Compiled) -> str:
    """manifest.json exactly as the build writes it."""
    return json.dumps(manifest(spec, plan, compiled), indent=1) + "\n"


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a workspace buffer: its dtype is a numpy name ending in its bits (float32, uint16)."""
    bits = dtype[len(dtype.rstrip("0123456789")):]
    if not bits:
        raise ValueError(f"workspace dtype {dtype!r}: no width in its name")
    return math.prod(shape) * int(bits) // 8


def tuning_path(out_root: str | Path, name: str) -> Path:
    return Path(out_root) / f"{name}{TUNING_SUFFIX}"


def read_tuning(out_root: str | Path, name: str) -> Tuning | None:
    """The tuning `moegen tune --write` kept for this spec, or None (the analytic plan)."""
    p = tuning_path(out_root, name)
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text())
        values = {}
        for f in fields(Tuning):  # every choice the file holds; the analytic one for the rest
            if f.name not in d:
                if f.name in ("warps", "down_tiles"):
                    raise KeyError(f.name)
                continue
            v = d[f.name]
            if isinstance(f.default, bool) and not isinstance(v, bool):
                raise TypeError(f"{f.name} is {v!r}, not true or false")
            if f.default is None and v is not None and not isinstance(v, bool):  # on, off, or where it applies
                raise TypeError(f"{f.name} is {v!r}, not true, false or null")
            values[f.name] = v if isinstance(f.default, bool) or f.default is None else int(v)
        return Tuning(**values)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BuildError(f"{p}: not a tuning file ({exc}); expected {{\"warps\": 4, \"down_tiles\": 2, ...}} "
                         "as moegen tune --write writes it (delete it to use the analytic plan)") from None


def tuned_plan(spec: Spec, out_root: str | Path) -> Plan:
    """The plan a build of `spec` into out_root uses: the analytic one, revised by a tuning file."""
    return make_plan(spec, tuning=read_tuning(out_root, spec.name))



def build(spec_path: str | Path, out_root: str | Path = "generated", arch: str | None = None,
          use_cache: bool = True) -> BuildResult:
    """Validate, plan, render and compile one spec, then replace out_root/<name>/ with the result.

    Every check that can fail (spec, arch, plan, output root, NVRTC) runs before anything is
    written; the write itself is atomic (write_dir). With the cache, a stamp of the build's inputs
    and outputs is kept for the next build's up-to-date check (moegen.uptodate).
    """
    t0 = time.perf_counter()
    spec = load_spec(spec_path)
    inputs = uptodate.inputs_now(spec_path, out_root, spec.name) if use_cache else None
    if arch is not None and arch != spec.arch:
        # Through parse_spec, so an arch the schema refuses is a SpecError naming the field.
        spec = parse_spec({**spec.model_dump(mode="json"), "arch": arch}, f"{spec_path} (--arch {arch})")
    try:
        plan = tuned_plan(spec, out_root)
    except PlanError as exc:
        raise PlanError(f"{spec_path}: {exc}") from None
    out_dir = Path(out_root) / spec.name
    check_writable(out_dir.parent)
    files = render_all(spec, plan)
    compiled = compile_parts(files[CUDA_FILE], plan.arch, plan.parts, display=str(out_dir / CUDA_FILE), use_cache=use_cache)
    files[MANIFEST_FILE] = manifest_text(spec, plan, compiled)
    write_dir(out_dir, files)
    result = BuildResult(spec, plan, out_dir, compiled, time.perf_counter() - t0)
    if use_cache:
        line = summary(replace(result, out_dir=Path("{out_dir}")), how="{how}")
        uptodate.record(spec_path, out_root, arch, spec.name, inputs, files, compiled.keys, line)
    return result


def check_writable(root: Path) -> None:
    """Refuse an output root that cannot be created or written, before the compile spends time.

    Creates nothing: walks up to the closest existing ancestor. (write_dir still handles what
    this cannot foresee.)
    """
    p = root.absolute()
    while not p.exists() and not p.is_symlink():
        p = p.parent
    if not p.is_dir():
        raise BuildError(f"{root}: cannot write the output directory: {p} is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise BuildError(f"{root}: cannot write the output directory: {p} is not writable")


def write_dir(out_dir: Path, files: dict[str, str]) -> None:
    """Replace out_dir by exactly `files`, atomically: a failure leaves the old directory as it was."""
    parent = out_dir.parent
    if (out_dir.exists() or out_dir.is_symlink()) and not out_dir.is_dir():
        raise BuildError(f"{out_dir}: exists and is not a directory; not replacing it")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=parent))
    except OSError as exc:
        raise BuildError(f"{parent}: cannot write the output directory: {exc.strerror or exc}") from None
    old = None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the output is an ordinary directory
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=parent))
            os.replace(out_dir, old)  # a directory may replace an empty one
        os.replace(tmp, out_dir)
    except BaseException as exc:
        if old is not None and not out_dir.exists():
            os.replace(old, out_dir)  # put the previous output back
            old = None
        if isinstance(exc, OSError):
            raise BuildError(f"{out_dir}: cannot write the generated files: {exc.strerror or exc}") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
