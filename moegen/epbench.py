"""`moegen bench --ep-size N`: an expert-parallel layer on N GPUs of this machine, one process per
GPU (NCCL through torch.distributed).

The ranks are fresh interpreters started as `python -m moegen.epbench <entry> <args.json> <rank>`
(the way torchrun starts them), not forked or spawned from the caller: a rank imports only this
package, whatever the caller's process holds (a test runner's capture, a CUDA context), and a rank
that fails or hangs is named with its exit code and the end of its log.

Each rank builds its share of the spec's experts (parallel.ep_size = N, ep_rank = its index),
loads random weights of the spec's formats, and times, in CUDA-graph replays: its layer without
the all-reduce (the rank's time), the all-reduce of an output alone, and the whole expert-parallel
layer (kernels then the all-reduce on the same stream). The table gives, per N, the slowest and
fastest rank, the all-reduce, and the whole layer.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from .build import render_all, write_dir
from .plan import make_plan
from .spec import load_spec, parse_spec

REPLAYS = 20


def _median_us(graph: Any, torch: Any) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def _captured(fn: Any, torch: Any) -> Any:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _init_rank(rank: int, world: int, port: int) -> None:
    """This process's GPU and its NCCL process group (torch.distributed), on localhost."""
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)


def _rank(rank: int, world: int, body: dict, tokens: list[int], port: int, root: str) -> None:
    import torch
    import torch.distributed as dist
    from cuda.core import Device

    from .bench import _random_ids, _random_weights
    from .parallel import torch_allreduce
    from .runtime import load

    _init_rank(rank, world, port)
    spec = parse_spec({**body, "parallel": {"ep_size": world, "ep_rank": rank}}, check_generated=False)
    plan = make_plan(spec)
    gen = Path(tempfile.mkdtemp()) / spec.name
    write_dir(gen, render_all(spec, plan))
    layer = load(gen, _random_weights(plan, np.random.default_rng(rank)), device=Device(rank))
    allreduce = torch_allreduce()
    results = {}
    for n in tokens:
        torch.manual_seed(n)  # the same tokens on every rank
        x = torch.randn(n, plan.hidden, device="cuda", dtype=torch.bfloat16)
        tids = _random_ids(spec, n, np.random.default_rng(n))  # hash-routed: the same ids on every rank
        out = torch.empty_like(x)
        def call(x: Any = x, out: Any = out, tids: Any = tids) -> None:
            layer(x, out=out, stream=torch.cuda.current_stream(), token_ids=tids)

        layer.set_allreduce(None)
        alone = _median_us(_captured(call, torch), torch)
        reduce = _median_us(_captured(lambda out=out: dist.all_reduce(out), torch), torch)
        layer.set_allreduce(allreduce)
        whole = _median_us(_captured(call, torch), torch)
        results[str(n)] = (alone, reduce, whole)
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_ep_bench(spec_path: str, world: int, tokens: list[int] | None = None, json_path: str | None = None,
                 port: int = 29537) -> int:
    import torch

    from .cli import BenchError

    spec = load_spec(spec_path, check_generated=False)
    if spec.parallel.ep_size != 1:
        raise BenchError(f"{spec_path}: parallel.ep_size={spec.parallel.ep_size}: give the single-GPU spec; "
                         "--ep-size splits its experts")
    have = torch.cuda.device_count()
    if not 2 <= world <= have:
        raise BenchError(f"--ep-size {world}: this machine has {have} GPU(s); one process per GPU needs 2 to {have}")
    make_plan(parse_spec({**spec.model_dump(mode="json"), "parallel": {"ep_size": world, "ep_rank": 0}},
                         check_generated=False))  # a clear error here for an impossible split
    body = yaml.safe_load(Path(spec_path).read_text())
    tokens = tokens or [1, 64]
    with tempfile.TemporaryDirectory() as root:
        launch_ranks("bench", {"body": body, "tokens": tokens, "port": port}, world, root)
        res = {(r, int(n)): v for r in range(world)
               for n, v in json.loads((Path(root) / f"rank{r}.json").read_text()).items()}
    rows = []
    for n in tokens:
        per = [res[(r, n)] for r in range(world)]
        rows.append({"tokens": n, "rank_us": [p[0] for p in per], "allreduce_us": max(p[1] for p in per),
                     "layer_us": max(p[2] for p in per)})
    out = {"spec": spec.name, "gpu": torch.cuda.get_device_name(0), "ep_size": world,
           "date": date.today().isoformat(), "rows": rows}
    print(f"{spec.name} on {world} x {out['gpu']}, {out['date']}: expert parallel, one process per GPU")
    print(f"{'N':>5} {'rank min':>9} {'rank max':>9} {'all-reduce':>11} {'layer':>9}  (us, CUDA-graph replays)")
    for row in rows:
        print(f"{row['tokens']:>5} {min(row['rank_us']):>9.1f} {max(row['rank_us']):>9.1f} "
              f"{row['allreduce_us']:>11.1f} {row['layer_us']:>9.1f}")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _check_rank(rank: int, world: int, body: dict, counts: list[int], root: str, port: int, watchdog: float) -> None:
    """One rank of run_ep_check: its share of the experts with an NCCL all-reduce on a created
    stream, eager and in a CUDA graph; rank 0 also runs the whole layer on its GPU. A rank still
    running after `watchdog` seconds prints its stack and exits (a failure, not a hang)."""
    import faulthandler

    faulthandler.dump_traceback_later(watchdog, exit=True)
    import torch
    import torch.distributed as dist
    from cuda.core import Device

    from .bench import _random_ids, _random_weights
    from .parallel import rank_weights, torch_allreduce
    from .runtime import load

    _init_rank(rank, world, port)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    torch.manual_seed(0)  # the same weights and inputs on every rank
    full_plan = make_plan(parse_spec(body, check_generated=False))
    weights = _random_weights(full_plan, np.random.default_rng(0))
    spec = parse_spec({**body, "parallel": {"ep_size": world, "ep_rank": rank}}, check_generated=False)
    plan = make_plan(spec)
    mine = rank_weights(weights, plan)
    write_dir(Path(root) / f"r{rank}", render_all(spec, plan))
    layer = load(Path(root) / f"r{rank}", mine, device=Device(rank))
    layer.set_allreduce(torch_allreduce())
    full = None
    if rank == 0:
        write_dir(Path(root) / "full", render_all(parse_spec(body, check_generated=False), full_plan))
        full = load(Path(root) / "full", weights, device=Device(0))
    for n in counts:
        x = torch.randn(n, full_plan.hidden, device="cuda", dtype=torch.bfloat16)
        tids = _random_ids(spec, n, np.random.default_rng(n))  # hash-routed: the same ids on every rank
        out = torch.empty_like(x)
        layer(x, out=out, stream=torch.cuda.current_stream(), token_ids=tids)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer(x, out=out, stream=torch.cuda.current_stream(), token_ids=tids)
        eager = out.clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if rank == 0:
            want = torch.empty_like(x)
            full(x, out=want, stream=torch.cuda.current_stream(), token_ids=tids)
            torch.cuda.synchronize()
            for kind, t in (("eager", eager), ("graph", out), ("want", want)):  # for the caller, as files
                np.save(Path(root) / f"{kind}{n}.npy", t.float().cpu().numpy().astype(np.float64))
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def run_ep_check(body: dict, world: int, counts: list[int], root: str, port: int = 29547,
                 watchdog: float = 240.0) -> None:
    """Runs the layer of `body` (a spec mapping with parallel.ep_size 1) over `world` GPUs, one
    process per GPU, and leaves in `root`, per token count n, the expert-parallel output eager and
    replayed from a CUDA graph (eager<n>.npy, graph<n>.npy) and the single-GPU layer's (want<n>.npy)."""
    launch_ranks("check", {"body": body, "counts": counts, "port": port, "watchdog": watchdog}, world, root,
                 timeout=watchdog + 60.0)


class RankError(RuntimeError):
    """A rank of an expert-parallel run failed, or did not finish in time."""


# what a rank runs: (rank, world, its arguments as run_ep_* wrote them, the run's directory)
_ENTRIES = {
    "bench": lambda rank, world, a, root: _rank(rank, world, a["body"], a["tokens"], a["port"], root),
    "check": lambda rank, world, a, root: _check_rank(rank, world, a["body"], a["counts"], root, a["port"],
                                                      a["watchdog"]),
}


def launch(commands: list[list[str]], logs: list[Path], timeout: float | None = None,
           env: dict[str, str] | None = None) -> None:
    """Runs the commands at once, each with its own log (stdout and stderr), and waits for all.
    The first to fail, or every one still running after `timeout` seconds, stops the rest and
    raises RankError naming the rank, its exit status and its log's last lines."""
    procs = []
    try:
        for cmd, log in zip(commands, logs):
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env={**os.environ, **(env or {})}))
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            bad = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if bad is not None:
                raise RankError(f"rank {bad} of {len(procs)} exited with status {codes[bad]}:\n{_tail(logs[bad])}")
            if all(c == 0 for c in codes):
                return
            if end is not None and time.monotonic() > end:
                late = [r for r, c in enumerate(codes) if c is None]
                raise RankError(f"ranks {late} of {len(procs)} still running after {timeout:.0f} s; rank {late[0]}'s "
                                f"log:\n{_tail(logs[late[0]])}")
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _tail(log: Path, lines: int = 20) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(text[-lines:]) or "(nothing written)"


def launch_ranks(entry: str, args: dict, world: int, root: str, timeout: float | None = None) -> None:
    """`world` ranks of `entry` (_ENTRIES), each `python -m moegen.epbench entry args.json rank world
    root` with its log in root/rank<r>.log."""
    path = Path(root) / f"{entry}_args.json"
    path.write_text(json.dumps(args))
    commands = [[sys.executable, "-m", "moegen.epbench", entry, str(path), str(r), str(world), root]
                for r in range(world)]
    launch(commands, [Path(root) / f"rank{r}.log" for r in range(world)], timeout, env={"PYTHONUNBUFFERED": "1"})


if __name__ == "__main__":  # one rank (launch_ranks)
    _entry, _args, _r, _world, _root = sys.argv[1:6]
    _ENTRIES[_entry](int(_r), int(_world), json.loads(Path(_args).read_text()), _root)
