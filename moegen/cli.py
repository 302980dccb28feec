"""moegen's command line: build (no GPU needed) and bench (on a GPU)."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .build import BuildError, build
from .nvrtc import CacheError, CompileError
from .plan import PlanError
from .spec import SpecError

_USER_ERRORS = (SpecError, PlanError, CompileError, CacheError, BuildError)


def _error_text(exc: BaseException) -> str:
    """One line that stands alone, then (compile errors only) the excerpt and NVRTC's log, indented."""
    if isinstance(exc, OSError):  # a path the user gave: missing, a directory, not readable
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    head, *rest = str(exc).splitlines() or [type(exc).__name__]
    if isinstance(exc, CompileError):
        return "\n".join([head, *("  " + line for line in rest)])
    # Spec errors list one problem per line under a heading: fold them into the one line.
    items = [line.strip() for line in rest if line.strip()]
    return f"{head.rstrip(':')}: {'; '.join(items)}" if items else head


def _cmd_build(args: argparse.Namespace) -> int:
    for path in args.specs:
        r = build(path, args.out, arch=args.arch, use_cache=not args.no_cache)
        res = r.compiled.resources
        spills = sum(x.spill_stores + x.spill_loads for x in res.values())
        regs = max((x.registers for x in res.values()), default=0)
        how = "cached" if r.compiled.cached else "compiled"
        print(f"{r.spec.name}: {len(r.plan.kernels)} kernels, {len(r.plan.buckets)} token buckets "
              f"(N <= {r.plan.max_tokens}), {r.plan.arch}, {how} in {r.seconds:.2f} s; "
              f"max {regs} registers, {spills} spill bytes -> {r.out_dir}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    return run_bench(args.spec, tokens=tokens, layers=args.layers, json_path=args.json, compare=args.compare,
                     stages=args.stages, out_root=args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moegen", description="Compile a model's MoE layer spec into CUDA kernels.")
    p.add_argument("--version", action="version", version=f"moegen {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="render, compile (NVRTC) and write generated/<name>/; needs no GPU")
    b.add_argument("specs", nargs="+", help="spec YAML files (specs/<model>.yaml)")
    b.add_argument("--arch", default=None, help="target architecture (default: the spec's, sm_90a)")
    b.add_argument("--out", default="generated", help="output root (default: generated)")
    b.add_argument("--no-cache", action="store_true", help="compile even if the cubin is cached")
    b.set_defaults(fn=_cmd_build)
    m = sub.add_parser("bench", help="time the layer on this GPU against the memory roofline")
    m.add_argument("spec")
    m.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,2,4,...,max)")
    m.add_argument("--layers", type=int, default=4, help="layers with distinct weights per replay (>= 4)")
    m.add_argument("--json", default=None, help="write the results to this JSON file")
    m.add_argument("--compare", action="store_true", help="also time PyTorch baselines when torch is importable")
    m.add_argument("--stages", action="store_true", help="also time each kernel alone")
    m.add_argument("--out", default="generated", help="generated root (default: generated)")
    m.set_defaults(fn=_cmd_bench)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (*_USER_ERRORS, OSError) as exc:
        print(f"moegen: error: {_error_text(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
