"""Rendering: the one Jinja environment, and the files a spec turns into."""

from __future__ import annotations

import dataclasses
import pprint
from typing import TYPE_CHECKING

import jinja2

from . import __version__
from .uptodate import template_dir

if TYPE_CHECKING:
    from .plan import Plan
    from .spec import Spec

CUDA_FILE = "layer.cu"
LAUNCHER_FILE = "launcher.py"


def _env() -> jinja2.Environment:
    from .cache import cache_dir

    root = template_dir()
    try:  # Jinja's compiled templates beside the cubins: a cached build skips compiling them
        d = cache_dir() / "jinja"
        d.mkdir(parents=True, exist_ok=True)
        bytecode = jinja2.FileSystemBytecodeCache(str(d))
    except OSError:  # an unwritable cache: compile the templates each time
        bytecode = None
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        bytecode_cache=bytecode,
        undefined=jinja2.StrictUndefined,  # a missing plan field is an error, never an empty string
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


_ENV = None


def env() -> jinja2.Environment:
    global _ENV
    if _ENV is None:
        _ENV = _env()
    return _ENV


def render_cuda(spec: Spec, plan: Plan) -> str:
    g = None
    if plan.prefill_from:  # the grouped-GEMM device functions, at the plan's tile shape
        from .prefill import GemmTiles, grouped_args
        from .prefill_plan import other_bn

        w2 = next(w for w in plan.weights if w.name == "w2")
        t = GemmTiles(*plan.prefill_tiles)
        a8 = any(k.family.startswith("prefill_gemm") and k.targs[4:5] == ("true",) for k in plan.kernels)
        g = grouped_args(t, standalone=False, down_mats=(w2.mats,), other_bn=other_bn(plan.kernels, t.bn), a8=a8)
    return env().get_template("layer.cu.j2").render(
        spec=spec, plan=plan, version=__version__, spec_digest=spec.digest(), g=g,
        single=any(k.family == "single" for k in plan.kernels),  # the one-token kernel's template, where used
    )


def render_launcher(spec: Spec, plan: Plan) -> str:
    return env().get_template("launcher.py.j2").render(
        spec=spec, plan=plan, version=__version__, spec_digest=spec.digest(),
        plan_literal=pprint.pformat(dataclasses.asdict(plan), width=110, sort_dicts=True),
    )
