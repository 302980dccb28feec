"""A/B of tunings (or compile-time defines) of one layer, in one process (not collected by pytest).

    python3 tests/gpu_ab.py qwen3-30b-a3b 2048,8192 5 'A=' 'B=prefill_stage_y=0' 'C=MOE_SOME_DEFINE'

Each variant is `label=` then comma-separated items: `key=int` a moegen.families.Tuning field, a bare
NAME a `#define NAME 1` put before the layer's source (a measurement-only switch in the templates).
Every variant gets the same random weights (made once, copied: the variants must pack them alike,
which Layer.load_weights_from checks) and the same inputs; for each N the
first layer of each variant runs once on a poisoned output and its bits and routing are compared with
the first variant's, then the variants' CUDA-graph replays (`layers` distinct layers a replay, env
AB_LAYERS, default 4) are timed in interleaved rounds: the medians and minima, us per layer.
"""

import os
import statistics
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from moegen.bench import _random_weights, _random_x, _Timer, time_stack
from moegen.build import render_all, write_dir
from moegen.families import Tuning
from moegen.plan import make_plan
from moegen.runtime import load
from moegen.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent


def variant(arg: str) -> tuple[str, Tuning, list[str]]:
    label, _, items = arg.partition("=")
    flags = {f.name for f in fields(Tuning) if "bool" in str(f.type)}  # (0 / 1 as False / True)
    tuned, defines = {}, []
    for item in filter(None, items.split(",")):
        key, eq, value = item.partition("=")
        if eq:
            tuned[key] = bool(int(value)) if key in flags else int(value)
        else:
            defines.append(key)
    return label, Tuning(**tuned), defines


def main() -> None:
    from cuda.core import Device

    name, counts, rounds = sys.argv[1], [int(v) for v in sys.argv[2].split(",")], int(sys.argv[3])
    variants = [variant(a) for a in sys.argv[4:]]
    layers = int(os.environ.get("AB_LAYERS", "4"))
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    dev = Device()
    dev.set_current()
    timer = _Timer(dev)
    stacks, first, plan = [], None, None
    for label, tuning, defines in variants:
        plan = make_plan(spec, tuning=tuning)
        files = render_all(spec, plan)
        files["layer.cu"] = "".join(f"#define {d} 1\n" for d in defines) + files["layer.cu"]
        out = Path(tempfile.mkdtemp()) / spec.name
        write_dir(out, files)
        if first is None:
            first = load(out, _random_weights(plan, np.random.default_rng(1)), device=dev)
            stack = [first] + [load(out, device=dev) for _ in range(layers - 1)]
            for layer in stack[1:]:
                layer.load_weights_from(first)
        else:
            stack = [load(out, device=dev) for _ in range(layers)]
            for layer in stack:
                layer.load_weights_from(first)
        stacks.append(stack)
    rng = np.random.default_rng(2)
    for n in counts:
        xs = [_random_x(plan, n, rng) for _ in range(4)]
        outs = []
        for stack in stacks:
            y = torch.full((n, plan.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
            stack[0](xs[0], out=y, stream=torch.cuda.current_stream())
            torch.cuda.synchronize()
            ids, wts = (np.asarray(a) for a in stack[0].routing(n))
            outs.append((y.clone(), ids, wts.view(np.int32)))
        for (label, _, _), (y, ids, wts) in zip(variants, outs):
            same = torch.equal(y.view(torch.int16), outs[0][0].view(torch.int16))
            routed = np.array_equal(ids, outs[0][1]) and np.array_equal(wts, outs[0][2])
            diff = float((y.float() - outs[0][0].float()).abs().max())
            print(f"N={n} {label}: bits {'same' if same else 'DIFFER'}, routing {'same' if routed else 'DIFFER'}, "
                  f"finite {bool(torch.isfinite(y.float()).all())}, max |diff| {diff:.3g}")
        times: dict[str, list[float]] = {label: [] for label, _, _ in variants}
        for _ in range(rounds):
            for (label, _, _), stack in zip(variants, stacks):
                times[label].append(time_stack(timer, stack, xs))
        for label, t in times.items():
            print(f"N={n} {label:10s} median {statistics.median(t):9.2f} us  min {min(t):9.2f}  "
                  f"({' '.join(f'{v:.2f}' for v in t)})")
    for stack in stacks:
        for layer in stack:
            layer.close()


if __name__ == "__main__":
    main()
