"""Conformal prediction sets for the commands: ``eval_seg --conformal`` and ``predict_seg
--conformal`` (docs/conformal.md).

The calibration split is the held-out part of validation: image ``j`` of the validation
stream (loader order, counting from 0) when ``j % every == every - 1`` (the rule of the
``lts`` / ``selective`` hold-out, ``every = 5``). A calibrator named by ``calibrator=NAME`` is
fitted here on the *other* validation images (never on the calibration ones) and the
threshold is fitted on its output. The ids of the calibration images are recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cals_seg.errors import MissingPathError, UserError

CONFORMAL_KEYS = ("alpha", "mode", "score", "calibrator", "seed", "every")
CALIBRATOR_NAMES = ("ts", "vector", "dirichlet", "lts", "selective", "boundary_ts", "cms_ap",
                    "cms_op", "boundary_ts_fine", "boundary_ts_conf")


def parse_conformal(items: list[str]) -> dict[str, Any]:
    """``--conformal alpha=0.1 [mode=risk,class] [score=lac|aps] [calibrator=NAME] [seed=0]
    [every=5]`` (a bare number is ``alpha``) -> a spec dict; modes are comma-separated.

    Raises:
        UserError: naming the item and what is allowed.
    """
    from cals_seg.evaluation.conformal import SCORES, parse_mode

    spec: dict[str, Any] = {"mode": ["risk"], "score": "lac", "calibrator": None, "seed": 0,
                            "every": 5}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            key, value = "alpha", item
        if key not in CONFORMAL_KEYS:
            raise UserError(f"--conformal {item!r}: unknown key {key!r}; valid keys are "
                            f"{list(CONFORMAL_KEYS)}, e.g. --conformal alpha=0.1 mode=risk.")
        try:
            if key == "alpha":
                spec["alpha"] = float(value)
                if not 0 < spec["alpha"] < 1:
                    raise ValueError
            elif key == "mode":
                spec["mode"] = value.split(",")
                for m in spec["mode"]:
                    parse_mode(m)
            elif key == "score":
                if value not in SCORES:
                    raise ValueError
                spec["score"] = value
            elif key == "calibrator":
                if value not in CALIBRATOR_NAMES:
                    raise ValueError
                spec["calibrator"] = value
            else:
                spec[key] = int(value)
                if spec[key] < (2 if key == "every" else 0):
                    raise ValueError
        except ValueError:
            allowed = {"alpha": "a number in (0, 1)", "mode": "risk, image:TAU, class or band "
                       "(comma-separated)", "score": f"one of {list(SCORES)}",
                       "calibrator": f"one of {list(CALIBRATOR_NAMES)}",
                       "seed": "an integer >= 0", "every": "an integer >= 2"}[key]
            raise UserError(f"--conformal {item!r}: expected {key} to be {allowed}.") from None
    if "alpha" not in spec:
        raise UserError("--conformal: give alpha, e.g. --conformal alpha=0.1.")
    return spec


def _val_stream(model, val_loader, device, amp, protocol, every: int, held: bool):
    """``(logits, target, image, first index)`` of the held-out (``held``) or the other
    validation images, in loader order."""
    from cals_seg.calibrators._base import holdout_mask
    from cals_seg.evaluation.stream import predict

    seen = 0
    for logits, target, image in predict(model, val_loader, device, amp, protocol=protocol,
                                          with_inputs=True):
        mask = holdout_mask(len(logits), seen, every).to(logits.device)
        first, seen = seen, seen + len(logits)
        keep = mask if held else ~mask
        if bool(keep.any()):
            yield logits[keep], target[keep], image[keep], first + torch.nonzero(keep.cpu())


def _calibrate(calibrator, logits, image):
    if calibrator is None:
        return logits
    with torch.no_grad():
        return calibrator(logits, image if calibrator.needs_image else None)


def fit_conformal(run, spec: dict[str, Any], val_set) -> tuple[dict, dict, Any, list]:
    """Fit one :class:`~cals_seg.evaluation.conformal.ConformalSets` per mode of ``spec`` on
    the held-out validation images (after ``spec["calibrator"]``, fitted here on the other
    validation images); saves each fit on the raw logits to
    ``<run>/calibrators/conformal_<tag>.json``.

    Returns:
        ``({mode: fitted ConformalSets}, {mode: fit dict}, the calibrator or None,
        the calibration ids)``.
    """
    from cals_seg.calibrators import build_calibrator
    from cals_seg.evaluation.conformal import ConformalSets
    from cals_seg.training.engine import make_loader
    from cals_seg.utils.distributed import is_distributed

    if is_distributed():
        raise UserError("--conformal: run it in one process (without torchrun).")
    model, device, amp, protocol = run.model, run.device, run.precision, run.task.protocol
    k, ignore = run.task.num_classes, run.task.ignore_index
    val_loader = make_loader(val_set, run.config.eval.batch_size, False,
                             run.config.data.num_workers)
    calibrator, fit_info = None, None
    if spec["calibrator"]:
        calibrator = build_calibrator(spec["calibrator"], k).to(device)

        def batches():
            for logits, target, image, _ in _val_stream(model, val_loader, device, amp,
                                                        protocol, spec["every"], held=False):
                yield logits, target, image

        fit_info = calibrator.fit(batches, ignore_index=ignore)
        calibrator.eval()
    fits = {m: ConformalSets(k, spec["alpha"], m, spec["score"], spec["seed"],
                             ignore_index=ignore).to(device) for m in spec["mode"]}
    ids: list[Any] = []
    names = getattr(val_set, "ids", None)
    for logits, target, image, index in _val_stream(model, val_loader, device, amp, protocol,
                                                    spec["every"], held=True):
        out = _calibrate(calibrator, logits, image)
        for cs in fits.values():
            cs.update(out, target)
        ids += [names[int(j)] if names is not None else int(j) for j in index.view(-1)]
    rule = (f"every {spec['every']}th validation image in loader order (images "
            f"{spec['every']}, {2 * spec['every']}, ... counting from 1)")
    results = {}
    for m, cs in fits.items():
        results[m] = {**cs.fit(), "seed": spec["seed"], "calibrator": spec["calibrator"],
                      "calibrator_fit": fit_info, "calibration_rule": rule,
                      "calibration_ids": ids}
        if calibrator is None:
            save_conformal(cs, run.checkpoint.resolve().parent / "calibrators"
                           / f"conformal_{conformal_tag(cs)}.json", ids)
    return fits, results, calibrator, ids


def conformal_evaluation(run, spec: dict[str, Any], val_set, test_set, progress: bool = False,
                         maps_dir: Path | None = None, num_maps: int = 0) -> dict[str, Any]:
    """:func:`fit_conformal`, then the sets of every mode on ``test_set`` measured by
    :class:`~cals_seg.metrics.conformal.PredictionSetMeter`; returns ``{MODE: dict}``: the
    fit's ``alpha``, ``threshold``, ``calibration_images``, ``calibration_ids``, ... and the
    meter's ``risk``, ``coverage``, ``set_size``, ``coverage_band``, ... With ``maps_dir``,
    the set-size map of each mode for the first ``num_maps`` test images:
    ``maps_dir/<id>_set_size_<mode>.png`` (:func:`write_size_map`)."""
    from cals_seg.evaluation.stream import predict
    from cals_seg.metrics.conformal import PredictionSetMeter
    from cals_seg.metrics.regions import boundary_bands
    from cals_seg.training.engine import make_loader

    if test_set is val_set:
        import warnings

        warnings.warn("--conformal on the validation split: its calibration images are among "
                      "the evaluated ones, so the numbers are not those of new images.",
                      stacklevel=2)
    fits, results, calibrator, _ = fit_conformal(run, spec, val_set)
    task, device = run.task, run.device
    meters = {m: PredictionSetMeter(task.num_classes, num_groups=cs.num_groups, tau=cs.tau,
                                    ignore_index=task.ignore_index).to(device)
              for m, cs in fits.items()}
    test_loader = make_loader(test_set, run.config.eval.batch_size, False,
                              run.config.data.num_workers)
    ids = getattr(test_set, "ids", None)
    seen = 0
    for logits, target, image in predict(run.model, test_loader, device, run.precision,
                                         progress, desc="conformal", protocol=task.protocol,
                                         with_inputs=True):
        out = _calibrate(calibrator, logits, image)
        first, seen = seen, seen + len(logits)
        for m, cs in fits.items():
            if maps_dir is not None and first < num_maps:
                sets = cs.sets(out)
                for i in range(min(len(logits), num_maps - first)):
                    name = ids[first + i] if ids is not None else str(first + i)
                    write_size_map(maps_dir / f"{name}_set_size_{m.replace(':', '-')}.png",
                                   sets[i], cs.num_classes)
            group = None
            if cs.kind == "class":
                group = target
            elif cs.kind == "band":
                pred = out.argmax(dim=1).cpu().numpy().astype(np.int64)
                group = torch.from_numpy(boundary_bands(pred, cs.bands))
            meters[m].update(cs.sets(out), target, group)
    for m in fits:
        results[m].update(meters[m].compute())
    return results


def conformal_tag(cs) -> str:
    """File tag of a fit: ``<mode>_<score>_a<alpha>`` (``:`` of ``image:TAU`` as ``-``)."""
    return f"{cs.mode.replace(':', '-')}_{cs.score}_a{cs.alpha:g}"


def save_conformal(cs, path: Path, ids: list[Any]) -> None:
    """A fit as JSON: its arguments, the integer threshold indices and the calibration ids."""
    from cals_seg.utils.io import write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"num_classes": cs.num_classes, "alpha": cs.alpha, "mode": cs.mode,
                      "score": cs.score, "seed": cs.seed, "bands": list(cs.bands),
                      "ignore_index": cs.ignore_index, "grid": cs.grid,
                      "threshold_index": cs.threshold_index.tolist(),
                      "threshold": cs.thresholds(),
                      "calibration_images": cs.calibration_images, "calibration_ids": ids})


def load_conformal(path: Path):
    """The fitted :class:`~cals_seg.evaluation.conformal.ConformalSets` saved at ``path``."""
    from cals_seg.evaluation.conformal import ConformalSets

    d = json.loads(Path(path).read_text())
    cs = ConformalSets(d["num_classes"], d["alpha"], d["mode"], d["score"], d["seed"],
                       d["bands"], d["ignore_index"], grid=d["grid"])
    cs.threshold_index.copy_(torch.tensor(d["threshold_index"], dtype=torch.int64))
    cs.calibration_images = d["calibration_images"]
    return cs


def load_or_fit_conformal(run, spec: dict[str, Any]):
    """For predict_seg: the saved fit of ``spec`` (raw logits, one mode), else fitted now on
    the run's held-out validation images (the data must be readable) and saved."""
    from cals_seg.evaluation.conformal import ConformalSets

    if spec["calibrator"] or len(spec["mode"]) != 1:
        raise UserError("predict_seg --conformal: one mode, on the network's logits (no "
                        "calibrator=); e.g. --conformal 0.1 or --conformal alpha=0.1 mode=class.")
    probe = ConformalSets(len(run.class_names), spec["alpha"], spec["mode"][0], spec["score"],
                          spec["seed"])
    path = run.path / "calibrators" / f"conformal_{conformal_tag(probe)}.json"
    if not path.is_file():
        from cals_seg.runs.run import load_run

        try:
            data_run = load_run(run.checkpoint, with_data=True, device=str(run.device),
                                family="segmentation")
        except (UserError, FileNotFoundError) as err:
            raise MissingPathError(f"{path} does not exist and the validation data cannot be "
                                   f"read to fit it ({err}); fit it with tools/eval_seg.py "
                                   f"{run.path} --conformal alpha={spec['alpha']:g}.") from None
        fit_conformal(data_run, spec, data_run.task.val_set)
    return load_conformal(path)


def write_set_outputs(out: Path, name: str, image: np.ndarray, sets: torch.Tensor
                      ) -> dict[str, str]:
    """``<name>_set_size.png`` (classes in each pixel's set, 8-bit, 16-bit above 255
    classes), ``<name>_sets.npz`` (bool ``sets`` ``(K, H, W)``, compressed) and
    ``<name>_ambiguous.png`` (the image with the pixels whose set holds more than one class,
    or none, in magenta). ``sets``: ``(1, K, H, W)`` or ``(K, H, W)`` bool."""
    import cv2

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
    import cv2

    size = sets.sum(dim=0).cpu().numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    grey = np.rint(size * (255 / num_classes)).astype(np.uint8)
    cv2.imwrite(str(path), cv2.applyColorMap(grey, cv2.COLORMAP_VIRIDIS))


def conformal_table(results: dict[str, Any]) -> str:
    """A markdown table: per mode, alpha, threshold, calibration images, risk, coverage, set
    size, ambiguous fraction, coverage per boundary band."""
    head = ("| mode | alpha | threshold | calibration images | risk | coverage | set size | "
            "more than one class | coverage per boundary band |\n|---|---|---|---|---|---|---|"
            "---|---|\n")
    rows = []
    for mode, r in results.items():
        thr = r["threshold"]
        thr = f"{thr:.4f}" if isinstance(thr, float) else ", ".join(f"{t:.3f}" for t in thr)
        bands = ", ".join("-" if c is None else f"{c:.4f}" for c in r["coverage_band"])
        rows.append(f"| {mode} | {r['alpha']:g} | {thr} | {r['calibration_images']} | "
                    f"{_fmt(r['risk'])} | {_fmt(r['coverage'])} | {_fmt(r['set_size'])} | "
                    f"{_fmt(r['multi'])} | {bands} |")
    return head + "\n".join(rows) + "\n"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def image_sets(run, cs, image: np.ndarray) -> torch.Tensor:
    """Prediction sets ``(1, K, H, W)`` bool of one RGB image ``(H, W, 3)`` uint8 from the
    network's logits at the image's resolution (the evaluation's path)."""
    from cals_seg.evaluation.inference import normalise, segment_logits

    x = normalise(image, run.protocol).to(run.device)
    logits = segment_logits(run.model, x, run.protocol, run.precision)
    return cs.to(logits.device).sets(logits.float())


def set_summary(cs, sets: torch.Tensor) -> dict[str, Any]:
    """The JSON-line numbers of one image's sets."""
    size = sets.sum(dim=1).double()
    return {"alpha": cs.alpha, "mode": cs.mode, "score": cs.score,
            "threshold": cs.thresholds(), "mean_set_size": float(size.mean()),
            "ambiguous_fraction": float((size != 1).double().mean())}
