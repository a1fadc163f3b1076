"""Task-agnostic training step, data loaders and seeding (evaluation:
:mod:`cals_seg.evaluation.stream`;
checkpoints and run files: :mod:`cals_seg.runs.run`).

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
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

from cals_seg.errors import NonFiniteLossError
from cals_seg.evaluation.stream import (
    evaluation_loader,
    reseed_transform,
    unpack_batch,
    worker_init,
)
from cals_seg.losses import bad_labels_message
from cals_seg.utils.distributed import (
    all_reduce_sum_,
    get_rank,
    is_distributed,
    is_main_process,
)
from cals_seg.utils.precision import autocast_context

CHECK_EVERY = 50
"""Training steps between two reads of the device-side checks (and progress-bar updates)."""

_NON_FINITE = (
    "{desc}: the loss is {value} at step {step}; stopping. The last good checkpoint is left "
    "intact: lower the learning rate (optim.lr), enable train.grad_clip, or check the labels."
)


# ----------------------------------------------------------------------------- data loading
def make_loader(
    dataset: Dataset, batch_size: int, train: bool, num_workers: int = 0, seed: int = 0
) -> DataLoader:
    """A DataLoader whose randomness is a function of :func:`seed_epoch`'s (seed, epoch) only,
    so a resumed run sees the same batches and augmentations as an uninterrupted one.

    Under torch.distributed, training uses a ``DistributedSampler`` (``batch_size`` per
    process) and evaluation a :class:`ShardedBatchSampler` (each sample exactly once).
    """
    if not train:  # evaluation: in order, sharded under torchrun, one size per batch
        return evaluation_loader(dataset, batch_size, num_workers)
    common = dict(
        num_workers=num_workers,
        worker_init_fn=worker_init,
        generator=torch.Generator(),
        pin_memory=torch.cuda.is_available(),
    )
    if is_distributed():
        sampler = DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=True)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **common)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, **common)


def seed_epoch(loader: DataLoader, seed: int, epoch: int) -> None:
    """Make the shuffling and augmentation of ``epoch`` depend on ``(seed, epoch)`` alone."""
    epoch_seed = seed * 100_003 + epoch
    loader.generator.manual_seed(epoch_seed)
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)
    if loader.num_workers == 0:
        reseed_transform(loader.dataset, epoch_seed * 7919 + get_rank())


# ----------------------------------------------------------------------------- train / eval
class StepChecks:
    """The checks of every training step, kept on the device and read every ``every`` steps.

    Each step adds to 0-dim device tensors (no host synchronisation): whether the loss is
    finite (the first non-finite step and its value are kept) and how many targets were
    outside ``[0, K)`` (the count a criterion with ``deferred_checks`` leaves in
    ``bad_labels``). :meth:`check` all-reduces them (so every process stops at the same step),
    reads them on the host once and raises the error the eager check would have raised.

    Args:
        device: where the flags live (the loss's device).
        criterion: the loss (its ``num_classes`` and ``ignore_index`` word the label error).
    """

    def __init__(self, device: torch.device, criterion: nn.Module) -> None:
        self.criterion = criterion
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)  # non-finite, bad labels
        self.first_step = torch.full((), -1, dtype=torch.int64, device=device)
        self.first_value = torch.zeros((), dtype=torch.float32, device=device)

    def record(self, step: int, loss: Tensor, bad_labels: Tensor | None) -> None:
        """Add one step's loss (0-dim, detached) and bad-label count (0-dim int64 or None)."""
        bad = ~torch.isfinite(loss)
        first = bad & (self.first_step < 0)
        self.first_step = torch.where(first, step, self.first_step)
        self.first_value = torch.where(first, loss.float(), self.first_value)
        labels = bad_labels if bad_labels is not None else torch.zeros_like(self.counts[1])
        self.counts += torch.stack([bad.long(), labels.long()])

    def check(self, desc: str, step: int) -> None:
        """Read the flags (one synchronisation; an all-reduce under torch.distributed).

        Raises:
            ValueError: targets outside ``[0, K)`` were seen since the start of the epoch.
            NonFiniteLossError: a loss was NaN or infinite.
        """
        counts = self.counts.clone()
        all_reduce_sum_([counts])
        non_finite, bad_labels = counts.tolist()
        if bad_labels:
            c = self.criterion
            raise ValueError(
                f"{desc}: {bad_labels_message(bad_labels, c.num_classes, c.ignore_index)} "
                f"(found by the check at step {step}; train.debug_checks: true stops at the "
                "first such batch and lists the values)"
            )
        if non_finite:
            first = int(self.first_step)
            value = float(self.first_value) if first >= 0 else float("nan")
            where = first if first >= 0 else f"<= {step} on another process"
            raise NonFiniteLossError(_NON_FINITE.format(desc=desc, value=value, step=where))


def _base_module(module: nn.Module) -> nn.Module:
    """The module under ``torch.compile``'s wrapper (itself when not compiled)."""
    return getattr(module, "_orig_mod", module)


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
    debug_checks: bool = False,
) -> dict[str, float]:
    """One pass over ``loader``. Returns the mean of the loss and of each term in
    ``criterion.terms`` (weighted by batch size), the throughput and the wall time.

    A step does not synchronise with the device: the label check of the criterion and the
    finiteness check of the loss stay on the device (:class:`StepChecks`) and are read every
    :data:`CHECK_EVERY` steps and at the end of the epoch, where the progress bar is updated
    too. A bad step therefore stops the epoch at the next check, not at once; the weights are
    never saved in between (checkpoints are written after validation), so the last good
    checkpoint stays intact. ``debug_checks=True`` restores the checks of every step: the
    criterion raises on the first batch with bad labels (listing the values), a non-finite
    loss stops before its optimizer step, the bar is updated every step.

    Raises:
        NonFiniteLossError: when the loss is NaN or infinite, or when the last steps left
            non-finite weights (checked once, at the end of the epoch).
        ValueError: targets outside ``[0, K)`` other than the criterion's ``ignore_index``.
    """
    model.train()
    sums: dict[str, Tensor] = {}
    seen, start = 0, time.perf_counter()
    progress = progress and is_main_process()
    base = _base_module(criterion)
    deferred_before = getattr(base, "deferred_checks", None)
    if deferred_before is not None:
        base.deferred_checks = not debug_checks
    checks = StepChecks(device, base)
    bar = tqdm(loader, desc=desc, leave=False, disable=not progress, dynamic_ncols=True)
    try:
        step = -1
        for step, batch in enumerate(bar):
            inputs, target = unpack_batch(batch)
            inputs = inputs.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with autocast_context(device, amp):
                logits = model(inputs)
            # per-pixel maps the criterion asks the training data for
            # (cals_seg.data.extra_inputs)
            extras = {k: batch[k].to(device, non_blocking=True)
                      for k in getattr(base, "extra_inputs", ())}
            loss = criterion(logits, target, **extras)
            checks.record(step, loss.detach(), getattr(base, "bad_labels", None)
                          if not debug_checks else None)
            if debug_checks:
                checks.check(desc, step)  # before the optimizer step
            _optimizer_step(model, loss, optimizer, scaler, grad_clip)
            n = inputs.shape[0]
            seen += n
            for key, value in {"loss": loss.detach(), **getattr(base, "terms", {})}.items():
                sums[key] = sums.get(key, 0.0) + value.float() * n
            if (step + 1) % CHECK_EVERY == 0 and not debug_checks:
                checks.check(desc, step)
            if progress and (debug_checks or (step + 1) % CHECK_EVERY == 0):
                _show(bar, sums, seen, start)
        checks.check(desc, step)
    finally:
        if deferred_before is not None:
            base.deferred_checks = deferred_before
    if progress:
        _show(bar, sums, seen, start)
    return _epoch_end(model, sums, seen, start, device, desc)


def _optimizer_step(model: nn.Module, loss: Tensor, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler | None, grad_clip: float | None) -> None:
    """Backward, optional unscale and gradient clipping, optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    if grad_clip:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if scaler is not None:
        scaler.step(optimizer)  # fp16: reads the found-inf flag on the host (GradScaler's own)
        scaler.update()
    else:
        optimizer.step()


def _show(bar: tqdm, sums: dict[str, Tensor], seen: int, start: float) -> None:
    """The running means on the progress bar (one host read of all of them)."""
    if not sums:
        return
    values = torch.stack([torch.as_tensor(v).double() for v in sums.values()]).tolist()
    elapsed = time.perf_counter() - start
    bar.set_postfix({k: f"{v / seen:.4f}" for k, v in zip(sums, values, strict=True)}
                    | {"img/s": f"{seen / max(elapsed, 1e-9):.1f}"})


def _epoch_end(model: nn.Module, sums: dict[str, Tensor], seen: int, start: float,
               device: torch.device, desc: str) -> dict[str, float]:
    """The end-of-epoch weight check and the epoch means over every process."""
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
