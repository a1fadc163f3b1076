"""Task-agnostic training and evaluation steps, data loaders and checkpoint I/O.

One loop serves every task: a batch is ``(inputs, target)`` (or a dict with ``image``/``mask``
or ``input``/``target``), the model maps inputs to logits ``(N, K, *S)`` and the criterion and
the meters take ``(logits, target)``. Segmentation has ``S = (H, W)``, classification none.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
from .metrics import CalibrationMeter, SegmentationMeter
from .precision import autocast_context



class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; training stops, checkpoints stay intact."""


def unpack_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """``(inputs, target)`` from a dict (``image``/``mask`` or ``input``/``target``) or tuple."""
    if isinstance(batch, dict):
        if "image" in batch:
            return batch["image"], batch["mask"]
        return batch["input"], batch["target"]
    return batch[0], batch[1]


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
        return DataLoader(
            dataset, batch_sampler=ShardedBatchSampler(len(dataset), batch_size), **common
        )
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
            weights stay those of the last good step).
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
        loss = criterion(logits, target)
        check = loss.detach().clone()
        all_reduce_sum_([check])  # a NaN on any rank stops every rank at the same step
        if not torch.isfinite(check):
            raise NonFiniteLossError(
                f"{desc}: the loss is {check.item()} at step {step}; stopping. The last good "
                "checkpoint is left intact: lower the learning rate, enable grad_clip, or check "
                "the labels."
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


@torch.no_grad()
def predict(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    temperature: float = 1.0,
    amp: str = "none",
    progress: bool = False,
    desc: str = "eval",
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(logits / T, target)`` per batch in float32 (model in eval mode)."""
    model.eval()
    progress = progress and is_main_process()
    for batch in tqdm(loader, desc=desc, leave=False, disable=not progress, dynamic_ncols=True):
        inputs, target = unpack_batch(batch)
        with autocast_context(device, amp):
            logits = model(inputs.to(device, non_blocking=True))
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        yield logits, target.to(device, non_blocking=True)


def evaluate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    num_classes: int,
    ignore_index: int,
    n_bins: int = 15,
    classwise: bool = False,
    segmentation: bool = True,
    temperature: float = 1.0,
    observe: Callable[[Tensor, Tensor], None] | None = None,
    amp: str = "none",
    progress: bool = False,
    desc: str = "eval",
) -> dict[str, Any]:
    """Stream ``loader`` through the model into the calibration (and segmentation) meters.

    ``observe`` (e.g. ``criterion.observe``) receives the same ``(logits, target)`` batches, so
    one validation pass feeds both the metrics and the CALS multiplier statistics.

    Returns:
        The merged ``compute()`` dicts of :class:`CalibrationMeter` and, when ``segmentation``,
        :class:`SegmentationMeter` (all-reduced under torch.distributed).
    """
    cal = CalibrationMeter(
        num_classes, n_bins=n_bins, ignore_index=ignore_index, classwise=classwise
    ).to(device)
    seg = (
        SegmentationMeter(num_classes, ignore_index=ignore_index).to(device)
        if segmentation
        else None
    )
    for logits, target in predict(model, loader, device, temperature, amp, progress, desc):
        cal.update(logits, target)
        if seg is not None:
            seg.update(logits, target)
        if observe is not None:
            observe(logits, target)
    out = cal.compute()
    if seg is not None:
        out.update(seg.compute())
    return out


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then an atomic rename: a crash
    mid-write never leaves a truncated checkpoint behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` (a trusted file of this toolkit: it
    holds RNG states, so it is not loaded with ``weights_only``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    return torch.load(path, map_location=map_location, weights_only=False)


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) RNG states, for exact resume."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 (the global RNG other code may use)
    torch.manual_seed(seed)
