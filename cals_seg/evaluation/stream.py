"""Evaluation: stream a model's logits into whatever consumes them.

One pass of the model over a loader feeds a list of *consumers*: objects with
``update(logits, target)`` (the meters, :class:`Scaled` groups of meters) or plain callables
(``criterion.observe``). Which meters a task reports is the task's business
(:meth:`cals_seg.tasks.Task.meters`); this module only moves logits::

    pre = task.meters(n_bins=15)
    post = task.meters(n_bins=15)
    post_ts = Scaled(TemperatureScaling.fixed(T), post.values())
    evaluate(model, test_loader, device, [*pre.values(), post_ts])
    metrics = compute(pre)

A region meter (distance bands, object sizes) analyses each ground-truth mask before binning.
Its ``group_fn()`` can run where the data is loaded instead: a dataset whose items carry the
maps under :func:`group_key` of that function (``tasks/segmentation.py`` adds them to the
``val`` and ``test`` splits: :func:`group_fns` of the task's meters, through
``SegmentationTransform.add_extra_inputs``) has them split with the target and passed to the
meter as ``update(logits, target, groups=maps)``; a meter whose maps the batch lacks computes
them itself, with the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info
from tqdm import tqdm

from cals_seg.evaluation.inference import EvalProtocol, FiniteLogits, segment_logits
from cals_seg.evaluation.logit_cache import active_cache, cached_logits
from cals_seg.metrics import BoundaryAwareECEMeter
from cals_seg.utils.distributed import (
    ShardedBatchSampler,
    get_rank,
    is_distributed,
    is_main_process,
)
from cals_seg.utils.precision import autocast_context


class Updatable(Protocol):
    """What the evaluation feeds: anything with ``update(logits (N, K, *S), target (N, *S))``
    (a :class:`cals_seg.metrics.Meter`, a :class:`Scaled` group, a conformal set meter)."""

    def update(self, logits: Tensor, target: Tensor) -> None: ...


Consumer = Updatable | Callable[[Tensor, Tensor], None]


GROUPS_PREFIX = "groups:"


def group_key(fn: Callable[..., Any]) -> str:
    """The item key of the maps made by a region meter's ``group_fn()``: its type and
    arguments, e.g. ``"groups:BandGroups(bands=(3.0, 8.0), ignore_index=255)"``, so that maps
    only ever reach a meter whose own analysis they are."""
    args = ", ".join(f"{name}={value!r}" for name, value in sorted(vars(fn).items()))
    return f"{GROUPS_PREFIX}{type(fn).__name__}({args})"


def meter_group_key(consumer: Any) -> str | None:
    """:func:`group_key` of ``consumer.group_fn()`` for a meter that takes
    ``update(..., groups=...)``; None for anything else (``BoundaryAwareECEMeter`` needs the
    distances, not only the rings, and computes them itself)."""
    if isinstance(consumer, BoundaryAwareECEMeter) or not callable(
            getattr(consumer, "group_fn", None)):
        return None
    return group_key(consumer.group_fn())


def group_fns(meters: Iterable[Any]) -> dict[str, Callable[..., Any]]:
    """``{group_key: group_fn()}`` of the ``meters`` that take loader-made groups: what a
    split's ``SegmentationTransform.add_extra_inputs`` is given so that its items carry them."""
    out = {}
    for meter in meters:
        key = meter_group_key(meter)
        if key is not None:
            out[key] = meter.group_fn()
    return out


def batch_groups(batch: Any) -> dict[str, Tensor]:
    """The group maps a batch carries (``{group_key: (N, H, W) integer}``), or ``{}``."""
    if not isinstance(batch, dict):
        return {}
    return {k: v for k, v in batch.items()
            if isinstance(k, str) and k.startswith(GROUPS_PREFIX) and isinstance(v, Tensor)}


def unpack_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """``(inputs, target)`` from a dict (``image``/``mask`` or ``input``/``target``) or tuple."""
    if isinstance(batch, dict):
        if "image" in batch:
            return batch["image"], batch["mask"]
        return batch["input"], batch["target"]
    return batch[0], batch[1]


# Segmentation images above this size are evaluated one at a time even when they stack.
ONE_AT_A_TIME_PIXELS = 1024 * 1024


class RaggedBatch(list):
    """Samples of different sizes that cannot be stacked: a list of batches of one, evaluated
    one at a time (:func:`eval_collate`)."""


def _shapes(sample: Any) -> tuple[tuple[int, ...], ...]:
    items = sample.values() if isinstance(sample, dict) else sample
    return tuple(tuple(v.shape) for v in items if isinstance(v, Tensor))


def eval_collate(samples: list[Any]) -> Any:
    """``default_collate``, or a :class:`RaggedBatch` when the samples differ in size (images
    evaluated at their own resolution), so that no evaluation fails on a mixed-size split."""
    if len({_shapes(s) for s in samples}) > 1:
        return RaggedBatch(default_collate([s]) for s in samples)
    return default_collate(samples)


def run_loader(run: Any) -> Callable[[Dataset], DataLoader]:
    """A dataset -> its :func:`evaluation_loader` at ``run``'s ``eval.batch_size`` and
    ``data.num_workers`` (what the library's functions stream a split with by default)."""
    batch, workers = run.config.eval.batch_size, run.config.data.num_workers
    return lambda dataset: evaluation_loader(dataset, batch, workers)


def reseed_transform(dataset: Dataset, seed: int) -> None:
    """Albumentations keeps its own RNG, which DataLoader seeding does not touch: reseed it."""
    transform = getattr(dataset, "transform", None)
    compose = getattr(transform, "compose", transform)
    if hasattr(compose, "set_random_seed"):
        compose.set_random_seed(seed % 2**32)


def worker_init(worker_id: int) -> None:
    """A loader worker's transforms seeded from the loader's seed and the rank."""
    info = get_worker_info()
    reseed_transform(info.dataset, info.seed + 7919 * get_rank())


def evaluation_loader(dataset: Dataset, batch_size: int, num_workers: int = 0) -> DataLoader:
    """The loader of an evaluation pass over ``dataset``: in order, samples of different sizes
    evaluated one at a time (:func:`eval_collate`); under torch.distributed a
    :class:`~cals_seg.utils.distributed.ShardedBatchSampler` (each sample exactly once)."""
    common = dict(num_workers=num_workers, worker_init_fn=worker_init,
                  generator=torch.Generator(), pin_memory=torch.cuda.is_available(),
                  collate_fn=eval_collate)
    if is_distributed():
        return DataLoader(dataset, batch_sampler=ShardedBatchSampler(len(dataset), batch_size),
                          **common)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=False, **common)


class Scaled:
    """Consumers fed ``scaler(logits)``: with ``scaler = TemperatureScaling.fixed(T)`` (the ``ts``
    calibrator, :mod:`cals_seg.calibrators.ts`) the post-temperature-scaling view.

    Args:
        scaler: logits ``(N, K, *S)`` -> logits of the same shape. A fixed
            ``TemperatureScaling`` left on the CPU divides logits on any device by its 0-dim
            temperature as by a scalar.
        consumers: what it feeds.
    """

    def __init__(self, scaler: Callable[[Tensor], Tensor], consumers: Iterable[Consumer]) -> None:
        self.scaler = scaler
        self.consumers = list(consumers)

    @torch.no_grad()
    def update(self, logits: Tensor, target: Tensor,
               groups: Mapping[str, Tensor] | None = None) -> None:
        """Feed ``scaler(logits)``; ``groups``: the batch's group maps (:func:`batch_groups`),
        passed on to the meters they belong to."""
        _feed(self.consumers, self.scaler(logits), target, groups)


def _feed(consumers: Sequence[Consumer], logits: Tensor, target: Tensor,
          groups: Mapping[str, Tensor] | None = None) -> None:
    """``update(logits, target)`` on every consumer; a region meter whose maps are in
    ``groups`` gets them (``groups=``), a :class:`Scaled` gets all of them."""
    for consumer in consumers:
        if groups:
            if isinstance(consumer, Scaled):
                consumer.update(logits, target, groups)
                continue
            key = meter_group_key(consumer)
            if key is not None and key in groups:
                consumer.update(logits, target, groups=groups[key])
                continue
        update = getattr(consumer, "update", consumer)
        update(logits, target)


def _num_samples(loader: DataLoader) -> int | None:
    """Samples this process will see (for a per-image progress bar)."""
    try:
        return sum(len(b) for b in loader.batch_sampler)
    except TypeError:  # an iterable dataset, or a sampler without a length
        return None


@torch.no_grad()
def predict(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    amp: str = "none",
    progress: bool = False,
    desc: str = "eval",
    protocol: EvalProtocol | None = None,
    with_inputs: bool = False,
) -> Iterator[tuple[Tensor, ...]]:
    """Yield ``(logits (N, K, *S) float32, target (N, *S))`` per batch, model in eval mode
    (``with_inputs``: ``(logits, target, inputs)``, the inputs as the loader gives them, on
    ``device``: for a segmentation protocol, the image at the logits' resolution).

    ``amp`` is a resolved precision (``none``, ``bf16``, ``fp16``) for the forward pass only.
    With a ``protocol`` (segmentation) the logits come from
    :func:`cals_seg.evaluation.inference.segment_logits`: whatever the network input (resized,
    padded,
    tiled), they are at each image's own resolution, like its unmodified mask. The progress bar
    counts images. Inside a :func:`~cals_seg.evaluation.logit_cache.logit_cache` block, a
    second pass over the same ``DataLoader`` is served from memory once a first one was held
    (:meth:`~cals_seg.evaluation.logit_cache.LogitCache.replay`).
    """

    def stream() -> Iterator[tuple[Tensor, ...]]:
        for logits, target, inputs, _ in _predict(model, loader, device, amp, progress, desc,
                                                  protocol, with_groups=False):
            yield logits, target, inputs

    cache = active_cache()
    passes = stream() if cache is None or not isinstance(loader, DataLoader) else cache.replay(
        loader, (model, str(device), amp, protocol), stream)
    for logits, target, inputs in passes:
        yield (logits, target, inputs) if with_inputs else (logits, target)


@torch.no_grad()
def _predict(
    model: nn.Module, loader: DataLoader, device: torch.device, amp: str, progress: bool,
    desc: str, protocol: EvalProtocol | None, with_groups: bool = True,
) -> Iterator[tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]]:
    """:func:`predict`'s ``(logits, target, inputs)`` and the batch's group maps
    (:func:`batch_groups`, split and moved like the target: the protocol brings the logits to
    the mask as the loader gives it, which is never cropped or padded, so neither are they;
    ``{}`` without ``with_groups``). NaN or infinite logits raise
    :class:`~cals_seg.evaluation.inference.NonFiniteLogitsError` (on an accelerator once, at
    the end of the pass: :class:`~cals_seg.evaluation.inference.FiniteLogits`)."""
    model.eval()
    finite = FiniteLogits()
    progress = progress and is_main_process()
    bar = tqdm(total=_num_samples(loader) if progress else None, desc=desc, unit="img",
               leave=False, disable=not progress, dynamic_ncols=True)
    with bar:
        for batch in loader:
            for part in batch if isinstance(batch, RaggedBatch) else (batch,):
                maps = batch_groups(part) if with_groups else {}
                pieces = _pieces(*unpack_batch(part), protocol, maps)
                for inputs, target, groups in pieces:
                    inputs = inputs.to(device, non_blocking=True)
                    if protocol is not None:
                        logits = segment_logits(model, inputs, protocol, amp, finite)
                    else:  # classification: served by the logit cache as segment_logits is
                        logits = cached_logits(model, inputs, ("whole", amp),
                                               lambda x=inputs: _forward(model, x, device, amp))
                    bar.update(len(target))
                    target = target.to(device, non_blocking=True)
                    groups = {k: v.to(device, non_blocking=True) for k, v in groups.items()}
                    yield logits.float(), target, inputs, groups
    finite.check()


def _forward(model: nn.Module, inputs: Tensor, device: torch.device, amp: str) -> Tensor:
    """``model(inputs)`` in precision ``amp`` (a network without an evaluation protocol)."""
    with autocast_context(device, amp):
        return model(inputs)


def _pieces(inputs: Tensor, target: Tensor, protocol: EvalProtocol | None,
            groups: Mapping[str, Tensor] | None = None
            ) -> Iterable[tuple[Tensor, Tensor, dict[str, Tensor]]]:
    """The batch, or its images one at a time where their logits at full size would be large
    (slide mode, or above :data:`ONE_AT_A_TIME_PIXELS`): memory stays that of one image. The
    ``groups`` maps (``{key: (N, H, W)}``) are split like the target."""
    groups = dict(groups or {})
    large = protocol is not None and inputs.dim() == 4 and (
        protocol.mode == "slide" or inputs.shape[-2] * inputs.shape[-1] > ONE_AT_A_TIME_PIXELS)
    if not large or len(inputs) == 1:
        return ((inputs, target, groups),)
    return ((inputs[i:i + 1], target[i:i + 1], {k: v[i:i + 1] for k, v in groups.items()})
            for i in range(len(inputs)))


def evaluate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    consumers: Sequence[Consumer],
    amp: str = "none",
    progress: bool = False,
    desc: str = "eval",
    protocol: EvalProtocol | None = None,
    image_consumers: Sequence[Any] = (),
) -> None:
    """One pass of ``model`` over ``loader``; every batch goes to every consumer (``protocol``:
    see :func:`predict`; a region meter whose group maps the batch carries gets them, see the
    module docstring), and to each of ``image_consumers`` as ``update(logits, target,
    inputs)`` (e.g. :class:`cals_seg.evaluation.engine.Calibrated`)."""
    for logits, target, inputs, groups in _predict(model, loader, device, amp, progress, desc,
                                                   protocol):
        _feed(consumers, logits, target, groups)
        for consumer in image_consumers:
            if groups and getattr(consumer, "accepts_groups", False):
                consumer.update(logits, target, inputs, groups=groups)
            else:
                consumer.update(logits, target, inputs)


@dataclass(frozen=True)
class Inference:
    """How a network is run for evaluation: the model (put in eval mode by each pass), the
    device, the resolved precision (``none``/``bf16``/``fp16``) and, for segmentation, the
    evaluation protocol. One object instead of four loose arguments::

        infer = Inference(model, device, "bf16", task.protocol)
        infer.evaluate(test_loader, [*meters.values()])
    """

    model: nn.Module
    device: torch.device
    amp: str = "none"
    protocol: EvalProtocol | None = None

    def predict(self, loader: DataLoader, progress: bool = False, desc: str = "eval",
                with_inputs: bool = False) -> Iterator[tuple[Tensor, ...]]:
        """:func:`predict` with this model, device, precision and protocol."""
        return predict(self.model, loader, self.device, self.amp, progress, desc, self.protocol,
                       with_inputs)

    def evaluate(self, loader: DataLoader, consumers: Sequence[Consumer], progress: bool = False,
                 desc: str = "eval", image_consumers: Sequence[Any] = ()) -> None:
        """:func:`evaluate` with this model, device, precision and protocol."""
        evaluate(self.model, loader, self.device, consumers, self.amp, progress, desc,
                 self.protocol, image_consumers)

    def meters(self, make: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
        """A fresh meter set from ``make()``, moved to this device."""
        return {k: m.to(self.device) for k, m in make().items()}


def compute(meters: Mapping[str, Any]) -> dict[str, Any]:
    """The merged ``compute()`` dicts of ``meters`` (all-reduced under torch.distributed)."""
    out: dict[str, Any] = {}
    for meter in meters.values():
        out.update(meter.compute())
    return out


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric entries of a metrics dict, keys prefixed (lists, dicts and None dropped)."""
    return {
        f"{prefix}{k}": v
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
