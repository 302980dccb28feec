"""Runs generated layers once per token count, for compute-sanitizer (not collected by pytest).

    compute-sanitizer --tool memcheck python3 tests/gpu_sanitize.py qwen3-30b-a3b:1,64 mixtral-8x7b:1,64

A tuning may follow the counts: qwen3-30b-a3b:1@single_tags=1,down_tiles=1 (integer values). A `+xrows`
after the name gives every prefill bucket of an FP8-activation layer x's codes a row per (token,
choice) (moegen.prefill_plan.A8_XROWS_L2 = 0), so that a layer small enough for racecheck runs that path;
`+idle` gives its gate/up GEMMs the skip of a warpgroup without rows (A8_IDLE_KTILES = 0): both as
qwen3-30b-a3b-fp8-a8+xrows+idle:3000.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from moegen import prefill_plan
from moegen.bench import _random_weights  # every weight format, made on the device
from moegen.build import render_all, write_dir
from moegen.families import Tuning
from moegen.plan import make_plan
from moegen.runtime import load
from moegen.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
XROWS_L2, IDLE_KTILES = prefill_plan.A8_XROWS_L2, prefill_plan.A8_IDLE_KTILES

for arg in sys.argv[1:]:
    name, rest = arg.split(":")
    name, *flags = name.split("+")
    prefill_plan.A8_XROWS_L2 = 0.0 if "xrows" in flags else XROWS_L2
    prefill_plan.A8_IDLE_KTILES = 0 if "idle" in flags else IDLE_KTILES
    counts, _, tuned = rest.partition("@")
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    plan = make_plan(spec, tuning=Tuning(**{k: int(v) for k, v in (kv.split("=") for kv in tuned.split(",") if kv)}))
    out = Path(tempfile.mkdtemp()) / spec.name
    write_dir(out, render_all(spec, plan))
    w = _random_weights(plan, np.random.default_rng())
    layer = load(out, w)
    for n in map(int, counts.split(",")):
        x = torch.randn(n, plan.hidden, device="cuda", dtype=torch.bfloat16)
        y = torch.full_like(x, float("nan"))
        vocab = spec.routing.hash_vocab_size  # hash-routed: the tokens' ids, some past the vocabulary
        ids = None if vocab is None else torch.randint(-vocab // 8, vocab + vocab // 8, (n,), device="cuda",
                                                       dtype=torch.int32)
        layer(x, out=y, stream=torch.cuda.current_stream(), token_ids=ids)
        torch.cuda.synchronize()
        print(f"{name} N={n}: finite={bool(torch.isfinite(y).all())} sum={y.float().sum().item():.4f}")
