"""CPU tests of the build: rendering, the generated/ golden files, NVRTC compiles, the cubin cache,
located compile errors, and the all-or-nothing output directory. No GPU needed (NVRTC only)."""

from __future__ import annotations

import difflib
import hashlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import moegen
import moegen.build as build_mod
import moegen.nvrtc as nvrtc_mod
from moegen.build import MANIFEST_FILE, BuildError, build, manifest, manifest_text, render_all, tuned_plan, write_dir
from moegen.nvrtc import Compiled, CompileError, cache_key, compile_cuda, compile_parts, nvrtc_version
from moegen.plan import Plan, PlanError, make_plan
from moegen.render import CUDA_FILE, LAUNCHER_FILE
from moegen.spec import Spec, load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
GENERATED = ROOT / "generated"
QWEN = ROOT / "specs" / "qwen3-30b-a3b.yaml"
ARCH = "sm_90a"
STALE_HINT = "run `moegen build specs/*.yaml` and commit generated/"
RESOURCE_FIELDS = ("registers", "smem_bytes", "stack_bytes", "spill_stores", "spill_loads")
# The directory holding the moegen package these tests import, for child processes to import the same one.
PKG_PARENT = str(Path(moegen.__file__).resolve().parent.parent)

# A tiny kernel: the cache tests compile it in milliseconds.
SMALL = 'extern "C" __global__ void moegen_cache_probe(float* p) { p[threadIdx.x] *= 2.0f; }\n'


def ids(p: Path) -> str:
    return p.stem


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty cubin cache; nothing here touches ~/.cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv("MOEGEN_CACHE", str(root))
    return root


@dataclass(frozen=True)
class Made:
    spec: Spec
    plan: Plan
    files: dict[str, str]
    compiled: Compiled


@pytest.fixture(scope="session")
def made():
    """spec path -> its spec, plan, rendered files and cubin; each spec is compiled once per session."""
    memo: dict[Path, Made] = {}

    def get(path: Path) -> Made:
        if path not in memo:
            spec = load_spec(path)
            plan = tuned_plan(spec, GENERATED)  # (a tuning file kept in generated/ revises its spec's build)
            files = render_all(spec, plan)
            display = f"generated/{spec.name}/{CUDA_FILE}"
            memo[path] = Made(spec, plan, files, compile_parts(files[CUDA_FILE], plan.arch, plan.parts, display,
                                                               use_cache=False))
        return memo[path]

    return get


def qwen_source() -> str:
    spec = load_spec(QWEN)
    return render_all(spec, make_plan(spec))[CUDA_FILE]


def cache_entries(root: Path) -> list[str]:
    """What the cache directory holds besides lock files: entries and any leftovers (temporary directories)."""
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.name != "locks" and not p.name.endswith(".lock"))


def no_dot_entries(d: Path) -> list[str]:
    """Temporary or backup directories the build leaves beside its output (there must be none)."""
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


# ----------------------------------------------------------------------------- rendering


def test_catalog_is_not_empty():
    assert len(SPECS) >= 10, f"specs/ should hold the model catalog, found {[p.name for p in SPECS]}"


@pytest.mark.parametrize("path", SPECS, ids=ids)
def test_rendering_is_deterministic(path: Path):
    a = render_all(load_spec(path), make_plan(load_spec(path)))
    b = render_all(load_spec(path), make_plan(load_spec(path)))
    assert set(a) == {CUDA_FILE, LAUNCHER_FILE}
    for name in a:
        assert a[name].encode() == b[name].encode(), f"{path.stem}/{name} differs between two renderings"


def test_rendering_does_not_depend_on_the_process():
    """Another interpreter with another hash seed renders the same bytes (no set or id() order leaks in)."""
    code = (
        "import hashlib, json, sys\n"
        "from moegen.build import render_all\nfrom moegen.plan import make_plan\nfrom moegen.spec import load_spec\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    s = load_spec(p)\n"
        "    for n, t in render_all(s, make_plan(s)).items():\n"
        "        out[f'{s.name}/{n}'] = hashlib.sha256(t.encode()).hexdigest()\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": PKG_PARENT}
    r = subprocess.run([sys.executable, "-c", code, *map(str, SPECS)], env=env, capture_output=True, text=True, check=False,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    theirs = json.loads(r.stdout)
    ours = {}
    for p in SPECS:
        s = load_spec(p)
        for n, t in render_all(s, make_plan(s)).items():
            ours[f"{s.name}/{n}"] = hashlib.sha256(t.encode()).hexdigest()
    assert theirs == ours


# ----------------------------------------------------------------------------- generated/ is up to date


def stale_message(rel: str, committed: str, fresh: str) -> str:
    diff = list(difflib.unified_diff(committed.splitlines(), fresh.splitlines(), f"committed {rel}", "fresh build",
                                     lineterm="", n=1))
    shown = "\n".join(diff[:40]) + ("\n..." if len(diff) > 40 else "")
    return f"generated/{rel} is stale: {STALE_HINT}\n{shown}"


def test_generated_holds_one_directory_per_spec():
    names = {load_spec(p).name for p in SPECS}
    dirs = {p.name for p in GENERATED.iterdir() if p.is_dir()}
    assert dirs == names, (f"generated/ has {sorted(dirs - names)} without a spec, lacks {sorted(names - dirs)}: "
                           f"{STALE_HINT} (and remove directories of deleted specs)")
    for d in dirs:
        assert sorted(os.listdir(GENERATED / d)) == sorted([CUDA_FILE, LAUNCHER_FILE, MANIFEST_FILE]), d


@pytest.mark.parametrize("path", SPECS, ids=ids)
def test_generated_sources_are_up_to_date(path: Path):
    spec = load_spec(path)
    for name, fresh in render_all(spec, tuned_plan(spec, GENERATED)).items():
        f = GENERATED / spec.name / name
        assert f.is_file(), f"generated/{spec.name}/{name} is missing: {STALE_HINT}"
        committed = f.read_bytes().decode()
        assert committed == fresh, stale_message(f"{spec.name}/{name}", committed, fresh)


def without_nvrtc_fields(m: dict) -> dict:
    """The manifest less what depends on the local NVRTC (its version and ptxas's per-kernel report)."""
    m = {k: v for k, v in m.items() if k != "nvrtc"}
    m["kernels"] = [{k: v for k, v in kern.items() if k not in RESOURCE_FIELDS} for kern in m["kernels"]]
    return m


@pytest.mark.parametrize("path", SPECS, ids=ids)
def test_generated_manifest_is_up_to_date(path: Path, made):
    m = made(path)
    f = GENERATED / m.spec.name / MANIFEST_FILE
    assert f.is_file(), f"generated/{m.spec.name}/{MANIFEST_FILE} is missing: {STALE_HINT}"
    committed_text = f.read_text()
    fresh_text = manifest_text(m.spec, m.plan, m.compiled)
    committed, fresh = json.loads(committed_text), json.loads(fresh_text)
    rel = f"{m.spec.name}/{MANIFEST_FILE}"
    if committed.get("nvrtc") == fresh["nvrtc"]:
        assert committed_text == fresh_text, stale_message(rel, committed_text, fresh_text)
    else:  # built with another NVRTC: registers and spills may differ, nothing else may
        a, b = without_nvrtc_fields(committed), without_nvrtc_fields(fresh)
        assert a == b, stale_message(rel, json.dumps(a, indent=1), json.dumps(b, indent=1))


def fake_generated(tmp_path: Path, m: Made, manifest_text_: str) -> Path:
    fake = tmp_path / "generated"
    (fake / m.spec.name).mkdir(parents=True)
    (fake / m.spec.name / MANIFEST_FILE).write_text(manifest_text_)
    return fake


def test_manifest_check_tolerates_only_another_nvrtc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made):
    """Built with another NVRTC: its registers may differ; launch geometry may not."""
    m = made(QWEN)
    other = json.loads(manifest_text(m.spec, m.plan, m.compiled))
    other["nvrtc"] = "0.1"
    for k in other["kernels"]:
        k["registers"] += 2
    monkeypatch.setattr(sys.modules[__name__], "GENERATED", fake_generated(tmp_path / "a", m, json.dumps(other)))
    test_generated_manifest_is_up_to_date(QWEN, made)  # passes
    other["buckets"][0]["launches"][0]["block"] += 32
    monkeypatch.setattr(sys.modules[__name__], "GENERATED", fake_generated(tmp_path / "b", m, json.dumps(other)))
    with pytest.raises(AssertionError, match=re.escape(STALE_HINT)):
        test_generated_manifest_is_up_to_date(QWEN, made)
    same = json.loads(manifest_text(m.spec, m.plan, m.compiled))
    same["kernels"][0]["registers"] += 2  # same NVRTC: every byte must match
    monkeypatch.setattr(sys.modules[__name__], "GENERATED", fake_generated(tmp_path / "c", m, json.dumps(same)))
    with pytest.raises(AssertionError, match=re.escape(STALE_HINT)):
        test_generated_manifest_is_up_to_date(QWEN, made)


def test_stale_file_is_reported_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The up-to-date check itself fails on a stale file, and says what to run."""
    spec = load_spec(QWEN)
    fresh = render_all(spec, make_plan(spec))[CUDA_FILE]
    stale = fresh.replace("static_assert", "static_assert /* edited */", 1)
    fake = tmp_path / "generated"
    (fake / spec.name).mkdir(parents=True)
    (fake / spec.name / CUDA_FILE).write_text(stale)
    (fake / spec.name / LAUNCHER_FILE).write_text(render_all(spec, make_plan(spec))[LAUNCHER_FILE])
    monkeypatch.setattr(sys.modules[__name__], "GENERATED", fake)
    with pytest.raises(AssertionError) as ei:
        test_generated_sources_are_up_to_date(QWEN)
    assert "moegen build specs/*.yaml" in str(ei.value)
    assert f"generated/{spec.name}/{CUDA_FILE} is stale" in str(ei.value)


# ----------------------------------------------------------------------------- NVRTC: every spec compiles


@pytest.mark.parametrize("path", SPECS, ids=ids)
def test_spec_compiles_without_spills_or_stack(path: Path, made):
    m = made(path)
    assert m.compiled.cubins and all(c[:4] == b"\x7fELF" for c in m.compiled.cubins)
    res = m.compiled.resources
    assert set(res) == {k.name for k in m.plan.kernels}, "ptxas -v did not report every kernel"
    bad = {n: r for n, r in res.items() if r.spill_stores or r.spill_loads or r.stack_bytes}
    assert not bad, f"{path.stem}: kernels that spill or use a stack frame: {bad}"
    assert all(r.registers > 0 for r in res.values())


# ----------------------------------------------------------------------------- kernel names


C_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def variant(path: Path, dotted: str, value: object) -> Plan:
    data = yaml.safe_load(path.read_text())
    obj = data
    *parents, last = dotted.split(".")
    for k in parents:
        obj = obj.setdefault(k, {})
    obj[last] = value
    return make_plan(parse_spec(data, f"{path.name} with {dotted}={value}"))


def names_by_family(plan: Plan) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for k in plan.kernels:
        out.setdefault(k.family, set()).add(k.name)
    return out


def test_kernel_names_are_readable_c_identifiers_carrying_the_shape():
    spec = load_spec(QWEN)
    plan = make_plan(spec)
    names = [k.name for k in plan.kernels]
    assert len(set(names)) == len(names), "two kernels of one layer share a name"
    for k in plan.kernels:
        assert C_IDENT.match(k.name) and k.name.startswith("moe_") and k.name.endswith(spec.arch), k.name
        parts = k.name.split("_")
        want = {"router": [f"h{plan.hidden}"],
                "route": [f"e{plan.experts}", f"k{plan.top_k}"],
                "gate_up": [f"e{plan.experts}", f"h{plan.hidden}", f"i{plan.inter}"],
                "down": [f"e{plan.experts}", f"h{plan.hidden}", f"i{plan.inter}", f"k{plan.top_k}"]}
        missing = [w for w in want.get(k.family, []) if w not in parts]
        assert not missing, f"{k.name} ({k.family}) does not carry {missing}"


# field, new value, the kernel families whose code that field shapes (their names must change)
NAME_CHANGES = [
    ("hidden_size", 4096, {"router", "gate_up", "down"}),
    ("experts.count", 64, {"router", "route", "gate_up", "down"}),
    ("experts.top_k", 4, {"route", "down"}),
    ("experts.intermediate_size", 1024, {"gate_up", "down"}),
]


@pytest.mark.parametrize("dotted,value,families", NAME_CHANGES, ids=[c[0] for c in NAME_CHANGES])
def test_changing_a_shape_changes_the_kernel_names(dotted: str, value: object, families: set[str]):
    base_plan, changed_plan = make_plan(load_spec(QWEN)), variant(QWEN, dotted, value)
    base, changed = names_by_family(base_plan), names_by_family(changed_plan)
    for fam in families:
        assert base[fam].isdisjoint(changed[fam]), (
            f"{dotted}={value} changes the {fam} kernels but not their names: {sorted(base[fam] & changed[fam])}")
    down_tiles = [next(w.mats for w in p.weights if w.name == "w2") for p in (base_plan, changed_plan)]
    if down_tiles[0] == down_tiles[1]:  # (the analytic down tiles follow whether the one-token kernel fits)
        assert base["pack"] == changed["pack"], "the weight packing kernels depend on the down tiles only"


# Spec changes that reshape some kernel; across them and the whole catalog, one name must always
# mean one kernel (FlashInfer's rule: every codegen parameter is in the name). Each case is a set
# of variants of the qwen3-30b-a3b spec that are compared with each other and with the catalog.
SHARED = {"intermediate_size": 1024}
SHAPING_CHANGES: dict[str, list[tuple[str, object]]] = {
    "catalog": [],
    **{d: [(d, v)] for d, v, _ in NAME_CHANGES},
    "max_tokens": [("max_tokens", 128)],
    "routed_scaling_factor": [("routing.routed_scaling_factor", 2.5)],
    "renormalize": [("routing.renormalize", False)],
    "logits_dtype": [("router.logits_dtype", "bf16")],
    "select": [("routing.select", "logits")],
    "shared_expert.gate": [("shared_expert", {**SHARED, "gate": "sigmoid"}), ("shared_expert", {**SHARED, "gate": "none"})],
}


@pytest.mark.parametrize("case", SHAPING_CHANGES)
def test_a_kernel_name_means_one_kernel(case: str):
    seen: dict[str, tuple] = {}
    catalog = [make_plan(load_spec(p)) for p in SPECS]
    variants = [variant(QWEN, d, v) for d, v in SHAPING_CHANGES[case]]
    clashes = set()
    for i, plan in enumerate(catalog + variants):
        for k in plan.kernels:
            code = (k.family, k.threads, k.targs, k.params, k.args, k.body)
            # clashes within the catalog are the "catalog" case's; the others report their variants'
            if seen.setdefault(k.name, code) != code and (case == "catalog" or i >= len(catalog)):
                clashes.add(k.name)
    assert not clashes, f"{case}: one kernel name stands for different code: {sorted(clashes)}"


# ----------------------------------------------------------------------------- the cubin cache


def test_second_compile_is_a_hit(cache: Path):
    a = compile_cuda(SMALL, ARCH)
    b = compile_cuda(SMALL, ARCH)
    assert (a.cached, b.cached) == (False, True)
    assert a.cubin == b.cubin and a.key == b.key and a.resources == b.resources
    assert "moegen_cache_probe" in a.resources
    assert cache_entries(cache) == [a.key]


def test_changed_source_misses(cache: Path):
    a = compile_cuda(SMALL, ARCH)
    b = compile_cuda(SMALL + "// one more comment\n", ARCH)
    assert not b.cached and b.key != a.key
    assert cache_entries(cache) == sorted([a.key, b.key])


def test_layer_compiles_as_parts_each_kernel_in_one():
    """The plan deals the kernels into parts (the longest to compile first, each to the lightest
    part); each part's program (MOE_PART defined) compiles exactly its kernels, every kernel is in
    one part, and compile_parts returns their cubins in part order with every kernel's resources."""
    spec = load_spec(ROOT / "specs" / "qwen1.5-moe-a2.7b.yaml")
    plan = make_plan(spec)
    src = render_all(spec, plan)[CUDA_FILE]
    assert plan.parts == 2 and {k.part for k in plan.kernels} == {0, 1}
    names = [{k.name for k in plan.kernels if k.part == p} for p in range(plan.parts)]
    for p in range(plan.parts):
        assert set(compile_cuda(src, plan.arch, use_cache=False, part=p).resources) == names[p]
    both = compile_parts(src, plan.arch, plan.parts, use_cache=False)
    assert len(both.cubins) == 2 and set(both.resources) == names[0] | names[1]
    with pytest.raises(ValueError, match="cubins"):
        both.cubin  # noqa: B018 - a layer in parts has no single cubin


def test_kernels_that_route_over_many_experts_weigh_more_when_dealt():
    """The route by a bound (more than ROUTE_BOUND experts, zero experts counted) compiles longer:
    the route kernel, the router that routes and the one-token kernel of Qwen3-Next-80B-A3B (512
    experts) and LongCat-Flash (512 and 256 zero experts) carry ROUTE_BOUND_COST; Qwen3-30B-A3B's (128)
    and the hash-routed DeepSeek-V4-Flash's do not, nor does a router that does not route."""
    from moegen import plan as P

    def routing(name: str) -> dict[str, float]:
        plan = make_plan(load_spec(ROOT / "specs" / f"{name}.yaml"))
        return {k.name: P.compile_cost(k) for k in plan.kernels
                if k.family in ("route", "single") or (k.family == "router" and "_route_" in k.name)}

    def base(name: str) -> float:
        family = name.split("_")[1]
        two = family == "single" and "_x2_" in name  # the two-token kernel
        return P.COMPILE_COST[family + ("+route" if family == "router" else "+x2" if two else "")]

    for name in ("qwen3-next-80b-a3b", "longcat-flash"):
        costs = routing(name)
        assert len(costs) >= 2
        assert all(c == pytest.approx(base(k) + P.ROUTE_BOUND_COST) for k, c in costs.items()), (name, costs)
    for name in ("qwen3-30b-a3b", "deepseek-v4-flash-hash"):
        costs = routing(name)
        assert len(costs) >= 2 and all(c == pytest.approx(base(k)) for k, c in costs.items()), (name, costs)
    plain = [k for k in make_plan(load_spec(ROOT / "specs" / "qwen3-next-80b-a3b.yaml")).kernels
             if k.family == "router" and "_route_" not in k.name]
    assert plain and all(P.compile_cost(k) == P.COMPILE_COST["router"] for k in plain)


def test_the_two_token_kernel_and_the_staged_down_gemm_weigh_less_when_dealt():
    """Qwen3-30B-A3B's two-token kernel is dealt at "single+x2" and its down GEMM with the staged Y tile
    at "prefill_gemm_down+sy" (each compiles in well under its family's time), the one-token kernel
    and the gate/up GEMM at their families'; the dealing leaves the two parts within one small
    kernel of each other."""
    from moegen import plan as P

    plan = make_plan(load_spec(ROOT / "specs" / "qwen3-30b-a3b.yaml"))
    cost = {k.name: P.compile_cost(k) for k in plan.kernels}
    single = {k.name: cost[k.name] for k in plan.kernels if k.family == "single"}
    assert sorted(single.values()) == [P.COMPILE_COST["single+x2"], P.COMPILE_COST["single"]], single
    assert all(("_x2_" in n) == (c == P.COMPILE_COST["single+x2"]) for n, c in single.items())
    (down,) = [k for k in plan.kernels if k.family == "prefill_gemm_down"]
    (gate_up,) = [k for k in plan.kernels if k.family == "prefill_gemm_gate_up"]
    assert "_sy_" in down.name and cost[down.name] == P.COMPILE_COST["prefill_gemm_down+sy"]
    assert cost[gate_up.name] == P.COMPILE_COST["prefill_gemm_gate_up"]
    load = [sum(cost[k.name] for k in plan.kernels if k.part == p) for p in range(plan.parts)]
    assert plan.parts == 2 and abs(load[0] - load[1]) <= 0.1, load


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-next-80b-a3b", "olmoe-1b-7b"])
def test_the_one_and_two_token_kernels_are_dealt_to_one_part(name):
    """The one- and two-token kernels share most of their templates: they go to one part, dealt as one
    unit at the sum of their costs, and the parts stay within the largest other kernel of each other."""
    from moegen import plan as P

    plan = make_plan(load_spec(ROOT / "specs" / f"{name}.yaml"))
    singles = [k for k in plan.kernels if k.family == "single"]
    assert len(singles) == 2 and singles[0].part == singles[1].part, [(k.name, k.part) for k in singles]
    cost = {k.name: P.compile_cost(k) for k in plan.kernels}
    load = [sum(cost[k.name] for k in plan.kernels if k.part == p) for p in range(plan.parts)]
    largest_other = max(c for n, c in cost.items() if n not in {k.name for k in singles})
    assert plan.parts == 2 and abs(load[0] - load[1]) <= largest_other, load


def test_cache_key_covers_what_changes_a_binary(monkeypatch: pytest.MonkeyPatch):
    k = cache_key(SMALL, ARCH)
    assert k == cache_key(SMALL, ARCH) and re.fullmatch(r"[0-9a-f]{64}", k)
    assert cache_key(SMALL + " ", ARCH) != k
    assert cache_key(SMALL, "sm_90") != k
    monkeypatch.setattr(nvrtc_mod, "nvrtc_version", lambda: "99.9")
    assert cache_key(SMALL, ARCH) != k
    monkeypatch.undo()
    monkeypatch.setattr(nvrtc_mod, "__version__", "0.0.0-other")
    assert cache_key(SMALL, ARCH) != k
    monkeypatch.undo()
    monkeypatch.setattr(nvrtc_mod, "options_of", lambda arch, part=None: {"arch": arch, "std": "c++20",
                                                                        "ptxas_options": ["-v"]})
    assert cache_key(SMALL, ARCH) != k
    monkeypatch.undo()
    assert len({k, cache_key(SMALL, ARCH, 0), cache_key(SMALL, ARCH, 1)}) == 3  # each part of a layer its own entry


def damage_truncate(entry: Path) -> None:
    with open(entry / "layer.cubin", "r+b") as f:
        f.truncate(100)


def damage_overwrite(entry: Path) -> None:
    (entry / "layer.cubin").write_bytes(b"\x7fELF" + b"\0" * 64)


def damage_empty(entry: Path) -> None:
    (entry / "layer.cubin").write_bytes(b"")


def damage_no_meta(entry: Path) -> None:
    (entry / "meta.json").unlink()


def damage_bad_meta(entry: Path) -> None:
    (entry / "meta.json").write_text("[1, 2")


def damage_meta_not_a_dict(entry: Path) -> None:
    (entry / "meta.json").write_text("[1, 2]")


def damage_no_cubin(entry: Path) -> None:
    (entry / "layer.cubin").unlink()


DAMAGES = [damage_truncate, damage_overwrite, damage_empty, damage_no_meta, damage_bad_meta, damage_meta_not_a_dict,
           damage_no_cubin]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.removeprefix("damage_"))
def test_corrupt_entry_is_rebuilt_not_loaded(cache: Path, damage):
    good = compile_cuda(SMALL, ARCH)
    damage(cache / good.key)
    again = compile_cuda(SMALL, ARCH)
    assert not again.cached, "a damaged entry was loaded"
    assert again.cubin == good.cubin
    assert (cache / good.key / "layer.cubin").read_bytes() == good.cubin, "the entry was not rewritten"
    third = compile_cuda(SMALL, ARCH)
    assert third.cached and third.cubin == good.cubin
    assert cache_entries(cache) == [good.key]


def test_entry_of_another_key_is_not_loaded(cache: Path):
    """A valid entry copied under the wrong name (content addressing broken) is rebuilt."""
    a = compile_cuda(SMALL, ARCH)
    other = SMALL + "// other\n"
    key = cache_key(other, ARCH)
    (cache / a.key).rename(cache / key)
    b = compile_cuda(other, ARCH)
    assert not b.cached and b.key == key


def _compile_in_child(source: str, cache_root: str, barrier, results) -> None:
    os.environ["MOEGEN_CACHE"] = cache_root
    from moegen.nvrtc import compile_cuda as compile_

    barrier.wait(timeout=60)  # both processes reach the cache at the same moment
    c = compile_(source, ARCH)
    results.put((c.cached, hashlib.sha256(c.cubin).hexdigest(), c.key))


def test_concurrent_compiles_of_one_source(cache: Path):
    source = qwen_source() + "// concurrent test\n"  # a real layer: long enough for the two to overlap
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(source, str(cache), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    got = [results.get(timeout=10) for _ in procs]
    assert sorted(g[0] for g in got) == [False, True], f"the lock did not make one process wait for the other: {got}"
    assert got[0][1:] == got[1][1:], "the two processes got different cubins"
    key = got[0][2]
    assert cache_entries(cache) == [key], "expected one entry and no temporary directories"
    hit = compile_cuda(source, ARCH)
    assert hit.cached and hashlib.sha256(hit.cubin).hexdigest() == got[0][1]


# ----------------------------------------------------------------------------- compile errors


PLANTED = "__device__ void planted_error() { int x = ; }\n"


def planted(source: str) -> tuple[str, int]:
    """The source with a syntax error at file scope; and its 1-based line."""
    lines = source.splitlines(keepends=True)
    n = next(i for i, line in enumerate(lines) if line.startswith('extern "C"'))
    lines.insert(n, PLANTED)
    return "".join(lines), n + 1


def test_compile_error_is_located(cache: Path):
    bad, line = planted(qwen_source())
    display = "generated/qwen3-30b-a3b/layer.cu"
    with pytest.raises(CompileError) as ei:
        compile_cuda(bad, ARCH, display=display)
    msg = str(ei.value)
    first = msg.splitlines()[0]
    assert first.startswith(f"{display}:{line}: error: "), first
    assert "expected an expression" in first
    excerpt_line = rf"^>\s*{line} \| {re.escape(PLANTED.rstrip())}$"
    assert re.search(excerpt_line, msg, re.MULTILINE), "no numbered excerpt with the failing line"
    assert re.search(rf"^ \s*{line - 1} \| ", msg, re.MULTILINE) and re.search(rf"^ \s*{line + 1} \| ", msg, re.MULTILINE)
    assert "full log:" in msg and f"layer.cu({line}): error" in msg, "the full NVRTC log is missing"
    assert "\x00" not in msg
    assert cache_entries(cache) == [], "a failed compile left something in the cache"


def test_compile_error_without_cache(cache: Path):
    bad, line = planted(qwen_source())
    with pytest.raises(CompileError, match=rf"^x/layer.cu:{line}: error"):
        compile_cuda(bad, ARCH, display="x/layer.cu", use_cache=False)
    assert not cache.exists()


# ----------------------------------------------------------------------------- the build


def test_build_writes_exactly_the_generated_files(tmp_path: Path):
    out = tmp_path / "out"
    r = build(QWEN, out)
    d = out / r.spec.name
    assert r.out_dir == d and sorted(os.listdir(out)) == [r.spec.name]
    assert sorted(os.listdir(d)) == sorted([CUDA_FILE, LAUNCHER_FILE, MANIFEST_FILE])
    files = render_all(r.spec, r.plan)
    for name, text in files.items():
        assert (d / name).read_text() == text
    m = json.loads((d / MANIFEST_FILE).read_text())
    assert m["spec_sha256"] == load_spec(QWEN).digest()
    assert m["moegen"] == moegen.__version__ and m["nvrtc"] == nvrtc_version() and m["arch"] == ARCH
    assert [k["name"] for k in m["kernels"]] == [k.name for k in r.plan.kernels]
    for k in m["kernels"]:
        missing = [f for f in RESOURCE_FIELDS if not isinstance(k.get(f), int)]
        assert not missing and k["registers"] > 0, f"{k['name']}: no {missing} in the manifest"
    names = {k.name for k in r.plan.kernels}
    assert [b["max_tokens"] for b in m["buckets"]] == [b.max_tokens for b in r.plan.buckets]
    for b in m["buckets"]:
        assert b["launches"], b
        for ln in b["launches"]:
            assert ln["kernel"] in names and len(ln["grid"]) == 2 and ln["block"] > 0
    assert m == json.loads(json.dumps(manifest(r.spec, r.plan, r.compiled)))


def test_rebuild_is_a_cache_hit_with_identical_bytes(tmp_path: Path):
    first = build(QWEN, tmp_path / "a")
    second = build(QWEN, tmp_path / "b")
    assert not first.compiled.cached and second.compiled.cached
    for name in (CUDA_FILE, LAUNCHER_FILE, MANIFEST_FILE):
        assert (first.out_dir / name).read_bytes() == (second.out_dir / name).read_bytes(), name


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_failed_compile_leaves_the_previous_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    out = tmp_path / "out"
    r = build(QWEN, out)
    before = snapshot(r.out_dir)
    real = build_mod.render_all

    def broken(spec, plan):
        files = real(spec, plan)
        files[CUDA_FILE] = planted(files[CUDA_FILE])[0]
        return files

    monkeypatch.setattr(build_mod, "render_all", broken)
    with pytest.raises(CompileError, match=re.escape(str(r.out_dir / CUDA_FILE))):
        build(QWEN, out)
    assert snapshot(r.out_dir) == before
    assert no_dot_entries(out) == [] and sorted(os.listdir(out)) == [r.spec.name]
    with pytest.raises(CompileError):
        build(QWEN, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists(), "a failed build created its output directory"


@pytest.mark.parametrize("where", ["under_a_file", "a_file", "name_is_a_file"])
def test_unwritable_output_is_one_clear_error(tmp_path: Path, where: str):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory\n")
    if where == "under_a_file":
        out = blocker / "sub"
    elif where == "a_file":
        out = blocker
    else:
        out = tmp_path / "root"
        out.mkdir()
        (out / "qwen3-30b-a3b").write_text("a file where the output directory goes\n")
    with pytest.raises(BuildError) as ei:
        build(QWEN, out)
    msg = str(ei.value)
    assert "\n" not in msg and str(out) in msg and "not a directory" in msg.lower(), msg
    assert blocker.read_text() == "not a directory\n"
    left = {"cache", "file"} | ({"root"} if where == "name_is_a_file" else set())
    assert {p.name for p in tmp_path.iterdir()} <= left, "the failed build created something"
    if where == "name_is_a_file":
        assert os.listdir(out) == ["qwen3-30b-a3b"]


def test_failed_swap_restores_the_previous_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    out_dir = tmp_path / "out" / "layer"
    write_dir(out_dir, {"a.txt": "old\n"})
    real = os.replace

    def failing(src, dst):
        if Path(src).name.startswith(".layer.") and ".old-" not in Path(src).name:
            raise OSError(28, "No space left on device")  # the new directory cannot be moved in
        return real(src, dst)

    monkeypatch.setattr(build_mod.os, "replace", failing)
    with pytest.raises(BuildError, match="No space left on device"):
        write_dir(out_dir, {"a.txt": "new\n", "b.txt": "new\n"})
    monkeypatch.undo()
    assert snapshot(out_dir) == {"a.txt": b"old\n"}
    assert no_dot_entries(out_dir.parent) == []
    write_dir(out_dir, {"a.txt": "new\n"})
    assert snapshot(out_dir) == {"a.txt": b"new\n"} and no_dot_entries(out_dir.parent) == []


def test_unsupported_arch_is_a_spec_error_naming_the_field(tmp_path: Path):
    from moegen.spec import SpecError

    with pytest.raises(SpecError, match=r"\barch\b.*sm_90a"):
        build(QWEN, tmp_path / "out", arch="sm_80")
    assert not (tmp_path / "out").exists()
    assert build(QWEN, tmp_path / "out", arch="sm_90a").plan.arch == "sm_90a"


@pytest.mark.parametrize("body, match", [
    ({"hidden_size": 40}, r"hidden_size=40: the bf16 kernels need a multiple of 32"),
    ({"hidden_size": 64}, r"hidden_size=64: the router kernel's 4 warps need at least 128"),
    ({"experts": {"count": 8, "top_k": 2, "intermediate_size": 96, "format": "fp8_block"}},
     r"experts\.intermediate_size=96: FP8 128x128 block weights need a multiple of 128"),
])
def test_shapes_the_kernels_cannot_take_are_plan_errors(body, match):
    """Refused by the planner with the field named, before any source is rendered or compiled."""
    from moegen.plan import PlanError, make_plan
    from moegen.spec import parse_spec

    spec = parse_spec({"name": "s", "model": "m", "hidden_size": 256,
                       "experts": {"count": 8, "top_k": 2, "intermediate_size": 64}, **body})
    with pytest.raises(PlanError, match=match):
        make_plan(spec)


def test_a_tuning_file_revises_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`moegen tune --write` leaves <out>/<name>.tuning.json; the next build of the spec into that
    root uses it (kernel names carry the values), compiles, and a malformed file is one
    clear error that writes nothing."""
    monkeypatch.setenv("MOEGEN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    out.mkdir()
    name = load_spec(QWEN).name
    (out / f"{name}.tuning.json").write_text(json.dumps({"warps": 8, "down_tiles": 1, "prefetch": True, "router_split": 4,
                                                         "gpu": "test"}))
    r = build(QWEN, out)
    names = [k.name for k in r.plan.kernels]
    assert any("_w8_" in n for n in names if n.startswith("moe_gate_up")), names
    assert all("_t1_pf_" in n for n in names if n.startswith("moe_down")), names
    decode = {ln.kernel for b in r.plan.buckets if b.max_tokens < r.plan.prefill_from for ln in b.launches}
    assert all("_ks4_" in n for n in decode if n.startswith("moe_router")), names  # prefill routers split N
    assert set(r.compiled.resources) == set(names)  # every kernel compiled (moegen tune weighs any spills)
    assert sorted(os.listdir(out)) == sorted([name, f"{name}.tuning.json"])
    (out / f"{name}.tuning.json").write_text("{\"warps\": 8}")
    before = (out / name / CUDA_FILE).read_text()
    with pytest.raises(BuildError, match=r"qwen3-30b-a3b\.tuning\.json: not a tuning file"):
        build(QWEN, out)
    assert (out / name / CUDA_FILE).read_text() == before
    (out / f"{name}.tuning.json").write_text(json.dumps({"warps": 4, "down_tiles": 2, "prefetch": "yes"}))
    with pytest.raises(BuildError, match="prefetch is 'yes', not true or false"):
        build(QWEN, out)
    (out / f"{name}.tuning.json").write_text(json.dumps({"warps": 4, "down_tiles": 2, "router_split": 3}))
    with pytest.raises(PlanError, match="tuning router_split=3: a divisor of hidden_size/32=64"):
        build(QWEN, out)
    (out / f"{name}.tuning.json").write_text(json.dumps({"warps": 3, "down_tiles": 2}))
    with pytest.raises(PlanError, match="tuning warps=3: 2, 4 or 8"):
        build(QWEN, out)


def test_a_tuning_file_keeps_a_three_way_choice(tmp_path: Path):
    """A choice whose analytic value is None (on where it applies) reads back as written: false
    turns it off (as an integer 0 it would have read as "set", and stayed on), null leaves it to
    the plan, anything else is an error naming it."""
    from moegen.build import read_tuning

    name = load_spec(QWEN).name
    path = tmp_path / f"{name}.tuning.json"
    for value in (False, True, None):
        path.write_text(json.dumps({"warps": 4, "down_tiles": 2, "single_tmap": value}))
        assert read_tuning(tmp_path, name).single_tmap is value
    # with down by rows, one tensor map over the routed down weights where the copies use them; down
    # by columns (the analytic plan's for this layer) copies none
    maps = {(False, False): 0, (None, False): 1, (None, None): 0}
    for (value, cols), count in maps.items():
        path.write_text(json.dumps({"warps": 4, "down_tiles": 2, "single_tmap": value, "single_cols": cols}))
        assert len(make_plan(load_spec(QWEN), tuning=read_tuning(tmp_path, name)).tensor_maps) == count
    path.write_text(json.dumps({"warps": 4, "down_tiles": 2, "single_tmap": 0}))
    with pytest.raises(BuildError, match="single_tmap is 0, not true, false or null"):
        read_tuning(tmp_path, name)


def test_gate_up_grids_of_one_wave_take_a_shallower_ring():
    """Qwen3-30B-A3B's N = 2 gate/up grid in three launches (the tuning single_two false; 16 expert
    slots x 48 tiles = 768 blocks) is more than the 132 x 5 blocks of 4-chunk rings (40 KB each) a
    multiprocessor holds and no more than the 132 x 7 of 3-chunk rings (30 KB): that bucket's kernel
    has 3 chunks a warp and asks for 7 blocks; N = 4 (1536 blocks, more than either) and N = 8 keep
    the full ring."""
    from moegen.families import Tuning

    plan = make_plan(load_spec(QWEN), tuning=Tuning(single_two=False))
    gate_up = {b.max_tokens: plan.kernel(b.launches[1].kernel) for b in plan.buckets if 2 <= b.max_tokens <= 8}
    launch = {b.max_tokens: b.launches[1] for b in plan.buckets if 2 <= b.max_tokens <= 8}
    assert all(k.family == "gate_up" for k in gate_up.values())
    assert launch[2].grid == (768, 1) and launch[4].grid == (1536, 1)
    assert gate_up[2].min_blocks == 7 and gate_up[2].targs[4] == "3" and gate_up[2].name.endswith("_b7_sm_90a")
    assert gate_up[4].min_blocks == 0 and gate_up[4].targs[4] == "4" and gate_up[4] == gate_up[8]


def test_down_by_columns_takes_layers_whose_down_rows_do_not_fit():
    """OLMoE's N = 1 block share of down rows (16 rows of 8 experts x 1024 K: 256 KB) does not fit
    a block's shared memory, so its one-token bucket ran router, gate/up and down; down by columns
    keeps none of them there: one launch, its dynamic shared memory only the reduction space.
    Every such kernel's static shared memory, as ptxas reports it in generated/, is within the
    48 KB a kernel may hold statically, as the plan's bound asks."""
    from moegen import families as F

    spec = load_spec(ROOT / "specs" / "olmoe-1b-7b.yaml")
    one = make_plan(spec).buckets[0]
    assert one.max_tokens == 1 and len(one.launches) == 1
    assert "_cols_" in one.launches[0].kernel and one.launches[0].smem < 16 * 1024
    rows = make_plan(spec, tuning=F.Tuning(single_cols=False)).buckets[0]
    assert [k.split("_")[1] for k in (ln.kernel for ln in rows.launches)] == ["router", "gate", "down"]
    seen = 0
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        kernels = json.loads((ROOT / "generated" / path.stem / MANIFEST_FILE).read_text())["kernels"]
        for k in kernels:
            if k["family"] == "single" and "_cols" in k["name"]:
                seen += 1
                assert k["smem_bytes"] <= F.STATIC_SMEM and k["spill_stores"] == 0, (path.stem, k)
    assert seen >= 11  # of 13 analytic ones: GLM-4.5's and Qwen3-Coder-480B's tuning files keep three launches


def test_a_tuning_fuses_small_buckets_where_the_partials_fit_l2():
    """The analytic plan keeps gate/up then down; a tuning (fused=N) runs router, fused expert
    (clusters of 2) and combine for the buckets up to N whose partial sums stay within the L2
    share; quantized and batch-invariant layers are never fused."""
    from moegen import families as F
    from moegen.plan import TARGETS

    assert not any(k.family in ("expert", "combine") for k in make_plan(load_spec(QWEN)).kernels)
    plan = make_plan(load_spec(QWEN), tuning=F.Tuning(fused=8))
    fams = {b.max_tokens: [plan.kernel(ln.kernel).family for ln in b.launches] for b in plan.buckets}
    assert fams[1] == fams[4] == ["router", "expert", "combine"]
    assert fams[8] == ["router", "gate_up", "down"]
    expert = next(k for k in plan.kernels if k.family == "expert")
    assert expert.cluster == 2 and all(k.cluster == 1 for k in plan.kernels if k is not expert)
    nf = int(expert.targs[11])
    part = next(b for b in plan.workspace if b.name == "part")
    assert nf == 4 and part.shape == (768 // 32, nf * 8, 2048)
    c = F.Layer.of(load_spec(QWEN), TARGETS[ARCH])
    assert F.part_bytes(c, 4) <= TARGETS[ARCH].l2_bytes // F.FUSED_PART_SHARE < F.part_bytes(c, 8)
    one = make_plan(load_spec(QWEN), tuning=F.Tuning(fused=1))
    assert [b.max_tokens for b in one.buckets
            if len(b.launches) > 1 and one.kernel(b.launches[1].kernel).family == "expert"] == [1]
    for body in ({"batch_invariant": True}, {"experts": {"count": 128, "top_k": 8, "intermediate_size": 768,
                                                          "format": "fp8_block"}}):
        data = {**yaml.safe_load(QWEN.read_text()), **body}
        p = make_plan(parse_spec(data, "variant"), tuning=F.Tuning(fused=8))
        assert not any(k.family in ("expert", "combine") for k in p.kernels), body


def test_bench_times_what_this_moegen_builds(tmp_path, capsys):
    """`moegen bench` times out_root/<name> only where it holds what this moegen renders from the
    spec; a directory from other templates or another version is left alone and a fresh build
    timed instead, and the run says so."""
    from moegen.bench import timed_dir

    spec = load_spec(ROOT / "specs" / "olmoe-1b-7b.yaml")
    plan = make_plan(spec)
    write_dir(tmp_path / spec.name, render_all(spec, plan))
    assert timed_dir(spec, plan, tmp_path) == tmp_path / spec.name
    assert capsys.readouterr().out == ""
    stale = tmp_path / spec.name / CUDA_FILE
    stale.write_text(stale.read_text() + "// from other templates\n")
    fresh = timed_dir(spec, plan, tmp_path)
    assert fresh != tmp_path / spec.name and (fresh / CUDA_FILE).read_text() == render_all(spec, plan)[CUDA_FILE]
    assert "is not what this moegen builds" in capsys.readouterr().out
    assert stale.read_text().endswith("// from other templates\n")  # left as it was
    assert timed_dir(spec, plan, tmp_path / "none") != tmp_path / "none" / spec.name  # no directory: a fresh one


def test_tune_can_vary_the_routed_experts_pass_width():
    """`moegen tune --only routed_nt` times the analytic plan against fixed pass widths for the
    routed experts (1, 2 or 4 groups of 8 tokens, never more than the bucket's): on Qwen3-30B-A3B
    (128 experts, top-8) the analytic N = 128 bucket passes 16 tokens (twice its mean of 8)."""
    from moegen.families import Tuning
    from moegen.tune import _valid

    spec = load_spec(ROOT / "specs" / "qwen3-30b-a3b.yaml")
    variants = _valid(spec, only=("routed_nt",))
    assert [t.routed_nt for t, _ in variants] == [0, 1, 2, 4]

    def gate_up(plan: Plan, nb: int) -> str:
        b = next(b for b in plan.buckets if b.max_tokens == nb)
        return next(ln.kernel for ln in b.launches if plan.kernel(ln.kernel).family == "gate_up")

    plans = {t.routed_nt: p for t, p in variants}
    assert "_nt2_" in gate_up(plans[0], 128) and "_nt4_" in gate_up(plans[4], 128) and "_nt1_" in gate_up(plans[1], 128)
    assert "_nt1_" in gate_up(plans[4], 8)  # never wider than the bucket's own (8 tokens)
    with pytest.raises(ValueError, match="routed_nt=5"):
        make_plan(spec, tuning=Tuning(routed_nt=5))


def test_a_tuning_cuts_the_gemv_path_at_any_token_count_and_tune_sweeps_the_cuts():
    """Tuning prefill_cut: the GEMV path up to that N, the prefill kernels from the next one on,
    with a bucket edge there where the power-of-two buckets have none; at a power of two it is a
    whole bucket (prefill_from's choice); with prefill_from, or past max_tokens, it is refused or
    has no prefill bucket. `moegen tune --only prefill_cut` sweeps every eighth of the analytic
    first prefill bucket and of the one below it, weighed by a token count between each two cuts."""
    from moegen.families import Tuning
    from moegen.tune import _valid, cut_tokens

    spec = load_spec(ROOT / "specs" / "qwen3-30b-a3b.yaml")

    def paths(plan: Plan) -> dict[int, bool]:  # bucket -> runs the prefill kernels
        return {b.max_tokens: any(plan.kernel(ln.kernel).family.startswith("prefill") for ln in b.launches)
                for b in plan.buckets}

    cut = make_plan(spec, tuning=Tuning(prefill_cut=200))
    p = paths(cut)
    assert cut.prefill_from == 256 and 200 in p and not p[128] and not p[200] and p[256] and p[512]
    whole = make_plan(spec, tuning=Tuning(prefill_cut=128))
    assert whole.prefill_from == 256 and paths(whole) == paths(make_plan(spec, tuning=Tuning(prefill_from=256)))
    assert [b.max_tokens for b in whole.buckets] == [b.max_tokens for b in make_plan(spec).buckets]
    assert not make_plan(spec, tuning=Tuning(prefill_cut=spec.max_tokens)).prefill_from
    with pytest.raises(ValueError, match="prefill_cut=200"):
        make_plan(spec, tuning=Tuning(prefill_cut=200, prefill_from=256))
    # the sweep: the analytic plan (from 257 on) and cuts from 128 to 512 (256 is the analytic one)
    variants = _valid(spec, only=("prefill_cut",))
    cuts = [t.prefill_cut for t, _ in variants]
    assert cuts[0] == 0 and cuts[1:] == [*range(128, 256, 16), *range(288, 513, 32)]
    tokens = cut_tokens(spec)
    allcuts = sorted({*cuts[1:], 256})
    assert len(tokens) == len(allcuts) - 1 and all(a < n <= b for a, b, n in zip(allcuts, allcuts[1:], tokens))


def test_tune_with_only_keeps_the_other_tuned_choices():
    """`moegen tune --only X` over a kept tuning file varies X on top of the file's other choices, so
    that --write does not drop them: the variants are the kept tuning with X changed (X's analytic
    value among them), and the reference is the kept tuning itself. A cut and a whole first
    prefill bucket are refused together, so setting either clears the other."""
    from moegen.families import Tuning
    from moegen.tune import _valid, on

    spec = load_spec(ROOT / "specs" / "qwen3-30b-a3b.yaml")
    kept = Tuning(warps=8, prefill_cut=192)
    cuts = _valid(spec, only=("prefill_cut",), base=kept)
    assert cuts[0][0] == kept and all(t.warps == 8 and not t.prefill_from for t, _ in cuts)
    assert {t.prefill_cut for t, _ in cuts} >= {0, 128, 192, 512} and len(cuts) > 10
    warps = [t for t, _ in _valid(spec, only=("warps",), base=kept)]
    assert kept in warps and Tuning(warps=4, prefill_cut=192) in warps
    assert all(t.prefill_cut == 192 for t in warps)
    assert on(kept, Tuning(prefill_from=512)) == Tuning(warps=8, prefill_from=512)
    assert on(Tuning(prefill_from=512), Tuning(prefill_cut=300)) == Tuning(prefill_cut=300)


def test_tune_places_the_cut_where_the_two_paths_cross():
    """`moegen tune --only prefill_cut` times the GEMV path and the prefill kernels at each N, then
    cuts where the curves cross: the GEMV path where it is faster, the prefill kernels past it. A
    GEMV path faster everywhere keeps the largest cut, the prefill kernels faster everywhere the
    smallest; a tie keeps the larger cut."""
    import random

    from moegen.tune import pick_cut

    cuts = [128, 160, 192, 224, 256]
    tokens = [144, 176, 208, 240]
    for cross in (150, 190, 230):
        gemv = {n: 100.0 + n for n in tokens}  # rises with N; the prefill kernels' time is flat
        prefill = {n: 100.0 + cross + random.uniform(-1, 1) for n in tokens}
        first = min(n for n in tokens if n > cross)  # the first N where the prefill kernels are faster
        assert pick_cut(cuts, gemv, prefill) == max(c for c in cuts if c < first)
    assert pick_cut(cuts, {n: 1.0 for n in tokens}, {n: 2.0 for n in tokens}) == 256
    assert pick_cut(cuts, {n: 2.0 for n in tokens}, {n: 1.0 for n in tokens}) == 128
    assert pick_cut(cuts, {n: 1.0 for n in tokens}, {n: 1.0 for n in tokens}) == 256


def test_tune_keeps_a_cut_only_where_it_gains_more_than_the_spread():
    """The cut's gain is judged at the N between it and the reference plan's cut (where the two
    plans launch other kernels), against the two plans' differences at the other N (the same
    kernels: the rounds' spread); the GEMV path's largest N of a plan is its cut."""
    import math

    from moegen.tune import cut_gain, gemv_top

    tokens = [40, 56, 60, 70, 100]
    ref = {n: 100.0 for n in tokens}
    cut = {40: 100.2, 56: 97.0, 60: 98.0, 70: 99.9, 100: 100.1}  # faster at 56 and 60 only
    gain, noise = cut_gain(52, 64, cut, ref)
    assert math.isclose(gain, (math.log(0.97) + math.log(0.98)) / 2) and math.isclose(noise, math.log(1.002))
    assert gain < -noise
    assert cut_gain(64, 52, cut, ref) == (gain, noise)  # either cut the lower one
    same = cut_gain(64, 64, cut, ref)
    assert same[0] == 0.0 and math.isclose(same[1], -math.log(0.97))  # no N between: no gain
    spread = {**cut, 40: 104.0}  # the same kernels 4% apart: a 2.5% gain is within it
    gain, noise = cut_gain(52, 64, spread, ref)
    assert not gain < -noise
    for name, top in (("mixtral-8x7b", 64), ("qwen3-30b-a3b", 256)):  # the analytic plans' cuts
        assert gemv_top(make_plan(load_spec(ROOT / "specs" / f"{name}.yaml"))) == top


def test_the_kernel_stamps_find_their_places_and_compile():
    """tests/gpu_trace.py (stamps of %globaltimer and clock64 inside the one-token kernel, run on a
    GPU) marks fixed places of the rendered source: each is still there once, for warp 0's route
    (Qwen3-Next-80B-A3B) and the whole block's (Qwen3-30B-A3B), and the marked source compiles
    without spills. A place the templates lose is named."""
    sys.path.insert(0, str(ROOT / "tests"))
    from gpu_trace import PLACES, instrument

    for name, block in (("qwen3-next-80b-a3b", False), ("qwen3-30b-a3b", True)):
        spec = load_spec(ROOT / "specs" / f"{name}.yaml")
        plan = make_plan(spec)
        single = plan.kernel(plan.buckets[0].launches[-1].kernel)
        assert ("_br_" in single.name) == block
        src = render_all(spec, plan)[CUDA_FILE]
        marked = instrument(src)
        # marks 0-14 and 20-24 (two places hold two: 4 and 5, 6 and 7), and the macro's definition
        assert src.count("MOE_MARK(") == 0 and marked.count("MOE_MARK(") == 20 + 1 and len(PLACES) == 18
        compiled = compile_parts(marked, plan.arch, plan.parts, display="marked.cu", use_cache=False)
        assert compiled.resources[single.name].spill_stores == 0
    with pytest.raises(ValueError, match="route_one|places like"):
        instrument(src.replace("    off -= cnt;\n", ""))
