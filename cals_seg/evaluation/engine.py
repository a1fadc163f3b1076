"""The evaluation engine: calibrator fits on validation and THE test pass over a split, each
split streamed through the network once.

- :func:`calibrated_test`: the post-TS temperature fitted on validation, then the test pass.
- :func:`run_test_pass`: the metrics of the raw logits, of ``logits / T`` and of every fitted
  calibrator (and of any other consumer of ``(logits, target, image)``, e.g. the conformal
  sets), all from ONE pass over the split.
- :func:`load_or_fit_calibrators` / :func:`fit_calibrators`: calibrators fitted on the
  validation logits; a calibrator that fits on more images than the split (``image_ts``: its
  corrupted copies) says which through ``fit_data(dataset)``, and the engine streams them.

Every forward pass goes through :class:`~cals_seg.evaluation.stream.Inference` /
:func:`~cals_seg.evaluation.stream.predict`, which serve an image already seen in this
evaluation from the logit cache (:mod:`cals_seg.evaluation.logit_cache`) instead of running the
network again: a fit's repeated passes over validation and the test pass's views cost one
network call per distinct image.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from cals_seg.calibrators import (
    Calibrator,
    TemperatureScaling,
    build_calibrator,
    load_calibrator,
    save_calibrator,
)
from cals_seg.calibrators.ts import fit_temperature
from cals_seg.evaluation.stream import Inference, Scaled, meter_group_key, predict
from cals_seg.metrics.functional import sum_over_ranks
from cals_seg.utils.distributed import is_main_process
from cals_seg.utils.fits import FitKey, FitStore

# Meters that only read the argmax: fed the raw logits when the calibrator cannot change it, so
# that their numbers (mIoU, accuracies) are bit-identical to the uncalibrated ones.
ARGMAX_METERS = ("segmentation",)


class Calibrated:
    """Meters fed a calibrator's output: ``update(logits, target, image)`` calls
    ``calibrator(logits, image)`` once and feeds every meter; when the calibrator cannot change
    the argmax, the meters named in ``argmax_meters`` get the raw logits instead.

    A calibrator that can tell whether an image lies outside what it was fitted on
    (``outside_fit(logits, image) -> (N,) bool``, e.g. ``image_ts``) also has its flagged images
    counted: :meth:`extra` gives ``{"outside_fit": flagged images / images}``, summed over ranks.

    Args:
        calibrator: a fitted calibrator (in eval mode).
        meters: ``{name: meter}`` with ``update(logits, target)``.
        argmax_meters: names of the meters that only read the argmax.
    """

    def __init__(self, calibrator: Calibrator, meters: Mapping[str, Any],
                 argmax_meters: Sequence[str] = ARGMAX_METERS) -> None:
        self.calibrator = calibrator
        self.meters = dict(meters)
        self.raw = set() if calibrator.changes_argmax else set(argmax_meters)
        # (flagged images, images), on the device of the logits once the first batch came
        self.outside: Tensor | None = None

    accepts_groups = True  # the evaluation passes the loader's region maps (``groups=``)

    @torch.no_grad()
    def update(self, logits: Tensor, target: Tensor, image: Tensor | None = None,
               groups: Mapping[str, Tensor] | None = None) -> None:
        """Feed every meter; a region meter whose maps are in ``groups`` (``{key: (N, H, W)}``,
        :func:`cals_seg.evaluation.stream.meter_group_key`) gets them."""
        image = image if self.calibrator.needs_image else None
        if hasattr(self.calibrator, "outside_fit"):
            flags = self.calibrator.outside_fit(logits, image)
            counts = torch.stack([flags.sum(), torch.tensor(flags.numel(), device=flags.device)])
            self.outside = counts if self.outside is None else self.outside + counts
        calibrated = self.calibrator(logits, image)
        for name, meter in self.meters.items():
            x = logits if name in self.raw else calibrated
            key = meter_group_key(meter) if groups else None
            if key is not None and key in groups:
                meter.update(x, target, groups=groups[key])
            else:
                meter.update(x, target)

    def extra(self) -> dict[str, float]:
        """``{"outside_fit": share of the images flagged}`` when the calibrator flags images
        (0 when none came), else ``{}``; call it on every rank (a collective under DDP)."""
        if not hasattr(self.calibrator, "outside_fit"):
            return {}
        counts = self.outside
        if counts is None:  # no batch on this rank: zeros where the calibrator lives
            device = next(iter(self.calibrator.buffers()), torch.zeros(())).device
            counts = torch.zeros(2, dtype=torch.int64, device=device)
        flagged, images = (int(v) for v in sum_over_ranks([counts.long()])[0].cpu())
        return {"outside_fit": flagged / images if images else 0.0}


def fit_calibrators(
    calibrators: Mapping[str, Calibrator],
    model: nn.Module,
    val_loader: DataLoader,
    device: torch.device,
    ignore_index: int,
    amp: str = "none",
    protocol: Any = None,
) -> dict[str, dict[str, Any]]:
    """Fit each calibrator on ``model``'s logits over ``val_loader``; returns ``{name:
    fit_info}``. The test split is never involved.

    Each of a fit's passes over validation calls :func:`~cals_seg.evaluation.stream.predict`,
    which serves the images already seen in this evaluation from the logit cache. A calibrator
    with ``fit_data(dataset) -> (dataset, fit keyword arguments)`` (``image_ts``: the split
    with corrupted copies interleaved) is fitted on that dataset, batched, collated and seeded
    as ``val_loader``."""
    out = {}
    for name, calibrator in calibrators.items():
        calibrator.to(device)
        loader, kwargs = val_loader, {}
        own = getattr(calibrator, "fit_data", None)
        if own is not None:
            data, kwargs = own(val_loader.dataset)
            if data is not val_loader.dataset:
                loader = _loader_like(val_loader, data)

        def batches(loader: DataLoader = loader) -> Any:
            return predict(model, loader, device, amp, protocol=protocol, with_inputs=True)

        out[name] = calibrator.fit(batches, ignore_index=ignore_index, **kwargs)
        calibrator.eval()
    return out


def _loader_like(loader: DataLoader, dataset: Any) -> DataLoader:
    """A loader over ``dataset`` with ``loader``'s batching, collation and worker seeding, in
    order."""
    size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", 1)
    return DataLoader(dataset, batch_size=size, shuffle=False, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, worker_init_fn=loader.worker_init_fn,
                      generator=torch.Generator())


def run_test_pass(
    infer: Inference,
    loader: DataLoader,
    meters: Callable[[], Mapping[str, Any]],
    temperature: float | None = None,
    calibrators: Mapping[str, Calibrator] | None = None,
    progress: bool = False,
    desc: str = "test",
    extra: Sequence[Any] = (),
) -> dict[str, Any]:
    """THE test pass: metrics of the raw logits, of the logits divided by ``temperature`` and of
    every fitted calibrator, all from ONE pass of the network over ``loader``.

    Every evaluation of a split goes through here (the trainer's final test, ``eval_seg``,
    compare's backfill and calibrators), so their numbers agree.

    Args:
        infer: the model, device, precision and protocol (:class:`~cals_seg.evaluation.stream.
            Inference`).
        loader: the split to evaluate.
        meters: returns a fresh ``{name: meter}`` set (e.g. ``lambda: task.meters(15,
            test=True)``); one set per view.
        temperature: T of the post-temperature-scaling view (meters fed ``logits / T``); None:
            no such view.
        calibrators: ``{name: fitted calibrator}``, each feeding its own meter set (see
            :class:`Calibrated`).
        progress, desc: the progress bar.

    Returns:
        ``{"pre_ts": metrics, "post_ts": metrics or None, "calibrators": {name: metrics}}``,
        each the merged ``compute()`` dicts of one meter set.
    """
    pre = infer.meters(meters)
    consumers: list[Any] = list(pre.values())
    post: dict[str, Any] = {}
    scaler = None
    if temperature is not None:
        post = infer.meters(meters)
        scaler = TemperatureScaling.fixed(temperature)
        consumers.append(Scaled(scaler, post.values()))
    calibrators = dict(calibrators or {})
    same_as_post = [name for name, cal in calibrators.items() if _is_post_ts(cal, scaler)]
    sets = {name: infer.meters(meters) for name in calibrators if name not in same_as_post}
    calibrated = {name: Calibrated(calibrators[name].to(infer.device).eval(), sets[name])
                  for name in sets}  # fmt: skip
    # more consumers of (logits, target, image) in the same pass
    image_consumers = [*calibrated.values(), *extra]
    infer.evaluate(loader, consumers, progress, desc, image_consumers)
    pre_parts = {name: meter.compute() for name, meter in pre.items()}
    post_parts = {name: meter.compute() for name, meter in post.items()}
    out = {name: {**_merged(s.values()), **calibrated[name].extra()} for name, s in sets.items()}
    for name in same_as_post:  # what Calibrated would feed: raw logits to the argmax meters
        out[name] = _merged(pre_parts[m] if m in ARGMAX_METERS else post_parts[m] for m in pre)
    return {
        "pre_ts": _merged(pre_parts.values(), computed=True),
        "post_ts": _merged(post_parts.values(), computed=True) if post else None,
        "calibrators": {name: out[name] for name in calibrators},
    }


def _is_post_ts(calibrator: Calibrator, scaler: TemperatureScaling | None) -> bool:
    """Whether ``calibrator`` is the post-TS view itself: the ``ts`` calibrator with the same
    temperature, bit for bit (its meters would see the same logits as the post-TS meters, the
    argmax meters the raw ones): its metrics are then read from those views, not computed
    again."""
    return (scaler is not None and type(calibrator) is TemperatureScaling
            and not calibrator.changes_argmax
            and torch.equal(calibrator.temperature.cpu(), scaler.temperature.cpu()))


def _merged(parts: Any, computed: bool = False) -> dict[str, Any]:
    """One metrics dict from meters (``compute()`` each) or from their computed dicts, merged
    in order, as :func:`~cals_seg.evaluation.stream.compute`."""
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part if computed or isinstance(part, dict) else part.compute())
    return out


def fit_post_temperature(infer: Inference, val_loader: DataLoader, ignore_index: int) -> float:
    """The post-TS temperature: :func:`~cals_seg.calibrators.ts.fit_temperature` on the
    validation logits of ``infer`` (its passes served from the logit cache after the first)."""
    return fit_temperature(lambda: infer.predict(val_loader), ignore_index=ignore_index)


def calibrated_test(
    infer: Inference, task: Any, val_loader: DataLoader, test_loader: DataLoader,
    n_bins: int = 15, temperature_scaling: bool = True, progress: bool = False,
    calibrators: Mapping[str, Calibrator] | None = None, *,
    temperature: float | None = None, extra: Sequence[Any] = (),
) -> dict[str, Any]:
    """Test metrics before and after temperature scaling fitted on ``val_loader``, from ONE
    pass over ``test_loader`` (:func:`run_test_pass`; each of the fitted ``calibrators`` feeds
    its own set of meters, and each of ``extra`` sees ``update(logits, target, image)``, in the
    same pass). The trainer's final test and ``eval_seg`` call it.

    Args:
        infer: the model, device, precision and protocol
            (:class:`~cals_seg.evaluation.stream.Inference`).
        task: its ``meters(n_bins, test=True)`` are the test meters; ``ignore_index`` is used
            when fitting T.
        temperature: T already fitted (:func:`fit_post_temperature`, e.g. because a consumer in
            ``extra`` needs it); None: fitted here when ``temperature_scaling``.
        extra: more consumers of the test pass (the conformal sets, the entropy statistics).

    Returns:
        ``{"temperature": T, "pre_ts": {...}, "post_ts": {...} or None}`` (and
        ``"calibrators": {name: {...}}`` when calibrators are given), the metrics being the
        merged outputs of ``task.meters(n_bins, test=True)``.
    """
    if not temperature_scaling:
        temperature = None
    elif temperature is None:
        temperature = fit_post_temperature(infer, val_loader, task.ignore_index)
    out = run_test_pass(infer, test_loader, lambda: task.meters(n_bins, test=True),
                        temperature, calibrators, progress, extra=extra)
    result = {"temperature": 1.0 if temperature is None else temperature,
              "pre_ts": out["pre_ts"], "post_ts": out["post_ts"]}
    if calibrators:
        result["calibrators"] = out["calibrators"]
    return result


def load_or_fit_calibrators(
    names: Sequence[str],
    store: FitStore | str | Path,
    num_classes: int,
    infer: Inference,
    val_loader: DataLoader,
    ignore_index: int,
    refit: bool = False,
    params: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    keys: Mapping[str, FitKey] | None = None,
) -> tuple[dict[str, Calibrator], dict[str, dict[str, Any]]]:
    """The calibrators ``names``: loaded from ``store`` when the fit saved there is for this
    use, else built (with ``params[name]``), fitted on the logits of ``infer`` (the model,
    device, precision and protocol) over ``val_loader`` and saved there with its key.

    A saved fit is reused only when it passes :func:`cals_seg.calibrators.load_calibrator`'s
    checks and its record equals ``keys[name]`` on every field
    (:meth:`~cals_seg.utils.fits.FitStore.reuse`; build the key with
    :func:`cals_seg.calibrators.calibrator_key`). Otherwise it is refit, with one line on
    stderr: ``<folder>/ts.pt was fitted for precision="bf16", not precision="none":
    refitting``. Without a key for ``name`` (a caller that does not say what the fit is for)
    a saved fit is never reused, and the new one is saved without a record.

    Returns:
        ``({name: calibrator}, {name: fit summary})``; a summary holds the method's
        ``fit_info``, ``"loaded": True`` for a loaded one, else the fit's wall-clock
        ``fit_seconds`` and, on CUDA, ``fit_peak_memory_mib`` (peak allocated during the fit,
        the network's forward passes included); ``file`` and ``fitted_for`` (the record).
    """
    store = store if isinstance(store, FitStore) else FitStore(store)
    device = infer.device
    out, info = {}, {}
    for name in names:
        path, key = store.calibrator(name), (keys or {}).get(name)
        record = key.record() if key is not None else None
        if path.is_file() and not refit:
            if key is None:
                reason = "is not reused: the caller gives no record of what the fit must be for"
            else:
                cal, problem = store.reuse(path, key, lambda p: load_calibrator(
                    p, device, num_classes=num_classes))
                if problem is None:
                    out[name] = cal
                    info[name] = {**cal.fit_info, "loaded": True, "file": str(path),
                                  "fitted_for": record}
                    continue
                reason = problem[1]
            print(f"{path} {reason}: refitting", file=sys.stderr, flush=True)
        cal = build_calibrator(name, num_classes, **dict((params or {}).get(name, {})))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        fit_calibrators({name: cal}, infer.model, val_loader, device, ignore_index, infer.amp,
                        infer.protocol)
        summary = {**cal.fit_info, "loaded": False, "fit_seconds": time.perf_counter() - start}
        if device.type == "cuda":
            summary["fit_peak_memory_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        cal.fit_info = summary
        if is_main_process():  # every rank fitted the same calibrator; one writes it
            save_calibrator(cal, path, fitted_for=key)
        cal.fitted_for = record
        out[name], info[name] = cal, {**summary, "file": str(path), "fitted_for": record}
    return out, info


# (metric key, column title, shown in percent) of the calibrator tables.
TABLE_COLUMNS = (
    ("ece", "ECE", True),
    ("ece_band_weighted", "band-weighted ECE", True),
    ("ba_ece", "BA-ECE", True),
    ("ece_boundary", "boundary ECE", True),
    ("ece_interior", "interior ECE", True),
    ("nll", "NLL", False),
    ("aurc", "AURC", True),
    ("miou", "mIoU", True),
)


def table_values(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """The numbers of :data:`TABLE_COLUMNS` from one metrics dict (boundary ECE: the first
    distance band's, interior: the last band's)."""
    bands = metrics.get("ece_band") or [None]
    values = {key: metrics.get(key) for key, _, _ in TABLE_COLUMNS}
    values.update(ece_boundary=bands[0], ece_interior=bands[-1])
    return values


def calibration_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table, one row per ``{name: metrics dict}`` (values in % except NLL)."""
    lines = ["| calibration | " + " | ".join(t for _, t, _ in TABLE_COLUMNS) + " |",
             "|---|" + "---:|" * len(TABLE_COLUMNS)]
    for name, metrics in rows.items():
        values = table_values(metrics)
        cells = ["-" if values[k] is None else f"{values[k] * (100 if pct else 1):.2f}"
                 for k, _, pct in TABLE_COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
