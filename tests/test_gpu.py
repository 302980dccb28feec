"""GPU tier: every catalog spec's generated layer against the float64 reference, on the device.

Fresh random inputs for every check, outputs poisoned with NaN before each launch, per-row
relative error against moegen.reference (fed the same bf16 inputs and weights), chosen experts
equal to the reference's away from near-ties, CUDA-graph replay, bitwise determinism and batch
invariance, and launch-time errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import SPECS
from rowcheck import ROW_TOL, ROW_TOL_FP8_ACT, _check_rows, check_rows_fp8_act, row_tol  # noqa: F401

from moegen import reference
from moegen.arrays import ArrayError
from moegen.build import render_all, tuned_plan, write_dir
from moegen.plan import Plan
from moegen.runtime import Layer, load
from moegen.samples import host_bf16 as _host
from moegen.samples import random_weights
from moegen.spec import Spec, load_spec

pytestmark = pytest.mark.gpu

TIE_TOL = 1e-4  # selection values closer than this are a near-tie for fp32 routing


@dataclass
class Case:
    spec: Spec
    plan: Plan
    layer: Layer
    host: dict[str, np.ndarray]  # bf16 weights as the reference reads them


@pytest.fixture(scope="module", params=SPECS, ids=lambda p: p.stem)
def case(request, tmp_path_factory) -> Iterator[Case]:
    import torch

    spec = load_spec(request.param)
    plan = tuned_plan(spec, request.param.parent.parent / "generated")  # the plan generated/ holds (its tuning)
    out = tmp_path_factory.mktemp("gen") / spec.name
    write_dir(out, render_all(spec, plan))
    dev_w, host = random_weights(plan)
    layer = load(out, dev_w)
    del dev_w
    torch.cuda.empty_cache()
    yield Case(spec, plan, layer, host)
    layer.close()  # the largest specs' weights fill a good part of the device: free before the next
    torch.cuda.empty_cache()


def _tids(case: Case, x: Any) -> Any:
    """Hash-routed layers: each token's id, a function of its row (so a token keeps its id in
    any batch), spread over [-vocab/8, vocab*9/8): the ids outside [0, vocab) check the
    documented clamp on the device. None for the other layers."""
    import torch

    vocab = case.spec.routing.hash_vocab_size
    if vocab is None:
        return None
    bits = x[:, :2].contiguous().view(torch.int32)[:, 0].to(torch.int64) & 0x7FFFFFFF
    return (bits % (vocab + vocab // 4) - vocab // 8).to(torch.int32)


def _host_tids(case: Case, x: Any) -> np.ndarray | None:
    t = _tids(case, x)
    return None if t is None else t.cpu().numpy()


def _run(case: Case, x: Any, torch: Any) -> Any:
    out = torch.full(x.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    case.layer(x, out=out, stream=torch.cuda.current_stream(), token_ids=_tids(case, x))
    return out


def kernel_activations(layer: Layer, spec: Spec, n: int, torch: Any) -> tuple[np.ndarray, np.ndarray | None] | None:
    """With FP8 activations, the activations the layer's last call (n tokens) handed its down
    projections, from its workspace: [n, k, I] per (token, choice) (row pair_pos[t, j] of act) and
    the shared expert's [n, I_shared] (act_s), as float64; None for other layers."""
    if not spec.experts.fp8_activations:
        return None
    from moegen.runtime import _driver, _ok

    torch.cuda.synchronize()

    def fetch(name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        a = np.zeros(shape, dtype)
        _ok(_driver().cuMemcpyDtoH(a.ctypes.data, layer.workspace.ptr(name), a.nbytes), f"reading {name}")
        return a

    def bf16(a: np.ndarray) -> np.ndarray:
        return a.view(ml_dtypes.bfloat16).astype(np.float64)

    k, i = spec.experts.top_k, spec.experts.intermediate_size
    pos = fetch("pair_pos", (n, k), np.int32)
    h = bf16(fetch("act", (int(pos.max()) + 1, i), np.uint16))[pos]
    si = spec.shared_expert.intermediate_size if spec.shared_expert else 0
    return h, (bf16(fetch("act_s", (n, si), np.uint16)) if si else None)


def _prefill_ends(plan: Any) -> tuple[int, ...]:
    """The smallest and largest N of the first prefill bucket (none without prefill buckets)."""
    if not plan.prefill_from:
        return ()
    below = [b.max_tokens for b in plan.buckets if b.max_tokens < plan.prefill_from]
    return (max(below, default=0) + 1, plan.prefill_from)


def test_matches_reference(case: Case):
    """All token counts of the GPU tier, one reference pass over all of them."""
    import torch

    ends = _prefill_ends(case.plan)  # the first prefill bucket's ends, and the N just below (a GEMV bucket's top)
    counts = sorted({1, 2, 3, 7, 16, 64, min(129, case.plan.max_tokens), *ends, *(ends[:1] and [ends[0] - 1])} - {0}
                    | ({case.plan.max_tokens} if case.plan.max_tokens <= 1024 else set()))
    xs, outs, ids, ws, tids, acts = [], [], [], [], [], []
    for n in counts:
        x = torch.randn(n, case.plan.hidden, device="cuda", dtype=torch.bfloat16)
        outs.append(_host(_run(case, x, torch)).astype(np.float64))
        acts.append(kernel_activations(case.layer, case.spec, n, torch))
        i, w = case.layer.routing(n, stream=torch.cuda.current_stream())
        xs.append(_host(x))
        ids.append(i)
        ws.append(w)
        tids.append(_host_tids(case, x))
    x_all = np.concatenate(xs)
    ids_all = np.concatenate(ids).astype(np.int64)
    t_all = None if tids[0] is None else np.concatenate(tids)
    r = reference.route(case.spec, x_all, case.host, token_ids=t_all)
    tie = r.margin < TIE_TOL
    same = np.sort(r.ids, axis=1) == np.sort(ids_all, axis=1)
    bad = np.nonzero(~same.all(axis=1) & ~tie)[0]
    assert bad.size == 0, f"token {bad[0]}: experts {sorted(ids_all[bad[0]])}, reference {sorted(r.ids[bad[0]])}"
    # routing weights for the kernel's choice (equal to the reference's choice away from ties)
    rw = reference.routing_weights_for(case.spec, x_all, case.host, ids_all, token_ids=t_all)
    w_all = np.concatenate(ws)
    assert np.allclose(w_all, rw, rtol=1e-4, atol=1e-5), f"routing weights differ by {np.abs(w_all - rw).max():.2e}"
    ref = reference.moe_forward(case.spec, x_all, case.host, ids=ids_all, token_ids=t_all)
    start = 0
    for n, got, a in zip(counts, outs, acts):
        check_rows_fp8_act(got, ref[start:start + n], f"{case.spec.name} N={n}", row_tol(case.spec), case.spec,
                           case.host, x_all[start:start + n], ids_all[start:start + n], a)
        start += n


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_graph_replay_and_determinism(case: Case, path: str):
    import torch

    if path == "prefill" and not case.plan.prefill_from:
        pytest.skip(f"{case.spec.name} has no prefill buckets")
    n = min(7, case.plan.max_tokens) if path == "decode" else _prefill_ends(case.plan)[0]
    x = torch.randn(n, case.plan.hidden, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        case.layer(x, out=out, stream=stream, token_ids=_tids(case, x))  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.layer(x, out=out, stream=torch.cuda.current_stream(), token_ids=_tids(case, x))
    for _ in range(2):  # replay on fresh inputs: same bits as an eager call
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        eager = _run(case, x.clone(), torch)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16)), "graph replay differs from eager"
    a, b = _run(case, x, torch), _run(case, x, torch)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "two runs on the same input differ"


def test_batch_invariance(case: Case):
    """A token's output is the same bits whatever the other tokens of its bucket and its position."""
    import torch

    nmax = case.plan.max_tokens
    big = min(64, nmax)
    x = torch.randn(big, case.plan.hidden, device="cuda", dtype=torch.bfloat16)
    full = _run(case, x, torch)
    # same bucket, other companions and positions: the first half reversed (or, where a tuned cut
    # puts a bucket edge above half of N = 64, the bucket's smallest N)
    edge = max((b.max_tokens for b in case.plan.buckets if b.max_tokens < big), default=0)
    m = max(big // 2 + 1, edge + 1)
    half = x[:m].flip(0).contiguous()
    part = _run(case, half, torch)
    assert torch.equal(part.flip(0).view(torch.int16), full[:m].view(torch.int16)), f"bucket of N = {m} .. {big}"
    # small bucket: 5 tokens alone vs the same 5 among 3 others at other positions (bucket 8)
    five = x[:5].contiguous()
    mixed = torch.cat([x[40:43], five.flip(0)]).contiguous()
    a, b = _run(case, five, torch), _run(case, mixed, torch)
    assert torch.equal(b[3:].flip(0).view(torch.int16), a.view(torch.int16))
    if big >= 2:  # bucket 2: a token with another, swapped, and with a third (the two-token kernel too)
        pair = x[:2].contiguous()
        a = _run(case, pair, torch)
        b = _run(case, pair.flip(0).contiguous(), torch)
        c = _run(case, torch.cat([x[:1], x[big - 1:big]]).contiguous(), torch)
        assert torch.equal(b.flip(0).view(torch.int16), a.view(torch.int16)), "bucket 2, swapped"
        assert torch.equal(c[:1].view(torch.int16), a[:1].view(torch.int16)), "bucket 2, another companion"
    if big >= 4:  # bucket 4: 3 tokens alone vs the same 3 after another
        three = x[:3].contiguous()
        four = torch.cat([x[big - 1:big], three.flip(0)]).contiguous()
        a, b = _run(case, three, torch), _run(case, four, torch)
        assert torch.equal(b[1:].flip(0).view(torch.int16), a.view(torch.int16)), "bucket 4"
    if case.plan.prefill_from:  # the first prefill bucket: its smallest N among its largest N's tokens
        lo, hi = _prefill_ends(case.plan)
        xp = torch.randn(hi, case.plan.hidden, device="cuda", dtype=torch.bfloat16)
        full_p = _run(case, xp, torch)
        part_p = _run(case, xp[:lo].flip(0).contiguous(), torch)
        assert torch.equal(part_p.flip(0).view(torch.int16), full_p[:lo].view(torch.int16)), "prefill bucket"
    if case.spec.batch_invariant:  # one reduction order for every N: token 3 alone
        alone = _run(case, x[3:4].contiguous(), torch)
        assert torch.equal(alone.view(torch.int16), full[3:4].view(torch.int16))



def _prefill_pair(plan: Any) -> tuple[int, int] | None:
    """Two token counts in different prefill buckets: 1024 (or the first bucket's end) and the
    largest bucket end up to 8192; None with fewer than two prefill buckets."""
    ends = [b.max_tokens for b in plan.buckets if plan.prefill_from and b.max_tokens >= plan.prefill_from]
    ends = [e for e in ends if e <= 8192]
    if len(ends) < 2:
        return None
    small = next((e for e in ends[:-1] if e >= 1024), ends[0])
    return small, ends[-1]


def test_prefill_batch_invariance_across_buckets(case: Case):
    """A token prefilled in a batch of 1024 or of 8192 (different buckets, other tile positions and
    companions, another grid): the same output bits."""
    import torch

    pair = _prefill_pair(case.plan)
    if pair is None:
        pytest.skip(f"{case.spec.name} has fewer than two prefill buckets")
    small, big = pair
    x = torch.randn(big, case.plan.hidden, device="cuda", dtype=torch.bfloat16)
    full = _run(case, x, torch)
    part = _run(case, x[big - small:].flip(0).contiguous(), torch)  # the last tokens, reversed
    assert torch.equal(part.flip(0).view(torch.int16), full[big - small:].view(torch.int16)), (
        f"{case.spec.name}: tokens prefilled among {small} differ from the same tokens among {big}")

def test_launch_errors(case: Case):
    import torch

    h, nmax = case.plan.hidden, case.plan.max_tokens
    good = torch.randn(2, h, device="cuda", dtype=torch.bfloat16)
    bad = {
        "shape": torch.randn(2, h + 32, device="cuda", dtype=torch.bfloat16),
        "too many tokens": torch.randn(nmax + 1, h, device="cuda", dtype=torch.bfloat16),
        "dtype": torch.randn(2, h, device="cuda", dtype=torch.float32),
        "device": torch.randn(2, h, dtype=torch.bfloat16),
        "stride": torch.randn(2, 2 * h, device="cuda", dtype=torch.bfloat16)[:, ::2],
        "rank": torch.randn(2, 1, h, device="cuda", dtype=torch.bfloat16),
    }
    for x in bad.values():
        with pytest.raises(ArrayError, match="x: "):
            case.layer(x, stream=torch.cuda.current_stream())
    with pytest.raises(ArrayError, match="out: "):
        case.layer(good, out=torch.empty(3, h, device="cuda", dtype=torch.bfloat16), token_ids=_tids(case, good))
    # no out: the layer's own buffer
    res = case.layer(good, stream=torch.cuda.current_stream(), token_ids=_tids(case, good))
    got = torch.from_dlpack(res)
    assert got.shape == (2, h) and got.dtype == torch.bfloat16 and not torch.isnan(got).any()
