"""moegen's command line: build (no GPU needed) and bench (on a GPU)."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _user_errors() -> tuple[type[BaseException], ...]:
    """The errors that are the input's, reported in one line (imported only when one is raised:
    an up-to-date build imports none of the compiler)."""
    from .build import BuildError
    from .checkpoint import CheckpointError  # (numpy with it: not imported by a build)
    from .hf import HFError
    from .nvrtc import CacheError, CompileError
    from .plan import PlanError
    from .spec import SpecError

    return (SpecError, PlanError, CompileError, CacheError, BuildError, HFError, CheckpointError, BenchError, OSError)


def _error_text(exc: BaseException) -> str:
    """One line that stands alone, then (compile errors only) the excerpt and NVRTC's log, indented."""
    if isinstance(exc, OSError):  # a path the user gave: missing, a directory, not readable
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    from .nvrtc import CompileError

    head, *rest = str(exc).splitlines() or [type(exc).__name__]
    if isinstance(exc, CompileError):
        return "\n".join([head, *("  " + line for line in rest)])
    # Spec errors list one problem per line under a heading: fold them into the one line.
    items = [line.strip() for line in rest if line.strip()]
    return f"{head.rstrip(':')}: {'; '.join(items)}" if items else head


def _cmd_build(args: argparse.Namespace) -> int:
    from .uptodate import check

    for path in args.specs:
        line = None if args.no_cache else check(path, args.out, args.arch)
        if line is None:  # (the compiler imported only here)
            from .build import build, summary

            line = summary(build(path, args.out, arch=args.arch, use_cache=not args.no_cache))
        print(line)
    return 0


class BenchError(RuntimeError):
    """moegen bench cannot run here (no GPU, or not enough of them for --ep-size), or was asked wrongly."""


def _tokens(cmd: str, text: str | None) -> list[int] | None:
    """--tokens as positive token counts (None: the command's default), or an error naming the bad one."""
    if not text:
        return None
    out = []
    for item in text.split(","):
        if not item.strip().isdecimal() or int(item) < 1:
            raise BenchError(f"{cmd} --tokens {text}: {item!r} is not a token count (comma-separated integers >= 1)")
        out.append(int(item))
    return out


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench
    from .check import gpu_unavailable_reason

    tokens = _tokens("bench", args.tokens)
    reason = gpu_unavailable_reason()
    if reason:
        raise BenchError(f"bench times the layer on a GPU: {reason}")
    if args.ep_size:
        from .epbench import run_ep_bench

        return run_ep_bench(args.spec, args.ep_size, tokens=tokens, json_path=args.json)
    return run_bench(args.spec, tokens=tokens, layers=args.layers, json_path=args.json, compare=args.compare,
                     stages=args.stages, out_root=args.out, pending=args.pending, vs=args.vs)


def _cmd_tune(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from .check import gpu_unavailable_reason
    from .families import Tuning
    from .tune import run_tune

    # the arguments first, so that a wrong one is named wherever the command runs
    tokens = _tokens("tune", args.tokens)
    only = tuple(f for f in args.only.split(",") if f) if args.only else ()
    known = {f.name for f in fields(Tuning)}
    if set(only) - known:
        raise BenchError(f"tune --only {args.only}: choices are {', '.join(sorted(known))}")
    reason = gpu_unavailable_reason()
    if reason:
        raise BenchError(f"tune times the layer's variants on a GPU: {reason}")
    return run_tune(args.spec, tokens=tokens, out_root=args.out, write=args.write, only=only)


def _cmd_import_hf(args: argparse.Namespace) -> int:
    from .hf import import_config
    from .spec import not_generated

    r = import_config(args.config, layer=args.layer, name=args.name, model=args.model, out=args.out,
                      minimal=args.minimal, max_tokens=args.max_tokens)
    if args.out is None:
        sys.stdout.write(r.text)
    else:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(r.text)
        print(f"{args.out}: {r.spec.name} ({r.family}, layer {r.layer})")
    missing = not_generated(r.spec)
    if missing:  # a valid spec; `moegen build` refuses it until the generator produces these
        print(f"note: the generator does not produce this yet: {'; '.join(missing)}", file=sys.stderr)
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .check import run_check

    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    status, report = run_check(args.spec, weights=args.weights, layer=args.layer, tokens=tokens, out_root=args.out,
                               echo=lambda line: print(line, flush=True))
    skipped = " (validate + build only: the GPU part was skipped)" if report.skipped else ""
    print(f"check {'PASSED' if status == 0 else 'FAILED'}{skipped}: {args.spec}")
    return status


def _add_spec_commands(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("spec", help="make specs").add_subparsers(dest="spec_cmd", required=True)
    i = s.add_parser("import-hf", help="a spec from a Hugging Face config.json (one MoE layer)")
    i.add_argument("config", help="path to config.json")
    i.add_argument("--layer", type=int, default=None, help="the MoE layer (default: the first MoE layer)")
    i.add_argument("-o", "--out", default=None, help="write the YAML here (default: stdout)")
    i.add_argument("--name", default=None, help="spec name (default: the -o file's stem, else the repo name)")
    i.add_argument("--model", default=None, help="repo id org/name (default: _name_or_path or the HF cache path)")
    i.add_argument("--max-tokens", type=int, default=None,
                   help="the largest N a call may pass (default 256; prefill buckets need more)")
    i.add_argument("--minimal", action="store_true",
                   help="write only fields that differ from the schema defaults (default: the routing rule in full)")
    i.set_defaults(fn=_cmd_import_hf)
    c = sub.add_parser("check", help="validate, build and (on a GPU) verify a spec's layer against the reference")
    c.add_argument("spec")
    c.add_argument("--weights", default=None, help="safetensors checkpoint (file or directory); default random")
    c.add_argument("--layer", type=int, default=None, help="the checkpoint's MoE layer (with --weights)")
    c.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,7,64)")
    c.add_argument("--out", default=None, help="write the generated files under this root (default: a temp dir)")
    c.set_defaults(fn=_cmd_check)


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
    m.add_argument("--layers", type=int, default=4,
                   help="layers with distinct weights per replay (default 4; fewer where they would not fit)")
    m.add_argument("--json", default=None, help="write the results to this JSON file")
    m.add_argument("--compare", action="store_true", help="also time PyTorch baselines when torch is importable")
    m.add_argument("--stages", action="store_true", help="also time each kernel alone")
    m.add_argument("--out", default="generated", help="generated root (default: generated)")
    m.add_argument("--ep-size", type=int, default=0,
                   help="expert parallelism over this many GPUs of this machine (one process each, NCCL): "
                        "per-rank, all-reduce and whole-layer times")
    m.add_argument("--pending", action="store_true",
                   help="also time a spec the generator still refuses (a kernel awaiting its GPU check)")
    m.add_argument("--vs", metavar="SPEC",
                   help="also time this spec in the same run (e.g. the BF16 layer of a quantized one) and print the "
                        "time ratio per token count")
    m.set_defaults(fn=_cmd_bench)
    t = sub.add_parser("tune", help="time variants of the plan's block shapes on this GPU; --write keeps the best")
    t.add_argument("spec")
    t.add_argument("--tokens", default=None, help="comma-separated token counts to weigh (default 1,8,64; --only prefill_cut: N between the cuts)")
    t.add_argument("--out", default="generated",
                   help="generated root: --write puts <out>/<name>.tuning.json there, which later builds use")
    t.add_argument("--write", action="store_true", help="keep the fastest variant for later builds")
    t.add_argument("--only", default=None,
                   help="comma-separated choices (e.g. fused,router_split): time the variants that change them, over the "
                        "choices of <out>/<name>.tuning.json where it exists (else the analytic plan's), against that plan")
    t.set_defaults(fn=_cmd_tune)
    _add_spec_commands(sub)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except Exception as exc:
        if not isinstance(exc, _user_errors()):
            raise
        print(f"moegen: error: {_error_text(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
