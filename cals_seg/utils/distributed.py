"""Small torch.distributed helpers shared by the criterion, the meters and the engine.

Every statistic in this package is a sum, so synchronising a state across ranks is one
``all_reduce(SUM)`` per tensor. These helpers are no-ops when ``torch.distributed`` is not
initialised, so library code can call them unconditionally.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


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


def gather_lists(values: list) -> list:
    """The concatenation, in rank order, of every rank's ``values`` (picklable items); the list
    itself when not distributed. A collective call: every rank must make it."""
    if not is_distributed():
        return list(values)
    parts: list[list] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, list(values))
    return [v for part in parts for v in part]


def init_from_env() -> torch.device:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1 in the
    environment) and return this process' device.

    NCCL on CUDA (one GPU per process, ``cuda:LOCAL_RANK``), gloo on CPU. A plain
    ``python tools/...`` launch returns ``cuda`` (or ``cpu``) and starts nothing.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world <= 1:
        return torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device(f"cuda:{local_rank}" if cuda else "cpu")


def cleanup() -> None:
    """Leave the process group (if any)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op when not distributed)."""
    if is_distributed():
        dist.barrier()


def check_identical(tensor: torch.Tensor, what: str) -> None:
    """Raise if ``tensor`` differs between ranks (e.g. the CALS multipliers after an update)."""
    if not is_distributed():
        return
    reference = tensor.detach().clone()
    dist.broadcast(reference, src=0)
    if not torch.equal(reference, tensor.detach()):
        raise RuntimeError(f"{what} differs between rank 0 and rank {get_rank()}.")


class ShardedBatchSampler(Sampler[list[int]]):
    """Evaluation batches of a sequential pass, dealt round-robin to the ranks.

    Rank ``r`` of ``W`` gets batches ``r, r + W, ...`` of ``[0, B), [B, 2B), ...``: every sample is
    seen exactly once (no padding duplicates as with ``DistributedSampler``), and each batch has
    the same composition as in a single-process run, so logits and therefore every metric are
    the same as one process up to the order of the float64 sums.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank = get_rank() if rank is None else rank
        self.world_size = get_world_size() if world_size is None else world_size

    def _batches(self) -> range:
        num_batches = (self.num_samples + self.batch_size - 1) // self.batch_size
        return range(self.rank, num_batches, self.world_size)

    def __iter__(self) -> Iterator[list[int]]:
        for b in self._batches():
            start = b * self.batch_size
            yield list(range(start, min(start + self.batch_size, self.num_samples)))

    def __len__(self) -> int:
        return len(self._batches())


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank, so evaluation and
    checkpoints use one set of statistics. No-op when not distributed."""
    if not is_distributed():
        return
    for buf in module.buffers():
        dist.broadcast(buf, src=0)
