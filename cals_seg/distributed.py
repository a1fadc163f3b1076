"""Small torch.distributed helpers shared by the criterion, the meters and the engine.

Every statistic in this package is a sum, so synchronising a state across ranks is one
``all_reduce(SUM)`` per tensor. These helpers are no-ops when ``torch.distributed`` is not
initialised, so library code can call them unconditionally.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a default process group exists and has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """Rank of this process (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of processes in the default group (1 when not distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0: the only rank that writes files and shows progress bars."""
    return get_rank() == 0


def all_reduce_sum_(tensors: Iterable[torch.Tensor]) -> None:
    """Sum each tensor over all ranks, in place. No-op when not distributed.

    Integer and float64 tensors are reduced exactly as they are (gloo and NCCL both support
    int64 and float64), so counts stay exact past 2^24.
    """
    if not is_distributed():
        return
    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
