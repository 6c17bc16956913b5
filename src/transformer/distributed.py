"""Data-parallel training across processes launched by `torchrun` (one node or many).

Each rank takes its own shard of the batches (`TokenBatchSampler(rank=, world_size=)`), runs
forward and backward on its model replica, and sums its gradients into fp32 master gradients
(optim.MixedPrecisionAdam). Once per optimizer step the ranks all-reduce those fp32 gradients
and their token counts in a few flat buckets, so every replica takes the identical step.

This is what DistributedDataParallel computes (a gradient all-reduce after backward), written out
because the reduction must happen after gradient accumulation, on the fp32 masters: DDP reduces
inside backward, in the parameters' dtype (bf16), and `no_sync` would leave the accumulation in
bf16. One reduction per step also means accumulation costs no extra communication.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BUCKET_NUMEL = 32 * 1024 * 1024  # fp32 elements per all-reduce call (128 MB)


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_from_env(device: torch.device) -> DistInfo:
    """Join the process group that `torchrun` describes (RANK, WORLD_SIZE, LOCAL_RANK, ...).

    Without those variables (a plain `transformer train`) this is a single-process job.
    Backend: nccl on CUDA, gloo on CPU.
    """
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return DistInfo()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    info = DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    logger.info("rank %d of %d (%s)", info.rank, info.world_size, backend)
    return info


def all_reduce_sum(tensors: list[torch.Tensor], info: DistInfo) -> None:
    """Sum tensors across ranks in place, in flat buckets of up to BUCKET_NUMEL elements."""
    if info.world_size == 1:
        return
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        if buckets[-1] and size + t.numel() > BUCKET_NUMEL:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.numel()
    for bucket in buckets:
        if not bucket:
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket])  # (sum of numel,)
        dist.all_reduce(flat)
        parts = flat.split([t.numel() for t in bucket])
        torch._foreach_copy_(bucket, [p.view_as(t) for p, t in zip(parts, bucket, strict=True)])


def broadcast_parameters(tensors: list[torch.Tensor], info: DistInfo) -> None:
    """Give every rank rank 0's values (initial weights), as DDP does at construction."""
    if info.world_size == 1:
        return
    for t in tensors:
        dist.broadcast(t, src=0)


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
