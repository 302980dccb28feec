"""Expert parallelism: summing the ranks' partial outputs with an existing collective library.

A layer built from a spec with `parallel: {ep_size, ep_rank}` holds its rank's experts (a
contiguous share; the first E % ep_size ranks hold one more), routes every token in full, and
writes the output of its own experts; rank 0 adds the shared expert and the identity experts.
The partial outputs are summed by an all-reduce on the layer's stream, which CUDA graphs capture.
moegen has no NCCL dependency of its own: the caller passes the communicator it already has.
"""

from __future__ import annotations

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
