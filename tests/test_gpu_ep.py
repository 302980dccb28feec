"""GPU: expert parallelism emulated on one GPU (issue: ranks in sequence). The ranks' partial
outputs, summed, equal the single-GPU layer within bf16 tolerance; the shared expert counts once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from test_gpu import _check_rows, _host

from moegen.build import render_all, write_dir
from moegen.parallel import rank_weights
from moegen.plan import make_plan
from moegen.runtime import load
from moegen.samples import random_weights
from moegen.spec import parse_spec

pytestmark = pytest.mark.gpu

LAYER = {"name": "ep", "model": "ep", "hidden_size": 2048,
         "experts": {"count": 60, "top_k": 4, "intermediate_size": 512},
         "shared_expert": {"intermediate_size": 1024, "gate": "sigmoid"},
         "routing": {"score": "sigmoid", "correction_bias": True, "renormalize": True, "routed_scaling_factor": 2.5}}


@pytest.mark.parametrize("ep_size", [2, 3, 8])
def test_ranks_sum_to_the_whole_layer(ep_size, tmp_path):
    import torch

    full_spec = parse_spec(LAYER, check_generated=False)
    full_plan = make_plan(full_spec)
    write_dir(tmp_path / "full", render_all(full_spec, full_plan))
    dev_w, _ = random_weights(full_plan)
    full = load(tmp_path / "full", dev_w)
    x = torch.randn(64, full_plan.hidden, device="cuda", dtype=torch.bfloat16)
    want = torch.empty_like(x)
    full(x, out=want, stream=torch.cuda.current_stream())
    total = torch.zeros(x.shape, device="cuda", dtype=torch.float32)
    for rank in range(ep_size):
        spec = parse_spec({**LAYER, "parallel": {"ep_size": ep_size, "ep_rank": rank}}, check_generated=False)
        plan = make_plan(spec)
        write_dir(tmp_path / f"r{rank}", render_all(spec, plan))
        layer = load(tmp_path / f"r{rank}", rank_weights(dev_w, plan))
        if rank == 0:  # a communicator of the wrong size is refused, naming both sizes

            def wrong(out: object, stream: int) -> None: ...

            wrong.ranks = ep_size + 1
            with pytest.raises(ValueError, match=f"has {ep_size + 1} ranks.*ep_size is {ep_size}"):
                layer.set_allreduce(wrong)
        part = torch.full_like(x, float("nan"))
        layer(x, out=part, stream=torch.cuda.current_stream())
        total += part.float()
    _check_rows(total.double().cpu().numpy(), _host(want).astype(np.float64), f"ep_size={ep_size}")


# DeepSeek-V3 as released (FP8 block experts), up to 1024 tokens a call
DSV3_FP8 = {**yaml.safe_load((Path(__file__).resolve().parent.parent / "specs" / "deepseek-v3-fp8.yaml").read_text()),
            "max_tokens": 1024}


@pytest.mark.parametrize("layer_spec, counts, port, watchdog",
                         [(None, (64,), 29517, 90.0), (DSV3_FP8, (1, 64, 1024), 29527, 300.0)],
                         ids=["small", "deepseek-v3-fp8"])
def test_ranks_on_several_gpus(layer_spec, counts, port, watchdog, tmp_path):
    import torch

    from moegen.epbench import run_ep_check

    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("one process per GPU needs at least 2 GPUs")
    # the ranks run as fresh interpreters (python -m moegen.epbench) and return files
    run_ep_check(layer_spec or LAYER, world, list(counts), str(tmp_path), port=port, watchdog=watchdog)
    for n in counts:
        want = np.load(tmp_path / f"want{n}.npy")
        for kind in ("eager", "graph"):
            _check_rows(np.load(tmp_path / f"{kind}{n}.npy"), want, f"{world} GPUs, N={n}, {kind}")
