"""`moegen tune`: measure, on this GPU, the variants of the analytic plan's revisable choices
(moegen.families.Tuning: warps per gate/up and down block, 16-row tiles per down block) and keep
the fastest.

The result is written beside the spec's generated output, as <out_root>/<name>.tuning.json, and
later builds (and `moegen bench`) read it. Without that file a build uses the analytic plan; a
tuning file changes only kernel choices, never results beyond floating-point summation order
(the reduction over warps follows the warp count), and it names the GPU and date it was measured on.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from dataclasses import asdict, fields, replace
from datetime import date
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from .build import read_tuning, render_all, tuning_path, write_dir
from .families import Tuning
from .plan import Plan, PlanError, make_plan
from .spec import Spec, load_spec

VARIANTS = (tuple(Tuning(w, t) for w in (4, 8) for t in (1, 2, 4)) + (Tuning(4, 2, True), Tuning(8, 2, True))
            + tuple(Tuning(router_split=r) for r in (1, 2, 4, 8)) + tuple(Tuning(fused=f) for f in (1, 2, 4))
            + tuple(Tuning(prefill_from=p) for p in (64, 128, 256, 512, 1024, 2048, 1 << 20))
            + tuple(Tuning(routed_nt=r) for r in (1, 2, 4))
            + (Tuning(prefill_ws=False), Tuning(prefill_bm=64), Tuning(prefill_bm=64, prefill_stages=3, prefill_ws=False),
               Tuning(prefill_stages=3), Tuning(prefill_bn=128), Tuning(prefill_bn=160),
               Tuning(prefill_down_stages=3, prefill_ws=False), Tuning(prefill_down_pair=False),
               Tuning(prefill_stage_y=False), Tuning(prefill_stage_y=True), Tuning(prefill_xrows=False), Tuning(prefill_pdl=False),
               Tuning(prefill_shared=False), Tuning(single=False),
               Tuning(single_coop=False), Tuning(single_tags=False), Tuning(single_tags=False, down_tiles=1),
               Tuning(single_fp8=False), Tuning(single_fp4=False), Tuning(single_overlap=False),
               Tuning(single_overlap=False, down_tiles=1), Tuning(single_tmap=False), Tuning(single_late_down=True),
               Tuning(single_late_down=False), Tuning(single_cols=False), Tuning(single_two=False),
               Tuning(single_block_route=True), Tuning(single_block_route=False)))


def _label(t: Tuning) -> str:
    """A variant's short name: warps x down tiles, then each other choice that is not the analytic one."""
    return f"{t.warps}x{t.down_tiles}" + "".join(
        (f" {f.name}" if v is True else f" no {f.name}" if v is False else f" {f.name}={v}")
        for f in fields(Tuning) if f.name not in ("warps", "down_tiles") and (v := getattr(t, f.name)) != f.default)


def _cuts(spec: Spec) -> list[int]:
    """Cuts of the GEMV path (prefill_cut) around the analytic plan's first prefill bucket pf:
    every eighth of that bucket and of the one below it, from pf / 4 (the prefill kernels a bucket
    earlier) to pf (a bucket later)."""
    q = make_plan(spec).prefill_from // 4
    return sorted({q + q * j // 8 for j in range(9)} | {2 * q + q * j // 4 for j in range(9)}) if q >= 2 else []


def _cut_variants(spec: Spec) -> tuple[Tuning, ...]:
    return tuple(Tuning(prefill_cut=c) for c in _cuts(spec))


def cut_tokens(spec: Spec) -> list[int]:
    """The token counts that weigh the cuts (`--only prefill_cut` without --tokens): one between
    each two neighbouring cuts, so that each cut is judged by the N on its two sides."""
    cuts = _cuts(spec)
    return [(a + b + 1) // 2 for a, b in pairwise(cuts)] or [1, 8, 64]


def on(base: Tuning, variant: Tuning, only: tuple[str, ...] = ()) -> Tuning:
    """The variant's choices over a kept tuning's: those it changes from the analytic plan, and
    its values of the choices in `only` (the ones being tuned) whatever they are."""
    default = Tuning()
    changed = {f.name: getattr(variant, f.name) for f in fields(Tuning)
               if f.name in only or getattr(variant, f.name) != getattr(default, f.name)}
    if "prefill_cut" in changed:  # (a cut and a whole first bucket are refused together)
        changed.setdefault("prefill_from", 0)
    if "prefill_from" in changed:
        changed.setdefault("prefill_cut", 0)
    return replace(base, **changed)


def _valid(spec: Spec, only: tuple[str, ...] = (), base: Tuning | None = None) -> list[tuple[Tuning, Plan]]:
    """The variants that the kernels can take; with `only`, the base (a kept tuning, else the
    analytic plan) and the variants that change one of those choices, each over the base's other
    choices. A variant that launches what an earlier one does (the same kernels, grids and launch
    kinds: a choice this layer does not have) is left out."""
    default = Tuning()
    base = base or default
    out, seen = [], set()
    candidates: list[Tuning] = []
    for v in VARIANTS + _cut_variants(spec):
        if not only:
            candidates.append(v)
        elif v == default:  # the base, and the analytic values of the tuned choices over its others
            candidates += [base, on(base, v, only)]
        elif any(getattr(v, f) != getattr(default, f) for f in only):
            candidates.append(on(base, v, only))
    for v in candidates:
        try:
            plan = make_plan(spec, tuning=v)
        except PlanError:
            continue  # e.g. a ring that static shared memory cannot hold
        launches = tuple((ln.kernel, ln.grid, ln.block, ln.coop) for b in plan.buckets for ln in b.launches)
        if launches not in seen:
            seen.add(launches)
            out.append((v, plan))
    return out


def run_tune(spec_path: str, tokens: list[int] | None = None, out_root: str = "generated", write: bool = False,
             layers: int = 4, only: tuple[str, ...] = ()) -> int:
    from cuda.core import Device

    from .bench import _layer_count, _random_ids, _random_weights, _random_x, _Timer, release_torch_cache, time_stack
    from .runtime import load

    spec = load_spec(spec_path)
    # With --only, the other choices stay as a kept tuning file has them (else analytic), and the
    # variants and the reference are that tuning with those choices changed.
    kept = read_tuning(out_root, spec.name) if only else None
    ref = kept or Tuning()
    name = "kept" if kept else "analytic"
    variants = _valid(spec, only, ref)
    tokens = tokens or (cut_tokens(spec) if only == ("prefill_cut",) else [1, 8, 64])
    device = Device()
    device.set_current()
    rng = np.random.default_rng()
    count = max(1, min(layers, _layer_count(variants[0][1], 2 * layers, device) // 2))  # raw and packed weights held
    # One set of random weights, packed once: each variant's layers take device copies of the
    # packed weights (as `moegen bench` stacks its layers), unless a variant packs them otherwise.
    weights = _random_weights(variants[0][1], rng)
    xs = {n: [_random_x(variants[0][1], n, rng) for _ in range(count)] for n in tokens}
    ids = {n: [_random_ids(spec, n, rng) for _ in range(count)] for n in tokens}  # (hash-routed layers)
    timer = _Timer(device)
    source: list[Any] = []  # the first layer loaded from `weights`, kept for its packed weights

    def timed(plan: Plan) -> dict[int, float]:  # us per layer at each token count
        gen = Path(tempfile.mkdtemp()) / spec.name
        write_dir(gen, render_all(spec, plan))
        stack = []
        for _ in range(count):
            layer = load(gen, device=device)
            try:
                layer.load_weights_from(stack[0] if stack else source[0])
            except (IndexError, ValueError):  # nothing packed yet, or another packed layout
                layer.load_weights(weights)
            stack.append(layer)
        us = {n: time_stack(timer, stack, xs[n], ids[n]) for n in tokens}
        if not source:
            source.append(stack.pop(0))
            if only == ("prefill_cut",):  # every variant packs the weights alike: the raw ones are not read again
                weights.clear()
                release_torch_cache()
        for layer in stack:
            layer.close()
        return us

    print(f"{spec.name} on {device.name}, {date.today().isoformat()}: us per layer, {count} layers per replay")
    table: dict[Tuning, dict[int, float]] = {}
    seen: set[tuple] = set()
    try:
        if only == ("prefill_cut",):
            return _tune_cut(spec, tokens, timed, out_root, write, device.name, ref, name)
        for tuning, plan in variants:
            launches = tuple(b.launches for b in plan.buckets)
            if launches in seen:  # the same kernels as a variant already timed (e.g. no bucket fused either way)
                continue
            seen.add(launches)
            table[tuning] = timed(plan)
    finally:
        for layer in source:
            layer.close()
    base = table.get(ref) or next(iter(table.values()))

    def score(t: Tuning) -> float:  # geometric mean of the time ratios to the reference plan
        return math.exp(statistics.mean(math.log(table[t][n] / base[n]) for n in tokens))

    best = min(table, key=score)
    print(f"{'variant':<24} " + " ".join(f"{'N=' + str(n):>9}" for n in tokens) + f"   vs {name}")
    for t in table:
        mark = "  <- best" if t == best else (f"  ({name})" if t == ref else "")
        print(f"{_label(t):<24} " + " ".join(f"{table[t][n]:>9.1f}" for n in tokens) + f"   {score(t):>6.3f}{mark}")
    if write:
        _write(out_root, spec, best, device.name, {_label(t): table[t] for t in table})
    return 0


def _write(out_root: str, spec: Spec, best: Tuning, gpu: str, us: dict[str, Any]) -> None:
    p = tuning_path(out_root, spec.name)
    p.parent.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {**asdict(best), "gpu": gpu, "date": date.today().isoformat(), "us": us}
    p.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"{p}: {_label(best)} (rebuild the spec to use it)")


def pick_cut(cuts: list[int], gemv: dict[int, float], prefill: dict[int, float]) -> int:
    """The cut whose path at each measured N (the GEMV path up to the cut, the prefill kernels past
    it) takes the least time, as a geometric mean over the N; the largest such cut on a tie."""
    def cost(c: int) -> float:
        return sum(math.log(gemv[n] if n <= c else prefill[n]) for n in gemv)

    return min(reversed(cuts), key=cost)


def gemv_top(plan: Plan) -> int:
    """The GEMV path's largest N in a plan (its cut; the largest bucket where no bucket runs the prefill kernels)."""
    return max(b.max_tokens for b in plan.buckets if not plan.prefill_from or b.max_tokens < plan.prefill_from)


def cut_gain(cut: int, ref_cut: int, cut_us: dict[int, float], ref_us: dict[int, float]) -> tuple[float, float]:
    """What a cut gains over the reference plan's (ref_cut), and the measurement's noise, as mean and
    largest log ratios of times: the gain over the N between the two cuts (the only N where the
    plans launch other kernels: negative where the cut is faster; 0 where there are none), the
    noise over the other N, where both plans run the same kernels (0 where there are none)."""
    lo, hi = min(cut, ref_cut), max(cut, ref_cut)
    ratio = {n: math.log(cut_us[n] / ref_us[n]) for n in cut_us}
    inside = [r for n, r in ratio.items() if lo < n <= hi]
    return (statistics.mean(inside) if inside else 0.0,
            max((abs(r) for n, r in ratio.items() if not lo < n <= hi), default=0.0))


def _tune_cut(spec: Spec, tokens: list[int], timed: Any, out_root: str, write: bool, gpu: str,
              ref: Tuning, name: str) -> int:
    """`--only prefill_cut`: the two paths timed whole at every N (the GEMV path through the
    largest cut, the prefill kernels from past the smallest), the cut placed where they cross
    (pick_cut), then that cut's plan timed against the reference plan's (`name`: a kept tuning,
    else the analytic plan); the faster is kept."""
    cuts = _cuts(spec)
    if not cuts:
        print(f"{spec.name}: no prefill bucket to cut (max_tokens {spec.max_tokens})")
        return 0

    def cut_at(c: int) -> Tuning:
        return on(ref, Tuning(prefill_cut=c))

    gemv = timed(make_plan(spec, tuning=cut_at(max(max(cuts), max(tokens)))))
    prefill = timed(make_plan(spec, tuning=cut_at(max(1, min(min(cuts), min(tokens) - 1)))))
    cut = pick_cut(cuts, gemv, prefill)
    chosen, ref_plan = cut_at(cut), make_plan(spec, tuning=ref)
    table = {chosen: timed(make_plan(spec, tuning=chosen)), ref: timed(ref_plan)}
    print(f"{'N':>6} {'GEMV':>9} {'prefill':>9}  ratio  {'cut ' + str(cut):>9} {name:>9}")
    for n in tokens:
        print(f"{n:>6} {gemv[n]:>9.1f} {prefill[n]:>9.1f}  {prefill[n] / gemv[n]:5.3f}  "
              f"{table[chosen][n]:>9.1f} {table[ref][n]:>9.1f}")
    geo = {t: math.exp(statistics.mean(math.log(us[n]) for n in tokens)) for t, us in table.items()}
    # The cut is kept where, at the N between it and the reference plan's cut, it is faster by more
    # than the two plans differ where they run the same kernels (the rounds' spread)
    gain, noise = cut_gain(cut, gemv_top(ref_plan), table[chosen], table[ref])
    best = chosen if gain < -noise else ref
    print(f"crossover cut {cut}: {geo[chosen]:.1f} us geometric mean against the {name} plan's "
          f"{geo[ref]:.1f} (its cut {gemv_top(ref_plan)}); between the cuts {100 * (math.exp(gain) - 1):+.1f}%, "
          f"elsewhere within {100 * (math.exp(noise) - 1):.1f}%; "
          f"{'the cut' if best == chosen else 'the ' + name + ' plan'} kept")
    if write:
        _write(out_root, spec, best, gpu, {"GEMV": gemv, "prefill": prefill,
                                           **{_label(t): table[t] for t in table}})
    return 0
