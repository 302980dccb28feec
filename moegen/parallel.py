"""Expert parallelism: summing the ranks' partial outputs with an existing collective library.

A layer built from a spec with `parallel: {ep_size, ep_rank}` holds its rank's experts (a
contiguous share; the first E % ep_size ranks hold one more), routes every token in full, and
writes the output of its own experts; rank 0 adds the shared expert and the identity experts.
The partial outputs are summed by an all-reduce on the layer's stream, which CUDA graphs capture.
moegen has no NCCL dependency of its own: the caller passes the communicator it already has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def torch_allreduce(group: Any = None) -> Any:
    """An all-reduce through torch.distributed (NCCL) for Layer.set_allreduce."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")

    def allreduce(out: Any, stream: int) -> None:
        t = out if isinstance(out, torch.Tensor) else torch.from_dlpack(out)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            dist.all_reduce(t, group=group)

    allreduce.ranks = dist.get_world_size(group)  # checked against the spec by Layer.set_allreduce
    return allreduce


def rank_weights(weights: Mapping[str, Any], plan: Any) -> dict[str, Any]:
    """The share of a whole layer's weights (Hugging Face names, stacked experts) that the rank of
    `plan` loads: its experts' slices, the router, and the shared expert on rank 0 only."""
    lo, n = plan.expert_offset, plan.local_experts
    first = lo == 0
    return {k: (v[lo:lo + n] if k.startswith("experts.") else v) for k, v in weights.items()
            if first or not k.startswith("shared_expert")}
