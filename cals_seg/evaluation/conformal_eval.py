"""A run's conformal sets in use: measured on a split (``eval_seg --conformal``), made for
one image (``predict_seg --conformal``), and their tables and pictures (docs/conformal.md).

The fits come from :mod:`cals_seg.evaluation.conformal_fit`; ``run``, ``spec`` and ``loader``
are as there.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cals_seg.evaluation.conformal import as_spatial
from cals_seg.evaluation.conformal_fit import Loader, calibrated, fit_conformal
from cals_seg.evaluation.inference import normalise, segment_logits
from cals_seg.evaluation.stream import predict
from cals_seg.metrics.conformal import PredictionSetMeter
from cals_seg.metrics.regions import boundary_bands


class ConformalTestView:
    """The test side of :func:`conformal_evaluation` as one consumer of a test pass:
    ``update(logits, target, image)`` makes the sets of every fitted mode from the (calibrated)
    logits and feeds each mode's :class:`~cals_seg.metrics.conformal.PredictionSetMeter` (and
    writes the set-size maps of the first ``num_maps`` images); :meth:`results` returns
    ``{MODE: fit numbers and measured ones}`` (:func:`conformal_evaluation`).

    Build it with :func:`conformal_sets` (which fits on validation first) and hand it to the
    test pass (:func:`cals_seg.evaluation.engine.calibrated_test`'s ``extra``), so that the
    split is streamed once for the meters and the sets together.
    """

    def __init__(self, fits: dict[str, Any], results: dict[str, Any], calibrator: Any,
                 task: Any, device: Any, ids: list[str] | None, maps_dir: Path | None,
                 num_maps: int) -> None:
        self.fits, self._results, self.calibrator = fits, results, calibrator
        self.meters = {m: PredictionSetMeter(task.num_classes, num_groups=cs.num_groups,
                                             tau=cs.tau, ignore_index=task.ignore_index
                                             ).to(device) for m, cs in fits.items()}
        self.ids, self.maps_dir, self.num_maps = ids, maps_dir, num_maps
        self.seen = 0

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor, image: torch.Tensor) -> None:
        """One batch: logits ``(N, K, H, W)``, target ``(N, H, W)``, image ``(N, 3, H, W)``;
        or a classification batch, logits ``(N, K)`` and target ``(N,)`` (each input a 1 x 1
        image, :func:`~cals_seg.evaluation.conformal.as_spatial`)."""
        out, target = as_spatial(calibrated(self.calibrator, logits, image), target)
        first, self.seen = self.seen, self.seen + len(logits)
        for m, cs in self.fits.items():
            if self.maps_dir is not None and first < self.num_maps:
                sets = cs.sets(out)
                for i in range(min(len(logits), self.num_maps - first)):
                    name = self.ids[first + i] if self.ids is not None else str(first + i)
                    write_size_map(self.maps_dir / f"{name}_set_size_{m.replace(':', '-')}.png",
                                   sets[i], cs.num_classes)
            group = None
            if cs.kind == "class":
                group = target
            elif cs.kind == "band":
                pred = out.argmax(dim=1).cpu().numpy().astype(np.int64)
                group = torch.from_numpy(boundary_bands(pred, cs.bands))
            self.meters[m].update(cs.sets(out), target, group)

    def results(self) -> dict[str, Any]:
        """``{MODE: dict}``: the fit's numbers with the meter's (all-reduced) measurements."""
        for m in self.fits:
            self._results[m].update(self.meters[m].compute())
        return self._results


def conformal_sets(run: Any, spec: dict[str, Any], val_set: Any, test_set: Any,
                   maps_dir: Path | None = None, num_maps: int = 0,
                   folder: Path | None = None, *, loader: Loader | None = None
                   ) -> ConformalTestView:
    """Fit (or reuse) the conformal sets of ``spec`` on ``val_set``
    (:func:`~cals_seg.evaluation.conformal_fit.fit_conformal`, saved in ``folder``, default
    ``<run>/calibrators``; a mode without a guarantee is said on stderr) and return the
    consumer that measures them on ``test_set``'s pass (:class:`ConformalTestView`)."""
    if test_set is val_set:
        print("warning: --conformal on the validation split: its calibration images are among "
              "the evaluated ones, so the numbers are not those of new images.", file=sys.stderr)
    fits, results, calibrator, _ = fit_conformal(run, spec, val_set, folder, loader=loader)
    for m, r in results.items():
        if not r["guarantee"]:
            print(f"warning: --conformal {m}: {r['warning']}", file=sys.stderr, flush=True)
    return ConformalTestView(fits, results, calibrator, run.task, run.device,
                         getattr(test_set, "ids", None), maps_dir, num_maps)


def conformal_evaluation(run: Any, spec: dict[str, Any], val_set: Any, test_set: Any,
                         progress: bool = False,
                         maps_dir: Path | None = None, num_maps: int = 0,
                         folder: Path | None = None, *, loader: Loader | None = None
                         ) -> dict[str, Any]:
    """:func:`~cals_seg.evaluation.conformal_fit.fit_conformal` (fits saved in ``folder``,
    default ``<run>/calibrators``), then the sets of every mode on ``test_set`` measured by
    :class:`~cals_seg.metrics.conformal.PredictionSetMeter` in a pass of their own (inside an
    evaluation that also measures the test meters, hand :func:`conformal_sets`' consumer to
    that pass instead); returns ``{MODE: dict}``: the fit's ``alpha``, ``threshold``,
    ``calibration_images``, ``calibration_ids``, ``guarantee``, ``needs_images`` (``warning``
    when empty, also printed on stderr once), ... and the meter's ``risk``, ``coverage``,
    ``set_size``, ``coverage_band``, ... With ``maps_dir``, the set-size map of each mode for
    the first ``num_maps`` test images: ``maps_dir/<id>_set_size_<mode>.png``
    (:func:`write_size_map`)."""
    from cals_seg.evaluation.stream import run_loader

    loader = loader or run_loader(run)
    sets = conformal_sets(run, spec, val_set, test_set, maps_dir, num_maps, folder,
                          loader=loader)
    for logits, target, image in predict(run.model, loader(test_set), run.device, run.precision,
                                         progress, desc="conformal", protocol=run.task.protocol,
                                         with_inputs=True):
        sets.update(logits, target, image)
    return sets.results()


def _threshold(r: dict[str, Any]) -> str:
    thr = r["threshold"]
    return f"{thr:.4f}" if isinstance(thr, float) else ", ".join(f"{t:.3f}" for t in thr)


def _guarantee(r: dict[str, Any]) -> str:
    if r.get("guarantee", True):
        return "yes"
    group = " per group" if "groups_without_guarantee" in r else ""
    return f"NO: needs {r.get('needs_images')}{group}"


def _lowest(values: list[float | None] | None) -> str:
    kept = [v for v in values or [] if v is not None]
    return _fmt(min(kept) if kept else None)


# A column of a conformal table: its header and its cell, from the mode and its results.
Column = tuple[str, Callable[[str, dict[str, Any]], str]]

SEGMENTATION_COLUMNS: tuple[Column, ...] = (
    ("mode", lambda m, r: m),
    ("alpha", lambda m, r: f"{r['alpha']:g}"),
    ("threshold", lambda m, r: _threshold(r)),
    ("calibration images", lambda m, r: str(r["calibration_images"])),
    ("guarantee", lambda m, r: _guarantee(r)),
    ("risk", lambda m, r: _fmt(r["risk"])),
    ("coverage", lambda m, r: _fmt(r["coverage"])),
    ("set size", lambda m, r: _fmt(r["set_size"])),
    ("more than one class", lambda m, r: _fmt(r["multi"])),
    ("coverage per boundary band",
     lambda m, r: ", ".join("-" if c is None else f"{c:.4f}" for c in r["coverage_band"])),
)
"""eval_seg's columns (``conformal.md`` of a segmentation evaluation)."""

CLASSIFICATION_COLUMNS: tuple[Column, ...] = (
    ("mode", lambda m, r: m),
    ("score", lambda m, r: str(r["score"])),
    ("alpha", lambda m, r: f"{r['alpha']:g}"),
    ("threshold", lambda m, r: _threshold(r)),
    ("calibration inputs", lambda m, r: str(r["calibration_images"])),
    ("guarantee", lambda m, r: _guarantee(r)),
    ("coverage", lambda m, r: _fmt(r["coverage"])),
    ("set size", lambda m, r: _fmt(r["set_size"])),
    ("more than one class", lambda m, r: _fmt(r["multi"])),
    ("empty", lambda m, r: _fmt(r["empty"])),
    ("lowest class coverage", lambda m, r: _lowest(r.get("coverage_class"))),
)
"""eval_cls's columns: no risk and no bands, the empty sets and the lowest class coverage."""


def conformal_table(results: dict[str, Any],
                    columns: tuple[Column, ...] = SEGMENTATION_COLUMNS) -> str:
    """A markdown table of the sets, one row per mode (the entries of ``results`` that are
    dicts, in their order), one column per entry of ``columns`` (:data:`SEGMENTATION_COLUMNS`:
    alpha, threshold, calibration images, guarantee (``yes``, or ``NO: needs N``), risk,
    coverage, set size, ambiguous fraction, coverage per boundary band;
    :data:`CLASSIFICATION_COLUMNS` for eval_cls); under it, the warning of each mode without a
    guarantee."""
    head = ("| " + " | ".join(name for name, _ in columns) + " |\n"
            + "|" + "---|" * len(columns) + "\n")
    rows, notes = [], []
    for mode, r in results.items():
        if not isinstance(r, dict):
            continue
        rows.append("| " + " | ".join(cell(mode, r) for _, cell in columns) + " |")
        if not r.get("guarantee", True) and r.get("warning"):
            notes.append(f"- {mode}: {r['warning']}.")
    text = head + "\n".join(rows) + "\n"
    if notes:
        text += "\nWarning, empty guarantees:\n" + "\n".join(notes) + "\n"
    return text


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def image_sets(run: Any, cs: Any, image: np.ndarray) -> torch.Tensor:
    """Prediction sets ``(1, K, H, W)`` bool of one RGB image ``(H, W, 3)`` uint8 from the
    network's logits at the image's resolution (the evaluation's path)."""
    x = normalise(image, run.protocol).to(run.device)
    logits = segment_logits(run.model, x, run.protocol, run.precision)
    return cs.to(logits.device).sets(logits.float())


def set_summary(cs: Any, sets: torch.Tensor) -> dict[str, Any]:
    """The JSON-line numbers of one image's sets ``(1, K, H, W)`` bool: the fit's alpha, mode,
    score and threshold, the mean set size, the fraction of pixels whose set is not one class,
    and the fit's guarantee (``guarantee``, ``needs_images``, ``warning`` when empty)."""
    size = sets.sum(dim=1).double()
    return {"alpha": cs.alpha, "mode": cs.mode, "score": cs.score,
            "threshold": cs.thresholds(), "mean_set_size": float(size.mean()),
            "ambiguous_fraction": float((size != 1).double().mean()), **cs.guarantee()}


def write_set_outputs(out: Path, name: str, image: np.ndarray, sets: torch.Tensor
                      ) -> dict[str, str]:
    """``<name>_set_size.png`` (classes in each pixel's set, 8-bit, 16-bit above 255
    classes), ``<name>_sets.npz`` (bool ``sets`` ``(K, H, W)``, compressed) and
    ``<name>_ambiguous.png`` (the image with the pixels whose set holds more than one class,
    or none, in magenta). ``sets``: ``(1, K, H, W)`` or ``(K, H, W)`` bool. Returns the three
    paths as strings, keyed ``set_size``, ``sets``, ``ambiguous``."""
    import cv2  # deferred: OpenCV is slow to import and only the pictures need it

    s = sets.reshape(-1, *sets.shape[-2:]).cpu().numpy().astype(bool)
    size = s.sum(axis=0)
    paths = {"set_size": out / f"{name}_set_size.png", "sets": out / f"{name}_sets.npz",
             "ambiguous": out / f"{name}_ambiguous.png"}
    cv2.imwrite(str(paths["set_size"]), size.astype(np.uint8 if s.shape[0] < 256 else np.uint16))
    np.savez_compressed(paths["sets"], sets=s)
    overlay = image.copy()
    mark = size != 1
    overlay[mark] = (0.4 * overlay[mark] + 0.6 * np.array([255, 0, 255])).astype(np.uint8)
    cv2.imwrite(str(paths["ambiguous"]), cv2.cvtColor(overlay, cv2.COLOR_RGB2BGR))
    return {k: str(v) for k, v in paths.items()}


def write_size_map(path: Path, sets: torch.Tensor, num_classes: int) -> None:
    """A colour picture of one image's set sizes ``(K, H, W)`` bool: viridis from 0 classes
    (dark) to ``K`` (bright), each pixel's size scaled by ``255 / K``."""
    import cv2  # deferred: OpenCV is slow to import and only the pictures need it

    size = sets.sum(dim=0).cpu().numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    grey = np.rint(size * (255 / num_classes)).astype(np.uint8)
    cv2.imwrite(str(path), cv2.applyColorMap(grey, cv2.COLORMAP_VIRIDIS))


__all__ = ["CLASSIFICATION_COLUMNS", "SEGMENTATION_COLUMNS", "ConformalTestView",
           "conformal_evaluation", "conformal_sets", "conformal_table",
           "image_sets", "set_summary", "write_set_outputs", "write_size_map"]


def __getattr__(name: str) -> Any:
    if name == "ConformalSets":  # the name this class had, beside evaluation.conformal's own
        warnings.warn("cals_seg.evaluation.conformal_eval.ConformalSets is deprecated: it is "
                      "ConformalTestView (cals_seg.ConformalSets is the sets' fit).",
                      DeprecationWarning, stacklevel=2)
        return ConformalTestView
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
