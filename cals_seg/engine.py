"""Task-agnostic training step, data loaders and seeding (evaluation: :mod:`cals_seg.evaluation`;
checkpoints and run files: :mod:`cals_seg.rundir`).

One loop serves every task: a batch is ``(inputs, target)`` (or a dict with ``image``/``mask``
or ``input``/``target``), the model maps inputs to logits ``(N, K, *S)`` and the criterion and
the meters take ``(logits, target)``. Segmentation has ``S = (H, W)``, classification none.
"""

from __future__ import annotations

import random
import time

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info
from tqdm import tqdm

from .distributed import (
    ShardedBatchSampler,
    all_reduce_sum_,
    get_rank,
    is_distributed,
    is_main_process,
)
from .errors import NonFiniteLossError
from .evaluation import eval_collate, unpack_batch
from .precision import autocast_context


# ----------------------------------------------------------------------------- data loading
def _reseed_transform(dataset: Dataset, seed: int) -> None:
    """Albumentations keeps its own RNG, which DataLoader seeding does not touch: reseed it."""
    transform = getattr(dataset, "transform", None)
    compose = getattr(transform, "compose", transform)
    if hasattr(compose, "set_random_seed"):
        compose.set_random_seed(seed % 2**32)


def _worker_init(worker_id: int) -> None:
    info = get_worker_info()
    _reseed_transform(info.dataset, info.seed + 7919 * get_rank())


def make_loader(
    dataset: Dataset, batch_size: int, train: bool, num_workers: int = 0, seed: int = 0
) -> DataLoader:
    """A DataLoader whose randomness is a function of :func:`seed_epoch`'s (seed, epoch) only,
    so a resumed run sees the same batches and augmentations as an uninterrupted one.

    Under torch.distributed, training uses a ``DistributedSampler`` (``batch_size`` per
    process) and evaluation a :class:`ShardedBatchSampler` (each sample exactly once).
    """
    common = dict(
        num_workers=num_workers,
        worker_init_fn=_worker_init,
        generator=torch.Generator(),
        pin_memory=torch.cuda.is_available(),
    )
    if is_distributed() and train:
        sampler = DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=True)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **common)
    if is_distributed():
        return DataLoader(dataset, batch_sampler=ShardedBatchSampler(len(dataset), batch_size),
                          collate_fn=eval_collate, **common)
    if not train:  # evaluation: samples of different sizes are evaluated one at a time
        common["collate_fn"] = eval_collate
    return DataLoader(dataset, batch_size=batch_size, shuffle=train, drop_last=train, **common)


def seed_epoch(loader: DataLoader, seed: int, epoch: int) -> None:
    """Make the shuffling and augmentation of ``epoch`` depend on ``(seed, epoch)`` alone."""
    epoch_seed = seed * 100_003 + epoch
    loader.generator.manual_seed(epoch_seed)
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)
    if loader.num_workers == 0:
        _reseed_transform(loader.dataset, epoch_seed * 7919 + get_rank())


# ----------------------------------------------------------------------------- train / eval
def train_one_epoch(
    model: nn.Module,
    criterion: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    amp: str = "none",
    scaler: torch.amp.GradScaler | None = None,
    grad_clip: float | None = None,
    progress: bool = True,
    desc: str = "train",
) -> dict[str, float]:
    """One pass over ``loader``. Returns the mean of the loss and of each term in
    ``criterion.terms`` (weighted by batch size), the throughput and the wall time.

    Raises:
        NonFiniteLossError: when the loss is NaN or infinite (before the optimizer step, so the
            weights stay those of the last good step), or when the last steps left non-finite
            weights (checked once, at the end of the epoch).
    """
    model.train()
    sums: dict[str, Tensor] = {}
    seen, start = 0, time.perf_counter()
    progress = progress and is_main_process()
    bar = tqdm(loader, desc=desc, leave=False, disable=not progress, dynamic_ncols=True)
    for step, batch in enumerate(bar):
        inputs, target = unpack_batch(batch)
        inputs = inputs.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with autocast_context(device, amp):
            logits = model(inputs)
        # per-pixel maps the criterion asks the training data for (cals_seg.data.extra_inputs)
        extras = {k: batch[k].to(device, non_blocking=True)
                  for k in getattr(criterion, "extra_inputs", ())}
        loss = criterion(logits, target, **extras)
        check = loss.detach().clone()
        all_reduce_sum_([check])  # a NaN on any rank stops every rank at the same step
        if not torch.isfinite(check):
            raise NonFiniteLossError(
                f"{desc}: the loss is {check.item()} at step {step}; stopping. The last good "
                "checkpoint is left intact: lower the learning rate (optim.lr), enable "
                "train.grad_clip, or check the labels."
            )
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        n = inputs.shape[0]
        seen += n
        for key, value in {"loss": loss.detach(), **getattr(criterion, "terms", {})}.items():
            sums[key] = sums.get(key, 0.0) + value.float() * n
        if progress:
            elapsed = time.perf_counter() - start
            bar.set_postfix(
                {k: f"{float(v) / seen:.4f}" for k, v in sums.items()}
                | {"img/s": f"{seen / elapsed:.1f}"}
            )
    # the trained weights only (a model may hold unused, uninitialised parameters)
    weights = [p.detach().float().sum() for p in model.parameters() if p.grad is not None]
    if weights and not bool(torch.stack(weights).isfinite().all()):
        raise NonFiniteLossError(
            f"{desc}: the weights became NaN or infinite in the epoch's last optimizer steps "
            "(the training diverged); stopping. The last good checkpoint is left intact: lower "
            "the learning rate (optim.lr), enable train.grad_clip, or check the labels."
        )
    elapsed = time.perf_counter() - start
    keys = sorted(sums)
    totals = torch.stack(
        [torch.as_tensor(sums[k], dtype=torch.float64, device=device) for k in keys]
        + [torch.tensor(seen, dtype=torch.float64, device=device)]
    )
    all_reduce_sum_([totals])  # means over every rank's samples
    seen_all = float(totals[-1])
    out = {k: float(v) / max(seen_all, 1.0) for k, v in zip(keys, totals[:-1], strict=True)}
    out.update(images_per_s=seen_all / elapsed if elapsed > 0 else 0.0, time=elapsed)
    return out


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 (the global RNG other code may use)
    torch.manual_seed(seed)
