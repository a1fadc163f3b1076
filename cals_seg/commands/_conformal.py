"""Conformal prediction sets for the commands: ``eval_seg --conformal`` and ``predict_seg
--conformal`` (docs/conformal.md).

The calibration split is the held-out part of validation: image ``j`` of the validation
stream (loader order, counting from 0) when ``j % every == every - 1``. ``every=1`` is all of
validation. Unless ``every`` is given, it is the largest of 5, 4, 3, 2 (and 1 without a
calibrator) that leaves the ``ceil(1 / alpha) - 1`` calibration images a guarantee needs
(:func:`~cals_seg.evaluation.conformal.guarantee_images`), else the smallest (the most
images); the choice is printed. A calibrator named by ``calibrator=NAME`` is fitted here on the
*other* validation images (never on the calibration ones) and the threshold is fitted on its
output. The ids of the calibration images are recorded.

Every saved fit records what it was fitted for (:mod:`cals_seg.utils.fits`): the network by
content, the classes, the split and the calibration ids, the score, alpha, mode, seed, every,
the calibrator before it, the grid and the evaluation protocol. ``predict_seg`` / ``export``
use a saved fit only when the record matches; otherwise they refit it (validation readable) or
refuse in one line. Every file read back is validated (:func:`read_conformal`).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cals_seg.errors import MissingPathError, UserError

CONFORMAL_KEYS = ("alpha", "mode", "score", "calibrator", "seed", "every")
CALIBRATOR_NAMES = ("ts", "vector", "dirichlet", "lts", "selective", "boundary_ts", "cms_ap",
                    "cms_op", "boundary_ts_fine", "boundary_ts_conf", "image_ts")
DEFAULT_EVERY = 5  # the lts / selective hold-out, kept when validation allows it
MAX_GRID = 2**20  # a saved grid above it is refused (the state is 8 (grid + 2) bytes per group)


def _ascii_int(value: str) -> int:
    """An integer written with the ASCII digits only (``int`` also reads ``"²"``-like digits
    of other scripts, and spaces)."""
    if not (value.isascii() and value.isdigit()):
        raise ValueError(value)
    return int(value)


def parse_conformal(items: list[str]) -> dict[str, Any]:
    """``--conformal alpha=0.1 [mode=risk,class] [score=lac|aps] [calibrator=NAME] [seed=0]
    [every=N]`` (a bare number is ``alpha``) -> a spec dict; modes are comma-separated;
    ``every`` None when not given (chosen by :func:`choose_every`).

    Raises:
        UserError: naming the item and what is allowed.
    """
    from cals_seg.evaluation.conformal import SCORES, parse_mode

    spec: dict[str, Any] = {"mode": ["risk"], "score": "lac", "calibrator": None, "seed": 0,
                            "every": None}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            key, value = "alpha", item
        if key not in CONFORMAL_KEYS:
            raise UserError(f"--conformal {item!r}: unknown key {key!r}; valid keys are "
                            f"{list(CONFORMAL_KEYS)}, e.g. --conformal alpha=0.1 mode=risk.")
        try:
            if key == "alpha":
                if not value.isascii() or value != value.strip():
                    raise ValueError(value)
                spec["alpha"] = float(value)
                if not 0 < spec["alpha"] < 1:
                    raise ValueError(value)
            elif key == "mode":
                spec["mode"] = list(dict.fromkeys(value.split(",")))
                for m in spec["mode"]:
                    if not m.isascii():
                        raise ValueError(m)
                    parse_mode(m)
            elif key == "score":
                if value not in SCORES:
                    raise ValueError(value)
                spec["score"] = value
            elif key == "calibrator":
                if value not in CALIBRATOR_NAMES:
                    raise ValueError(value)
                spec["calibrator"] = value
            else:
                spec[key] = _ascii_int(value)
                if spec[key] < (1 if key == "every" else 0):
                    raise ValueError(value)
        except ValueError:
            allowed = {"alpha": "a number in (0, 1)", "mode": "risk, image:TAU, class or band "
                       "(comma-separated)", "score": f"one of {list(SCORES)}",
                       "calibrator": f"one of {list(CALIBRATOR_NAMES)}",
                       "seed": "an integer >= 0 (ASCII digits)",
                       "every": "an integer >= 1 (ASCII digits; 1: all validation images)"}[key]
            raise UserError(f"--conformal {item!r}: expected {key} to be {allowed}.") from None
    if "alpha" not in spec:
        raise UserError("--conformal: give alpha, e.g. --conformal alpha=0.1.")
    if spec["calibrator"] and spec["every"] == 1:
        raise UserError(f"--conformal calibrator={spec['calibrator']} every=1: the calibrator "
                        "is fitted on the validation images outside the calibration ones, and "
                        "every=1 leaves none; give every >= 2, or leave calibrator= out.")
    return spec


def spec_text(spec: dict[str, Any], mode: str | None = None) -> str:
    """The ``--conformal`` arguments of ``spec`` (one mode when given)."""
    parts = [f"alpha={spec['alpha']:g}", f"mode={mode or ','.join(spec['mode'])}",
             f"score={spec['score']}", f"seed={spec['seed']}"]
    if spec.get("calibrator"):
        parts.append(f"calibrator={spec['calibrator']}")
    if spec.get("every") is not None:
        parts.append(f"every={spec['every']}")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------
# Which validation images calibrate, and what a fit is for.
# --------------------------------------------------------------------------------------------


def choose_every(spec: dict[str, Any], num_val: int) -> tuple[int, str | None]:
    """``every`` for ``num_val`` validation images: the one given, else the largest of
    ``5, 4, 3, 2`` (and ``1`` without a calibrator) whose ``num_val // every`` calibration
    images reach :func:`~cals_seg.evaluation.conformal.guarantee_images` of alpha, else the
    smallest allowed (the most images). Returns ``(every, a line saying what was chosen)``,
    the line None when nothing was chosen for the user."""
    from cals_seg.evaluation.conformal import guarantee_images

    if spec.get("every") is not None:
        return int(spec["every"]), None
    need = guarantee_images(spec["alpha"])
    lowest = 2 if spec.get("calibrator") else 1
    candidates = range(DEFAULT_EVERY, lowest - 1, -1)
    every = next((e for e in candidates if num_val // e >= need), lowest)
    if every == DEFAULT_EVERY:
        return every, None
    enough = num_val // every >= need
    return every, (f"conformal: every={every}: {num_val // every} of {num_val} validation images "
                   f"calibrate (alpha={spec['alpha']:g} needs {need}"
                   f"{'' if enough else ', more than validation holds'}; every=N to choose)")


def calibration_ids(val_set: Any, every: int) -> list[Any]:
    """Ids of the calibration images of ``val_set`` (``ids``, else positions), loader order."""
    names = getattr(val_set, "ids", None)
    return [names[j] if names is not None else j for j in range(len(val_set))
            if j % every == every - 1]


def network_digest(run: Any) -> str:
    """The network by content: its checkpoint's digest, or the members' for an ensemble
    (:func:`~cals_seg.utils.fits.members_digest`)."""
    from cals_seg.utils.fits import file_digest, members_digest

    members = (run.extra or {}).get("ensemble", {}).get("members")
    return members_digest(members) if members else file_digest(run.checkpoint)


def protocol_record(protocol: Any) -> dict[str, Any]:
    """The parts of the evaluation protocol that change the logits."""
    if protocol is None:
        return {}
    out = {"mode": protocol.mode, "resize": protocol.resize, "pad": protocol.pad,
           "mean": list(protocol.mean), "std": list(protocol.std)}
    if protocol.mode == "slide":
        out.update(window=protocol.window, stride=protocol.stride)
    return out


def module_digest(module: Any) -> str | None:
    """SHA-256 (32 hex) of a fitted module's state (names, shapes, bytes); None for None."""
    if module is None:
        return None
    h = hashlib.sha256()
    for name, value in sorted(module.state_dict().items()):
        t = value.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    return h.hexdigest()[:32]


def fit_record(run: Any, spec: dict[str, Any], mode: str, every: int, ids: list[Any] | None,
               calibrator: Any = None) -> dict[str, Any]:
    """What a fit of ``mode`` is for (``fitted_for``): network, classes, split and calibration
    ids (``ids`` None: left out, for a use that cannot read validation), score, alpha, mode,
    seed, every, the calibrator before it (name and state digest), grid and protocol."""
    from cals_seg.evaluation.conformal import GRID
    from cals_seg.utils.fits import ids_digest, plain_record

    protocol = getattr(run.task, "protocol", None) if run.task is not None else None
    record = {"network": network_digest(run), "num_classes": len(run.class_names),
              "split": "val", "score": spec["score"], "alpha": float(spec["alpha"]),
              "mode": mode, "seed": int(spec["seed"]), "every": int(every),
              "calibrator": spec.get("calibrator"),
              "calibrator_state": module_digest(calibrator), "grid": GRID,
              "protocol": protocol_record(protocol or run.protocol)}
    if ids is not None:
        record["ids"] = ids_digest(ids)
    return plain_record(record)


def fits_folder(run: Any, folder: Path | None = None) -> Path:
    """Where a run's fits live: ``folder`` (an ensemble's, in its --out), else
    ``<run>/calibrators``."""
    return Path(folder) if folder is not None else \
        run.checkpoint.resolve().parent / "calibrators"


def conformal_file(folder: Path, mode: str, score: str, alpha: float, seed: int) -> Path:
    """``folder/conformal_<mode>_<score>_a<alpha>_s<seed>.json`` (``:`` of ``image:TAU`` as
    ``-``)."""
    return Path(folder) / f"conformal_{mode.replace(':', '-')}_{score}_a{alpha:g}_s{seed}.json"


def conformal_tag(cs: Any) -> str:
    """File tag of a fit: ``<mode>_<score>_a<alpha>_s<seed>``."""
    return conformal_file(Path("."), cs.mode, cs.score, cs.alpha, cs.seed).stem[len("conformal_"):]


# --------------------------------------------------------------------------------------------
# Fitting.
# --------------------------------------------------------------------------------------------


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


def _fit_calibrator(run, spec: dict[str, Any], val_loader, every: int, others: int):
    """The calibrator of ``spec`` fitted on the ``others`` validation images outside the
    calibration ones; one line when it cannot be."""
    from cals_seg.calibrators import build_calibrator

    name, k = spec["calibrator"], run.task.num_classes
    fix = (f"give more validation images, a larger every (now {every}), or leave "
           f"calibrator={name} out")
    if others == 0:
        raise UserError(f"--conformal calibrator={name}: no validation image is left outside "
                        f"the calibration ones to fit it on; {fix}.")
    calibrator = build_calibrator(name, k).to(run.device)

    def batches():
        for logits, target, image, _ in _val_stream(run.model, val_loader, run.device,
                                                    run.precision, run.task.protocol, every,
                                                    held=False):
            yield logits, target, image

    try:
        fit_info = calibrator.fit(batches, ignore_index=run.task.ignore_index)
    except (ValueError, RuntimeError, IndexError, ZeroDivisionError) as err:
        reason = " ".join(str(err).split())[:160] or type(err).__name__
        raise UserError(f"--conformal calibrator={name}: cannot be fitted on the {others} "
                        f"validation image(s) outside the calibration ones ({reason}); "
                        f"{fix}.") from None
    calibrator.eval()
    return calibrator, fit_info


def _with_every_fix(result: dict[str, Any], spec: dict[str, Any], every: int,
                    num_val: int) -> dict[str, Any]:
    """The guarantee warning with the fixes ``every`` allows."""
    if result.get("guarantee", True) or "warning" not in result:
        return result
    if every > 1 and not spec.get("calibrator"):
        result["warning"] += f", or every=1 (all {num_val} validation images; now every={every})"
    elif spec.get("calibrator"):
        result["warning"] += (f", or leave calibrator={spec['calibrator']} out (every=1 then "
                              f"calibrates on all {num_val} validation images)")
    return result


def fit_conformal(run: Any, spec: dict[str, Any], val_set: Any, folder: Path | None = None,
                  quiet: bool = False) -> tuple[dict, dict, Any, list]:
    """Fit one :class:`~cals_seg.evaluation.conformal.ConformalSets` per mode of ``spec`` on
    the held-out validation images (after ``spec["calibrator"]``, fitted here on the other
    validation images); saves each fit on the raw logits, with its record, to
    :func:`conformal_file` in ``folder`` (default ``<run>/calibrators``; an ensemble's
    folder is in its --out).

    Returns:
        ``({mode: fitted ConformalSets}, {mode: fit dict}, the calibrator or None,
        the calibration ids)``; each fit dict holds ``guarantee``, ``needs_images``,
        ``fitted_for`` and, when the guarantee is empty, a one-line ``warning``.
    """
    from cals_seg.evaluation.conformal import ConformalSets
    from cals_seg.training.engine import make_loader
    from cals_seg.utils.distributed import is_distributed

    if is_distributed():
        raise UserError("--conformal: run it in one process (without torchrun).")
    num_val = len(val_set)
    every, chosen = choose_every(spec, num_val)
    if chosen and not quiet:
        print(chosen, flush=True)
    k, ignore = run.task.num_classes, run.task.ignore_index
    val_loader = make_loader(val_set, run.config.eval.batch_size, False,
                             run.config.data.num_workers)
    want_ids = calibration_ids(val_set, every)
    calibrator, fit_info = None, None
    if spec["calibrator"]:
        calibrator, fit_info = _fit_calibrator(run, spec, val_loader, every,
                                               num_val - len(want_ids))
    fits = {m: ConformalSets(k, spec["alpha"], m, spec["score"], spec["seed"],
                             ignore_index=ignore).to(run.device) for m in spec["mode"]}
    ids: list[Any] = []
    names = getattr(val_set, "ids", None)
    for logits, target, image, index in _val_stream(run.model, val_loader, run.device,
                                                    run.precision, run.task.protocol, every,
                                                    held=True):
        out = _calibrate(calibrator, logits, image)
        for cs in fits.values():
            cs.update(out, target)
        ids += [names[int(j)] if names is not None else int(j) for j in index.view(-1)]
    rule = (f"every {every}th validation image in loader order (images {every}, {2 * every}, "
            "... counting from 1)" if every > 1 else "every validation image")
    results = {}
    for m, cs in fits.items():
        record = fit_record(run, spec, m, every, ids, calibrator)
        results[m] = _with_every_fix(
            {**cs.fit(), "seed": spec["seed"], "every": every, "calibrator": spec["calibrator"],
             "calibrator_fit": fit_info, "calibration_rule": rule, "calibration_ids": ids,
             "fitted_for": record}, spec, every, num_val)
        if calibrator is None:
            save_conformal(cs, conformal_file(fits_folder(run, folder), m, cs.score, cs.alpha,
                                              cs.seed), ids, record, results[m].get("warning"))
    return fits, results, calibrator, ids


def conformal_evaluation(run: Any, spec: dict[str, Any], val_set: Any, test_set: Any,
                         progress: bool = False,
                         maps_dir: Path | None = None, num_maps: int = 0,
                         folder: Path | None = None) -> dict[str, Any]:
    """:func:`fit_conformal` (fits saved in ``folder``, default ``<run>/calibrators``), then
    the sets of every mode on ``test_set`` measured by
    :class:`~cals_seg.metrics.conformal.PredictionSetMeter`; returns ``{MODE: dict}``: the
    fit's ``alpha``, ``threshold``, ``calibration_images``, ``calibration_ids``,
    ``guarantee``, ``needs_images`` (``warning`` when empty, also printed on stderr once),
    ... and the meter's ``risk``, ``coverage``, ``set_size``, ``coverage_band``, ... With
    ``maps_dir``, the set-size map of each mode for the first ``num_maps`` test images:
    ``maps_dir/<id>_set_size_<mode>.png`` (:func:`write_size_map`)."""
    from cals_seg.evaluation.stream import predict
    from cals_seg.metrics.conformal import PredictionSetMeter
    from cals_seg.metrics.regions import boundary_bands
    from cals_seg.training.engine import make_loader

    if test_set is val_set:
        print("warning: --conformal on the validation split: its calibration images are among "
              "the evaluated ones, so the numbers are not those of new images.", file=sys.stderr)
    fits, results, calibrator, _ = fit_conformal(run, spec, val_set, folder)
    for m, r in results.items():
        if not r["guarantee"]:
            print(f"warning: --conformal {m}: {r['warning']}", file=sys.stderr, flush=True)
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


# --------------------------------------------------------------------------------------------
# Saved fits: written with their record, read back validated.
# --------------------------------------------------------------------------------------------


def save_conformal(cs: Any, path: Path, ids: list[Any], record: dict[str, Any] | None = None,
                   warning: str | None = None) -> None:
    """A fit as JSON: its arguments, the integer threshold indices, the calibration counts
    and ids, the guarantee and what it was fitted for (``fitted_for``)."""
    from cals_seg.utils.io import write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    guarantee = cs.guarantee()
    if warning is not None:
        guarantee["warning"] = warning
    write_json(path, {"num_classes": cs.num_classes, "alpha": cs.alpha, "mode": cs.mode,
                      "score": cs.score, "seed": cs.seed, "bands": list(cs.bands),
                      "ignore_index": cs.ignore_index, "grid": cs.grid,
                      "threshold_index": cs.threshold_index.tolist(),
                      "threshold": cs.thresholds(),
                      "calibration_images": cs.calibration_images,
                      "calibration_images_group": cs.calibration_images_group,
                      "calibration_ids": ids, **guarantee, "fitted_for": record or {}})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, int | float) and not isinstance(x, bool)
            and math.isfinite(float(x)))


def read_conformal(path: Path, num_classes: int | None = None, fix: str | None = None
                   ) -> dict[str, Any]:
    """The fit saved at ``path``, validated like a config: a JSON object with every key of
    :func:`save_conformal` of the right type, ``alpha`` in (0, 1), ``grid`` a power of two in
    ``[2, 2^20]``, ``threshold_index`` one integer in ``[0, grid]`` per group, counts
    ``>= 0``, finite numbers, and ``num_classes`` equal to the run's (when given).

    Raises:
        UserError: one line naming the file, what is wrong and ``fix`` (how to refit it).
    """
    from cals_seg.evaluation.conformal import SCORES, parse_mode

    path = Path(path)
    fix = fix or "refit it with tools/eval_seg.py RUN --conformal ..."

    def bad(what: str) -> UserError:
        return UserError(f"{path}: {what}; {fix}.")

    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise bad(f"cannot be read ({err.strerror or type(err).__name__})") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise bad(f"is not valid JSON (truncated or edited? {' '.join(str(err).split())[:80]})"
                  ) from None
    if not isinstance(d, dict):
        raise bad(f"holds a {type(d).__name__}, not a saved conformal fit")
    checks = {
        "num_classes": (lambda v: _is_int(v) and v >= 2, "an integer >= 2"),
        "alpha": (lambda v: _is_number(v) and 0 < v < 1, "a number in (0, 1)"),
        "mode": (lambda v: isinstance(v, str), "risk, image:TAU, class or band"),
        "score": (lambda v: v in SCORES, f"one of {list(SCORES)}"),
        "seed": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        "bands": (lambda v: isinstance(v, list) and all(_is_number(b) and b > 0 for b in v)
                  and v == sorted(set(v)), "increasing positive numbers"),
        "ignore_index": (_is_int, "an integer"),
        "grid": (lambda v: _is_int(v) and 2 <= v <= MAX_GRID and v & (v - 1) == 0,
                 f"a power of two in [2, {MAX_GRID}]"),
        "threshold_index": (lambda v: isinstance(v, list) and all(_is_int(i) for i in v),
                            "a list of integers"),
        "calibration_images": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        "calibration_images_group": (lambda v: isinstance(v, list)
                                     and all(_is_int(c) and c >= 0 for c in v),
                                     "a list of integers >= 0"),
        "calibration_ids": (lambda v: isinstance(v, list), "a list"),
        "fitted_for": (lambda v: isinstance(v, dict), "an object"),
    }
    for key, (ok, allowed) in checks.items():
        if key not in d:
            raise bad(f"has no {key!r} (not a complete conformal fit)")
        if not ok(d[key]):
            raise bad(f"{key}: expected {allowed}, got {json.dumps(d[key])[:40]}")
    try:
        kind, _ = parse_mode(d["mode"])
    except ValueError:
        raise bad(f"mode: expected risk, image:TAU, class or band, got {d['mode']!r}") from None
    groups = {"risk": 1, "image": 1, "class": d["num_classes"], "band": len(d["bands"]) + 1}
    g = groups[kind]
    if len(d["threshold_index"]) != g or len(d["calibration_images_group"]) != g:
        raise bad(f"threshold_index / calibration_images_group: expected {g} entries for mode "
                  f"{d['mode']!r} with {d['num_classes']} classes, got "
                  f"{len(d['threshold_index'])} / {len(d['calibration_images_group'])}")
    outside = [i for i in d["threshold_index"] if not 0 <= i <= d["grid"]]
    if outside:
        raise bad(f"threshold_index: expected integers in [0, grid = {d['grid']}], got "
                  f"{outside[0]}")
    if num_classes is not None and d["num_classes"] != num_classes:
        raise bad(f"is a fit for {d['num_classes']} classes, the run has {num_classes}")
    return d


def load_conformal(path: Path, num_classes: int | None = None, fix: str | None = None) -> Any:
    """The fitted :class:`~cals_seg.evaluation.conformal.ConformalSets` saved at ``path``
    (read by :func:`read_conformal`: validated, one line when not), with ``fitted_for`` (its
    record) as an attribute."""
    from cals_seg.evaluation.conformal import ConformalSets

    d = read_conformal(path, num_classes, fix)
    cs = ConformalSets(d["num_classes"], d["alpha"], d["mode"], d["score"], d["seed"],
                       d["bands"], d["ignore_index"], grid=d["grid"])
    cs.threshold_index.copy_(torch.tensor(d["threshold_index"], dtype=torch.int64))
    cs.calibration_images = d["calibration_images"]
    cs.calibration_images_group = list(d["calibration_images_group"])
    cs.fitted_for = d["fitted_for"]
    return cs


def validation_split(run: Any) -> tuple[Any, str | None]:
    """The run's validation split read without the model (nothing generated or downloaded):
    ``(split, None)``, or ``(None, why it cannot be read)``."""
    from cals_seg.tasks.segmentation import segmentation_splits

    root = Path(run.config.data.root)
    if not root.is_dir():
        return None, f"data.root {root} does not exist"
    try:
        return segmentation_splits(run.config)["val"], None
    except (OSError, UserError, ValueError) as err:
        return None, str(err).splitlines()[0] if str(err) else type(err).__name__


def load_or_fit_conformal(run: Any, spec: dict[str, Any]) -> Any:
    """For predict_seg / export: the saved fit of ``spec`` (raw logits, one mode) when its
    record is this use's (:func:`~cals_seg.utils.fits.fit_mismatch`), else fitted now on the
    run's held-out validation images and saved; refused in one line naming the file and the
    key that differs when the validation data cannot be read. An empty guarantee is said on
    stderr in one line.

    Raises:
        UserError / MissingPathError: one line naming the file and the fix.
    """
    from cals_seg.utils.fits import fit_mismatch

    if spec["calibrator"] or len(spec["mode"]) != 1:
        raise UserError("predict_seg --conformal: one mode, on the network's logits (no "
                        "calibrator=); e.g. --conformal 0.1 or --conformal alpha=0.1 mode=class.")
    mode, k = spec["mode"][0], len(run.class_names)
    path = conformal_file(fits_folder(run), mode, spec["score"], spec["alpha"], spec["seed"])
    refit = f"tools/eval_seg.py {run.path} --conformal {spec_text(spec)}"
    val, unreadable = validation_split(run)  # without the model; nothing generated
    cs, reason = None, None
    if path.is_file():
        cs = load_conformal(path, k, f"refit it with {refit}")
        if val is not None:
            every, _ = choose_every(spec, len(val))
            wanted = fit_record(run, spec, mode, every, calibration_ids(val, every))
        else:  # what cannot be checked without the validation data: ids, and every if chosen
            saved = cs.fitted_for
            every = spec["every"] if spec["every"] is not None else saved.get("every")
            wanted = fit_record(run, spec, mode, every if _is_int(every) else -1, None)
            if "ids" in saved:
                wanted["ids"] = saved["ids"]
        reason = fit_mismatch(cs.fitted_for, wanted)
        if reason is not None:
            cs = None
    if cs is None:
        from cals_seg.runs.run import load_run

        try:  # the run's data (an embedded synthetic set is generated on first use)
            data_run = load_run(run.checkpoint, with_data=True, device=str(run.device),
                                family="segmentation")
        except (UserError, FileNotFoundError) as err:
            why = unreadable or str(err).splitlines()[0]
            if reason is not None:
                raise UserError(f"{path}: {reason}, and the validation data cannot be read to "
                                f"refit it ({why}); refit it with {refit}.") from None
            raise MissingPathError(f"{path} does not exist and the validation data cannot be "
                                   f"read to fit it ({why}); fit it with {refit}.") from None
        if reason is not None:
            print(f"conformal: {path.name}: {reason}; refitting it on the validation images.",
                  flush=True)
        fit_conformal(data_run, spec, data_run.task.val_set)
        cs = load_conformal(path, k, f"refit it with {refit}")
    status = cs.guarantee()
    if not status["guarantee"]:
        print(f"warning: {path}: {status['warning']}", file=sys.stderr, flush=True)
    return cs


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
    """A markdown table: per mode, alpha, threshold, calibration images, guarantee (``yes``,
    or ``NO: needs N``), risk, coverage, set size, ambiguous fraction, coverage per boundary
    band; under it, the warning of each mode without a guarantee."""
    head = ("| mode | alpha | threshold | calibration images | guarantee | risk | coverage | "
            "set size | more than one class | coverage per boundary band |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    rows, notes = [], []
    for mode, r in results.items():
        thr = r["threshold"]
        thr = f"{thr:.4f}" if isinstance(thr, float) else ", ".join(f"{t:.3f}" for t in thr)
        bands = ", ".join("-" if c is None else f"{c:.4f}" for c in r["coverage_band"])
        ok = r.get("guarantee", True)
        need = r.get("needs_images")
        cell = "yes" if ok else f"NO: needs {need}" + (" per group" if
                                                       "groups_without_guarantee" in r else "")
        rows.append(f"| {mode} | {r['alpha']:g} | {thr} | {r['calibration_images']} | {cell} | "
                    f"{_fmt(r['risk'])} | {_fmt(r['coverage'])} | {_fmt(r['set_size'])} | "
                    f"{_fmt(r['multi'])} | {bands} |")
        if not ok and r.get("warning"):
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
    from cals_seg.evaluation.inference import normalise, segment_logits

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
