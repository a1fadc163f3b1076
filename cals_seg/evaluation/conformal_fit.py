"""A run's conformal fits: which validation images calibrate, the fit, what it is for, and the
saved file, written with its record and read back validated (docs/conformal.md).

The calibration split is the held-out part of validation: image ``j`` of the validation
stream (loader order, counting from 0) when ``j % every == every - 1``. ``every=1`` is all of
validation. Unless ``every`` is given: without a calibrator before the sets nothing else is
fitted on validation, so every validation image calibrates (``every=1``); with one, it is the
largest of 5, 4, 3, 2 that leaves the ``ceil(1 / alpha) - 1`` calibration images a guarantee
needs (:func:`~cals_seg.evaluation.conformal.guarantee_images`), else 2 (the most images); the
choice is printed. A calibrator named by ``calibrator=NAME`` is fitted here on the
*other* validation images (never on the calibration ones) and the threshold is fitted on its
output. The ids of the calibration images are recorded.

Every saved fit records what it was fitted for (:mod:`cals_seg.utils.fits`): the network by
content, the classes, the split and the calibration ids, the score, alpha, mode, seed, every,
the calibrator before it, the grid and the evaluation protocol. A saved fit is used only when
its key (:func:`conformal_key`, a :class:`~cals_seg.utils.fits.FitKey`) is the use's
(:func:`saved_fit_mismatch`); every file read back is validated
(:func:`read_conformal`).

A ``spec`` is the dictionary of ``--conformal`` (``alpha``, ``mode`` a list, ``score``,
``calibrator``, ``seed``, ``every`` or None); a ``run`` has ``model``, ``task``, ``device``,
``precision``, ``config``, ``checkpoint``, ``class_names``, ``protocol`` and ``extra``
(a loaded :class:`cals_seg.runs.run.Run`); ``loader`` makes the evaluation loader of a dataset
(in order, e.g. ``lambda ds: make_loader(ds, batch_size, False, workers)``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from cals_seg.calibrators import CALIBRATORS, build_calibrator, network_digest
from cals_seg.errors import UserError
from cals_seg.evaluation.conformal import GRID, ConformalSets, guarantee_images, parse_mode
from cals_seg.evaluation.conformal_score import SCORES
from cals_seg.evaluation.fit_records import is_int, is_number, read_checked_json
from cals_seg.evaluation.stream import predict
from cals_seg.utils.distributed import is_distributed
from cals_seg.utils.fits import FitKey, FitStore, ids_digest, protocol_record
from cals_seg.utils.io import write_json

DEFAULT_EVERY = 5  # the lts / selective hold-out, kept when validation allows it
MAX_GRID = 2**20  # a saved grid above it is refused (the state is 8 (grid + 2) bytes per group)

# A dataset -> its evaluation loader (loader order, no shuffling).
Loader = Callable[[Any], Iterable]

# --------------------------------------------------------------------------------------------
# The spec: the words of ``--conformal`` (and of ``eval.conformal``).
# --------------------------------------------------------------------------------------------

CONFORMAL_KEYS = ("alpha", "mode", "score", "calibrator", "seed", "every")


def _ascii_int(value: str) -> int:
    """An integer written with the ASCII digits only (``int`` also reads ``"²"``-like digits
    of other scripts, and spaces)."""
    if not (value.isascii() and value.isdigit()):
        raise ValueError(value)
    return int(value)


def parse_conformal(items: list[str], flag: str = "--conformal") -> dict[str, Any]:
    """``--conformal alpha=0.1 [mode=risk,class] [score=NAME] [calibrator=NAME] [seed=0]
    [every=N]`` (a bare number is ``alpha``; ``score`` one of
    :data:`~cals_seg.evaluation.conformal_score.SCORES`, ``lac`` by default) -> a spec dict;
    modes are comma-separated; ``every`` None when not given (chosen by :func:`choose_every`).

    Args:
        flag: what the words were given as, for the messages (``--conformal``,
            ``eval.conformal``).

    Raises:
        UserError: naming the item and what is allowed.
    """
    spec: dict[str, Any] = {"mode": ["risk"], "score": "lac", "calibrator": None, "seed": 0,
                            "every": None}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            key, value = "alpha", item
        if key not in CONFORMAL_KEYS:
            raise UserError(f"{flag} {item!r}: unknown key {key!r}; valid keys are "
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
                if value not in CALIBRATORS:
                    raise ValueError(value)
                spec["calibrator"] = value
            else:
                spec[key] = _ascii_int(value)
                if spec[key] < (1 if key == "every" else 0):
                    raise ValueError(value)
        except ValueError:
            allowed = {"alpha": "a number in (0, 1)", "mode": "risk, image:TAU, class or band "
                       "(comma-separated)", "score": f"one of {list(SCORES)}",
                       "calibrator": f"one of {list(CALIBRATORS)}",
                       "seed": "an integer >= 0 (ASCII digits)",
                       "every": "an integer >= 1 (ASCII digits; 1: all validation images)"}[key]
            raise UserError(f"{flag} {item!r}: expected {key} to be {allowed}.") from None
    if "alpha" not in spec:
        raise UserError(f"{flag}: give alpha, e.g. {flag} alpha=0.1.")
    if spec["calibrator"] and spec["every"] == 1:
        raise UserError(f"{flag} calibrator={spec['calibrator']} every=1: the calibrator "
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
    """``every`` for ``num_val`` validation images: the one given; without a calibrator 1
    (every validation image calibrates: nothing else is fitted on them); with one, the
    largest of ``5, 4, 3, 2`` whose ``num_val // every`` calibration images reach
    :func:`~cals_seg.evaluation.conformal.guarantee_images` of alpha, else 2 (the most
    images). Returns ``(every, a line saying what was chosen)``, the line None when nothing
    was chosen for the user."""
    if spec.get("every") is not None:
        return int(spec["every"]), None
    if not spec.get("calibrator"):
        return 1, None
    need = guarantee_images(spec["alpha"])
    every = next((e for e in range(DEFAULT_EVERY, 1, -1) if num_val // e >= need), 2)
    if every == DEFAULT_EVERY:
        return every, None
    enough = num_val // every >= need
    return every, (f"conformal: every={every}: {num_val // every} of {num_val} validation images "
                   f"calibrate (alpha={spec['alpha']:g} needs {need}"
                   f"{'' if enough else ', more than validation holds'}; every=N to choose)")


def calibration_mask(n: int, first: int, every: int) -> Tensor:
    """Which of ``n`` consecutive validation images calibrate, the first at position ``first``
    of the stream (loader order, from 0): position ``j`` when ``j % every == every - 1``.

    Shape:
        returns ``(n,)`` bool.
    """
    j = torch.arange(first, first + n)
    return j % every == every - 1


def calibration_ids(val_set: Any, every: int) -> list[Any]:
    """Ids of the calibration images of ``val_set`` (``ids``, else positions), loader order."""
    names = getattr(val_set, "ids", None)
    held = torch.nonzero(calibration_mask(len(val_set), 0, every)).view(-1).tolist()
    return [names[j] if names is not None else j for j in held]


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


def conformal_key(run: Any, spec: dict[str, Any], mode: str, every: int,
                  ids: list[Any] | None, calibrator: Any = None) -> FitKey:
    """What a fit of ``mode`` is for: network, classes, split and calibration ids (``ids``
    None: unknown, for a use that cannot read validation), ``params`` (score, alpha, every,
    grid), seed, ``after`` the calibrator before it (name and state
    digest), and the protocol of the forward pass."""
    protocol = getattr(run.task, "protocol", None) if run.task is not None else None
    names = list(run.class_names)
    params = {"score": spec["score"], "alpha": float(spec["alpha"]), "every": int(every),
              "grid": GRID}
    return FitKey(
        "conformal", mode, network_digest(run), {"num_classes": len(names), "names": names},
        split="val", ids=ids_digest(ids) if ids is not None else None, params=params,
        precision=run.precision, protocol=protocol_record(protocol or run.protocol),
        seed=int(spec["seed"]),
        after={"calibrator": spec.get("calibrator"), "state": module_digest(calibrator)},
        unknown=("ids",) if ids is None else ())


def saved_fit_mismatch(run: Any, spec: dict[str, Any], mode: str, cs: ConformalSets,
                       val_set: Any | None) -> str | None:
    """Why the saved fit ``cs`` (:func:`load_conformal`) is not for this use of ``spec`` in
    ``mode``; None when it is. Without the validation split (``val_set`` None) what cannot be
    checked is taken as saved: the calibration ids, and ``every`` when it was chosen (it
    depends on the split's size)."""
    if val_set is not None:
        every, _ = choose_every(spec, len(val_set))
        return conformal_key(run, spec, mode, every,
                             calibration_ids(val_set, every)).mismatch(cs.fitted_for)
    saved = cs.fitted_for.get("params") if isinstance(cs.fitted_for, dict) else None
    every = spec["every"] if spec["every"] is not None else (saved or {}).get("every")
    return conformal_key(run, spec, mode, every if is_int(every) else -1,
                         None).mismatch(cs.fitted_for)


def fits_folder(run: Any, folder: Path | None = None) -> FitStore:
    """Where a run's fits live: ``folder`` (an ensemble's, in its --out), else the run's own
    store (``<run>/calibrators``)."""
    return FitStore(folder) if folder is not None else run.fits


def conformal_file(folder: Path | FitStore, mode: str, score: str, alpha: float,
                   seed: int) -> Path:
    """``folder/conformal_<mode>_<score>_a<alpha>_s<seed>.json``
    (:meth:`~cals_seg.utils.fits.FitStore.conformal`)."""
    store = folder if isinstance(folder, FitStore) else FitStore(folder)
    return store.conformal(mode, score, alpha, seed)


def conformal_tag(cs: Any) -> str:
    """File tag of a fit: ``<mode>_<score>_a<alpha>_s<seed>``."""
    return conformal_file(Path("."), cs.mode, cs.score, cs.alpha, cs.seed).stem[len("conformal_"):]


# --------------------------------------------------------------------------------------------
# Fitting.
# --------------------------------------------------------------------------------------------


def calibrated(calibrator: Any, logits: Tensor, image: Tensor) -> Tensor:
    """``logits`` ``(N, K, H, W)`` after ``calibrator`` (given ``image`` when it needs it);
    unchanged when it is None."""
    if calibrator is None:
        return logits
    with torch.no_grad():
        return calibrator(logits, image if calibrator.needs_image else None)


def _val_stream(run: Any, val_loader: Iterable, every: int, held: bool
                ) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """``(logits, target, image, index)`` of the held-out (``held``) or the other validation
    images of each batch, in loader order; ``index`` ``(n, 1)`` their stream positions."""
    seen = 0
    for logits, target, image in predict(run.model, val_loader, run.device, run.precision,
                                          protocol=run.task.protocol, with_inputs=True):
        mask = calibration_mask(len(logits), seen, every).to(logits.device)
        first, seen = seen, seen + len(logits)
        keep = mask if held else ~mask
        if bool(keep.any()):
            yield logits[keep], target[keep], image[keep], first + torch.nonzero(keep.cpu())


def _fit_calibrator(run: Any, spec: dict[str, Any], val_loader: Iterable, every: int,
                    others: int) -> tuple[Any, Any]:
    """The calibrator of ``spec`` fitted on the ``others`` validation images outside the
    calibration ones, and its fit summary; one line when it cannot be."""
    name, k = spec["calibrator"], run.task.num_classes
    fix = (f"give more validation images, a larger every (now {every}), or leave "
           f"calibrator={name} out")
    if others == 0:
        raise UserError(f"--conformal calibrator={name}: no validation image is left outside "
                        f"the calibration ones to fit it on; {fix}.")
    calibrator = build_calibrator(name, k).to(run.device)

    def batches() -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        for logits, target, image, _ in _val_stream(run, val_loader, every, held=False):
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
                  quiet: bool = False, *, loader: Loader | None = None
                  ) -> tuple[dict, dict, Any, list]:
    """Fit one :class:`~cals_seg.evaluation.conformal.ConformalSets` per mode of ``spec`` on
    the held-out validation images (after ``spec["calibrator"]``, fitted here on the other
    validation images); saves each fit on the raw logits, with its record, to
    :func:`conformal_file` in ``folder`` (default ``<run>/calibrators``; an ensemble's
    folder is in its --out). The chosen ``every`` is printed unless ``quiet``.

    Returns:
        ``({mode: fitted ConformalSets}, {mode: fit dict}, the calibrator or None,
        the calibration ids)``; each fit dict holds ``guarantee``, ``needs_images``,
        ``fitted_for`` and, when the guarantee is empty, a one-line ``warning``.

    Raises:
        UserError: under torchrun, or a calibrator that cannot be fitted (one line).
    """
    from cals_seg.evaluation.stream import run_loader

    loader = loader or run_loader(run)
    if is_distributed():
        raise UserError("--conformal: run it in one process (without torchrun).")
    num_val = len(val_set)
    every, chosen = choose_every(spec, num_val)
    if chosen and not quiet:
        print(chosen, flush=True)
    k, ignore = run.task.num_classes, run.task.ignore_index
    val_loader = loader(val_set)
    want_ids = calibration_ids(val_set, every)
    calibrator, fit_info = None, None
    if spec["calibrator"]:
        calibrator, fit_info = _fit_calibrator(run, spec, val_loader, every,
                                               num_val - len(want_ids))
    fits = {m: ConformalSets(k, spec["alpha"], m, spec["score"], spec["seed"],
                             ignore_index=ignore).to(run.device) for m in spec["mode"]}
    ids: list[Any] = []
    names = getattr(val_set, "ids", None)
    for logits, target, image, index in _val_stream(run, val_loader, every, held=True):
        out = calibrated(calibrator, logits, image)
        for cs in fits.values():
            cs.update(out, target)
        ids += [names[int(j)] if names is not None else int(j) for j in index.view(-1)]
    rule = (f"every {every}th validation image in loader order (images {every}, {2 * every}, "
            "... counting from 1)" if every > 1 else "every validation image")
    results = {}
    for m, cs in fits.items():
        record = conformal_key(run, spec, m, every, ids, calibrator).record()
        results[m] = _with_every_fix(
            {**cs.fit(), "seed": spec["seed"], "every": every, "calibrator": spec["calibrator"],
             "calibrator_fit": fit_info, "calibration_rule": rule, "calibration_ids": ids,
             "fitted_for": record}, spec, every, num_val)
        if calibrator is None:
            save_conformal(cs, conformal_file(fits_folder(run, folder), m, cs.score, cs.alpha,
                                              cs.seed), ids, record, results[m].get("warning"))
    return fits, results, calibrator, ids


# --------------------------------------------------------------------------------------------
# Saved fits: written with their record, read back validated.
# --------------------------------------------------------------------------------------------


def save_conformal(cs: Any, path: Path, ids: list[Any], record: dict[str, Any] | None = None,
                   warning: str | None = None) -> None:
    """A fit as JSON: its arguments, the integer threshold indices, the calibration counts
    and ids, the guarantee and what it was fitted for (``fitted_for``)."""
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


def read_conformal(path: Path, num_classes: int | None = None, fix: str | None = None
                   ) -> dict[str, Any]:
    """The fit saved at ``path``, validated like a config: a JSON object with every key of
    :func:`save_conformal` of the right type, ``score`` a registered score, ``alpha`` in
    (0, 1), ``grid`` a power of two in ``[2, 2^20]``, ``threshold_index`` one integer in
    ``[0, grid]`` per group, counts ``>= 0``, finite numbers, and ``num_classes`` equal to the
    run's (when given).

    Raises:
        UserError: one line naming the file, what is wrong and ``fix`` (how to refit it).
    """
    path = Path(path)
    fix = fix or "refit it with tools/eval_seg.py RUN --conformal ..."
    checks = {
        "num_classes": (lambda v: is_int(v) and v >= 2, "an integer >= 2"),
        "alpha": (lambda v: is_number(v) and 0 < v < 1, "a number in (0, 1)"),
        "mode": (lambda v: isinstance(v, str), "risk, image:TAU, class or band"),
        "score": (lambda v: v in SCORES, f"one of {list(SCORES)}"),
        "seed": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
        "bands": (lambda v: isinstance(v, list) and all(is_number(b) and b > 0 for b in v)
                  and v == sorted(set(v)), "increasing positive numbers"),
        "ignore_index": (is_int, "an integer"),
        "grid": (lambda v: is_int(v) and 2 <= v <= MAX_GRID and v & (v - 1) == 0,
                 f"a power of two in [2, {MAX_GRID}]"),
        "threshold_index": (lambda v: isinstance(v, list) and all(is_int(i) for i in v),
                            "a list of integers"),
        "calibration_images": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
        "calibration_images_group": (lambda v: isinstance(v, list)
                                     and all(is_int(c) and c >= 0 for c in v),
                                     "a list of integers >= 0"),
        "calibration_ids": (lambda v: isinstance(v, list), "a list"),
        "fitted_for": (lambda v: isinstance(v, dict), "an object"),
    }
    d = read_checked_json(path, fix, "a saved conformal fit", "conformal fit", checks)

    def bad(what: str) -> UserError:
        return UserError(f"{path}: {what}; {fix}.")

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


def load_conformal(path: Path, num_classes: int | None = None, fix: str | None = None
                   ) -> ConformalSets:
    """The fitted :class:`~cals_seg.evaluation.conformal.ConformalSets` saved at ``path``
    (read by :func:`read_conformal`: validated, one line when not), with ``fitted_for`` (its
    record) as an attribute."""
    d = read_conformal(path, num_classes, fix)
    cs = ConformalSets(d["num_classes"], d["alpha"], d["mode"], d["score"], d["seed"],
                       d["bands"], d["ignore_index"], grid=d["grid"])
    cs.threshold_index.copy_(torch.tensor(d["threshold_index"], dtype=torch.int64))
    cs.calibration_images = d["calibration_images"]
    cs.calibration_images_group = list(d["calibration_images_group"])
    cs.fitted_for = d["fitted_for"]
    return cs


__all__ = ["CONFORMAL_KEYS", "DEFAULT_EVERY", "MAX_GRID", "Loader", "calibrated",
           "calibration_ids", "calibration_mask", "choose_every", "conformal_file",
           "conformal_key", "conformal_tag", "fit_conformal", "fits_folder", "load_conformal",
           "module_digest", "parse_conformal", "read_conformal", "saved_fit_mismatch",
           "save_conformal", "spec_text"]
