"""Stamps inside the one-token kernel (down by columns): where a layer's microseconds go (not collected by pytest).

    python3 tests/gpu_trace.py qwen3-next-80b-a3b [N] [tuning=value ...]

Renders the spec's layer, inserts MOE_MARK(i, thread) at fixed places of the rendered source (each
mark has that thread of every block store %globaltimer and clock64 into a __device__ array),
times the marked layer against the unmarked one (4 layers a CUDA graph replay, as `moegen bench`),
and prints, per mark, when the blocks passed it: microseconds from the first block's entry
(min / median / max over the blocks, the last layer of the last replay) and from each block's own
entry by its clock. The marks cost 0.1-2 us a layer (more marks, more cost). N is 1 or 2 (the
two-token kernel); a tuning such as single_block_route=1 picks a variant (integer values).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

MARKS = 32  # marks a block; each stores two 64-bit words
LABELS = {0: "entry", 1: "after the dependency wait", 2: "router products written", 3: "logits staged",
          4: "route done (thread 0)", 5: "stream starts (thread 32)", 6: "stream done (thread 0)",
          7: "stream done (thread 32)", 8: "first round of the partials' poll", 9: "end",
          10: "route_one: logits added", 11: "route_one: bound", 12: "route_one: scan",
          13: "route_one: ranked", 14: "route_one: choices published", 20: "route_block: keys",
          21: "route_block: at its first barrier", 22: "route_block: bound", 23: "route_block: candidates",
          24: "route_block: ranked"}
HEADER = f"""
__device__ unsigned long long moe_trace[1024][{2 * MARKS}];
#define MOE_MARK(i, tid) do {{ if (threadIdx.x == (tid)) {{ unsigned long long t_; \\
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_) :: "memory"); \\
  moe_trace[blockIdx.x][2 * (i)] = t_; moe_trace[blockIdx.x][2 * (i) + 1] = clock64(); }} }} while (0)
"""
# (text of the rendered source, mark inserted, before it): each must occur exactly once
PLACES = (
    ("  if ((int)blockIdx.x < RTILES * KSPLIT) router_weights(blockIdx.x);\n", "  MOE_MARK(0, 0);\n", True),
    ("  grid_dep_wait();  // x (and the last call's readers of this workspace) are done\n", "  MOE_MARK(1, 0);\n", False),
    ("  if constexpr (!OVERLAP) shared_to_l2();\n", "  MOE_MARK(2, 0);\n", True),
    ("  if constexpr (OVERLAP && !COLS) shared_to_l2();  // (warp 0 routes meanwhile)\n", "  MOE_MARK(3, 0);\n", True),
    ("  grid_dep_launch();  // every block is resident: the next kernel may be scheduled\n",
     "  MOE_MARK(4, 0); MOE_MARK(5, 32);\n", True),
    ("    // 4. (COLS) block b's output rows 16 rb", "    MOE_MARK(6, 0); MOE_MARK(7, 32);\n", True),
    ("  } else {\n\n  // 4. down + the weighted sum", "    MOE_MARK(9, 0);\n", True),
    (("        if (!__syncthreads_or(stale)) break;\n        __nanosleep(64);\n      }\n#pragma unroll\n"
      "      for (int n = 0; n < NTOK; ++n) {\n        float y = 0.0f;"), None, False),
    (("#pragma unroll\n  for (int i = 0; i < EPL; ++i) {\n    const int e = expert(i);\n"
      "    v[i] = e < E ? route_logit<R>(v[i], router_bias, e) : MOE_NEG_INF;"), "  MOE_MARK(10, 0);\n", True),
    (("    const u32 bound = __reduce_min_sync(0xffffffffu, above[0] + above[1] + above[2] + above[3] < K ? head "
      ": 0xffffffffu);\n"), "    MOE_MARK(11, 0);\n", False),
    ("    off -= cnt;\n", "    MOE_MARK(12, 0);\n", False),
    ("  __syncwarp();\n  if constexpr (OVERLAP) {  // every choice written", "  MOE_MARK(13, 0);\n", True),
    ("    mbar_arrive(chosen);\n  }\n", "  MOE_MARK(14, 0);\n", False),
    ("  if (SHARED_GATE && tid == 0) {\n    float s = 0.0f;", "  MOE_MARK(20, 0);\n", True),
    ("    __syncthreads();\n    // every warp holding experts: T", "    MOE_MARK(21, 0);\n", True),
    ("    if (tid < E && key >= thr) {", "    MOE_MARK(22, 0);\n", True),
    ("    const int C = s_cnt;\n", "    MOE_MARK(23, 0);\n", False),
    ("      }\n    }\n  }\n}\n\n// route_block's weights", "    MOE_MARK(24, 0);\n", True),
)


def instrument(src: str) -> str:
    """The rendered layer source with the marks and their array; ValueError names a place the
    templates no longer have (update PLACES with them)."""
    for text, mark, before in PLACES:
        if src.count(text) != 1:
            raise ValueError(f"gpu_trace: {src.count(text)} places like {text.strip()[:70]!r} (one expected)")
        if mark is None:  # mark 8: after the first round of the final reduction's poll
            new = text.replace("      }\n#pragma unroll\n", "      }\n      MOE_MARK(8, 0);\n#pragma unroll\n", 1)
        else:
            new = mark + text if before else text + mark
        src = src.replace(text, new)
    i = src.rfind("\ntemplate", 0, src.index("MOE_DEVICE void route_one"))
    return src[:i] + "\n" + HEADER + src[i:]


def main(argv: list[str]) -> None:
    from cuda.core import Device

    from moegen.bench import _random_weights, _random_x, _Timer, time_stack
    from moegen.build import render_all, write_dir
    from moegen.families import Tuning
    from moegen.plan import make_plan
    from moegen.runtime import _driver, _ok, load
    from moegen.spec import load_spec

    name, n = argv[0], int(argv[1]) if len(argv) > 1 else 1
    tuning = Tuning(**{k: int(v) for k, v in (a.split("=") for a in argv[2:])})
    spec = load_spec(Path(__file__).resolve().parent.parent / "specs" / f"{name}.yaml")
    plan = make_plan(spec, tuning=tuning)
    files = render_all(spec, plan)
    plain, marked = Path(tempfile.mkdtemp()) / spec.name, Path(tempfile.mkdtemp()) / spec.name
    write_dir(plain, files)
    write_dir(marked, {**files, "layer.cu": instrument(files["layer.cu"])})
    dev = Device()
    dev.set_current()
    stack = [load(marked, _random_weights(plan, np.random.default_rng()), device=dev)]
    stack += [load(marked, device=dev) for _ in range(3)]
    ref = [load(plain, device=dev) for _ in range(4)]
    for layer in stack[1:] + ref:
        layer.load_weights_from(stack[0])
    timer = _Timer(dev)
    xs = [_random_x(plan, n, np.random.default_rng()) for _ in stack]
    for _ in range(3):
        print(f"{name} N={n}: {time_stack(timer, ref, xs):.2f} us a layer unmarked, "
              f"{time_stack(timer, stack, xs):.2f} marked")
    bucket = next(b for b in plan.buckets if b.max_tokens >= n)
    kernel = plan.kernel(bucket.launches[-1].kernel)
    if kernel.family != "single":
        raise SystemExit(f"{name} N={n} runs {kernel.name}, not the one-launch kernel the marks are in")
    code = stack[0]._code
    drv = _driver()
    handle = code.modules[kernel.part if len(code.modules) > 1 else 0].handle
    try:  # (cuda.core loads a cubin as a library; an older one as a module)
        found = drv.cuLibraryGetGlobal(handle, b"moe_trace")
    except Exception:  # noqa: BLE001 - any failure of the library call: the module form
        found = drv.cuModuleGetGlobal(handle, b"moe_trace")
    if found[0] != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"finding the marks: {found[0]}")
    words = np.zeros((1024, 2 * MARKS), np.uint64)
    _ok(drv.cuMemcpyDtoH(words.ctypes.data, found[1], found[2]), "reading the marks")
    words = words[words[:, 0] > 0].astype(np.int64)  # the blocks that ran
    gt, ck = words[:, 0::2], words[:, 1::2]
    rate = np.median((ck[:, 9] - ck[:, 0]) / np.maximum(gt[:, 9] - gt[:, 0], 1))  # clocks a nanosecond
    print(f"{kernel.name}: {len(words)} blocks, {rate:.3f} clocks a ns. us from the first entry (min / median / "
          "max) | from the block's entry by its clock (median / max)")
    for i, label in LABELS.items():
        ok = gt[:, i] > 0
        if ok.any():
            g, c = (gt[ok, i] - gt[:, 0].min()) / 1e3, (ck[ok, i] - ck[ok, 0]) / rate / 1e3
            print(f"  {i:2d} {label:36s} {g.min():7.2f} {np.median(g):7.2f} {g.max():7.2f} | "
                  f"{np.median(c):7.2f} {c.max():7.2f}")
    for layer in stack + ref:
        layer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
