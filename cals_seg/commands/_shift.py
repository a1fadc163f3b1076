"""Shift for the commands: ``eval_seg --shift``, ``--ensemble`` and ``--calibrator-fit-shift``
(docs/shift.md).

- ``--shift NAME:SEVERITY ... | all:S | all``: the split evaluated again with each corruption
  (:mod:`cals_seg.data.corruptions`, seeded by ``--shift-seed``) applied to its images, with the
  temperature and calibrators fitted once (on the clean or the drifted validation images):
  ``metrics.json["shift"]["NAME:SEVERITY"]``, the same dictionary as the clean evaluation
  (``pre_ts``, ``post_ts``, ``calibrators``), and the table ``DIR/shift.md``.
- ``RUN1 RUN2 ... --ensemble --out DIR``: the members' mean probability
  (:class:`cals_seg.evaluation.ensemble.Ensemble`), refused when their data or protocol differ.
- ``--calibrator-fit-shift``: each calibrator of ``--calibrators`` also fitted on the validation
  images corrupted by :class:`cals_seg.data.corruptions.DriftMixture` (the held-out corruptions,
  severities 0-5, none of the benchmark's), reported as ``NAME+drift`` beside ``NAME``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cals_seg.errors import UserError

DRIFT_SUFFIX = "+drift"


def add_shift_arguments(parser: argparse.ArgumentParser) -> None:
    """``--shift --shift-seed --ensemble --calibrator-fit-shift``."""
    parser.add_argument("--shift", nargs="+", default=None, metavar="NAME:SEVERITY",
                        help="also evaluate with each image corruption (severity 1-5; all:3 "
                        "every corruption at 3; all: every one at every severity); "
                        "docs/shift.md")
    parser.add_argument("--shift-seed", default="0", metavar="SEED",
                        help="seed of the corruptions, an integer >= 0 (the same for every "
                        "method compared)")
    parser.add_argument("--ensemble", action="store_true",
                        help="evaluate the mean probability of the runs given (needs --out)")
    parser.add_argument("--calibrator-fit-shift", action="store_true",
                        help="also fit each --calibrators one on corrupted validation images "
                        "(held-out corruptions), reported as NAME+drift")


def parse_seed(value: Any) -> int:
    """``--shift-seed``: an integer >= 0 written in ASCII digits (``int`` also reads other
    scripts' digits, and refuses ``"²"`` with a traceback).

    Raises:
        UserError: one line naming the value.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    text = str(value)
    if not (text.isascii() and text.isdigit()):
        raise UserError(f"--shift-seed {text!r}: expected an integer >= 0 (ASCII digits), e.g. "
                        "--shift-seed 0.")
    return int(text)


def check_shift_arguments(args: argparse.Namespace) -> None:
    """Parse ``--shift`` into corruptions and ``--shift-seed`` into an integer, and refuse
    inconsistent options (one line each)."""
    from cals_seg.data.corruptions import parse_shifts

    runs = args.run if isinstance(args.run, list) else [args.run]
    if len(runs) > 1 and not args.ensemble:
        raise UserError(f"{len(runs)} runs given: evaluate them together with --ensemble "
                        "--out DIR, or one at a time.")
    if args.ensemble and not args.out:
        raise UserError("--ensemble: name the output folder with --out DIR.")
    if args.ensemble and args.checkpoint not in ("best", "last"):
        raise UserError("--ensemble: --checkpoint must be best or last (one per run folder).")
    if args.calibrator_fit_shift and not args.calibrators:
        raise UserError("--calibrator-fit-shift: name the calibrators to fit with --calibrators, "
                        "e.g. --calibrators ts boundary_ts --calibrator-fit-shift.")
    args.shift_seed = parse_seed(args.shift_seed)
    args.shift = parse_shifts(args.shift, args.shift_seed) if args.shift else []


def ensemble_folder(out: str | Path, digest: str) -> Path:
    """Where an ensemble's fits (calibrators, conformal thresholds, drift fits) live: in its
    own ``--out``, one folder per set of members (by content), never in a member's run."""
    return Path(out) / "calibrators" / f"ensemble_{digest[:16]}"


def open_ensemble(args: argparse.Namespace, open_run: Any) -> Any:
    """The first member's run with the :class:`Ensemble` of every member as its model; the
    members' data and protocols checked to match, and each network given once (by content:
    a byte copy of a checkpoint is the same network). Its fits go to :func:`ensemble_folder`
    (``args.calibrator_folder``); ``extra["ensemble"]["network"]`` is the members' digest."""
    from cals_seg.config.schema import config_to_dict
    from cals_seg.evaluation.ensemble import Ensemble, check_members, protocol_of
    from cals_seg.utils.fits import members_digest

    runs = []
    for folder in args.run:
        member_args = copy.copy(args)
        member_args.run = folder
        runs.append(open_run(member_args))
    protocols = [protocol_of(config_to_dict(r.config),
                             dataclasses.replace(r.task.protocol, tile_batch=1)) for r in runs]
    check_members([str(r.path) for r in runs], protocols,
                  [str(Path(r.checkpoint).resolve()) for r in runs])
    first = runs[0]
    model = Ensemble([r.model for r in runs]).eval()
    first.task.model = model
    digest = members_digest([r.checkpoint for r in runs])
    args.calibrator_folder = ensemble_folder(args.out, digest)
    return dataclasses.replace(first, model=model, extra={
        **first.extra, "ensemble": {"members": [str(r.checkpoint) for r in runs],
                                    "size": len(runs), "forward_passes_per_image": len(runs),
                                    "network": digest,
                                    "fits_folder": str(args.calibrator_folder)}})


def drift_calibrators(run: Any, args: argparse.Namespace, names: Sequence[str], folder: Path,
                      batch_size: int, workers: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({NAME+drift: calibrator}, {NAME+drift: fit summary})``: ``names`` fitted on the
    validation split under :class:`DriftMixture` (seeded by ``--shift-seed``), or loaded from
    ``folder/drift_s<seed>/NAME.pt`` when the record it holds
    (:func:`cals_seg.calibrators.calibrator_record`: the network by content, classes, ids,
    parameters, precision, protocol, and the mixture with its seed as ``data``) is this use's;
    refit otherwise (the reason printed)."""
    from cals_seg.calibrators import calibrator_record
    from cals_seg.data.corruptions import DriftMixture, corrupted_dataset
    from cals_seg.evaluation.engine import load_or_fit_calibrators
    from cals_seg.training.engine import make_loader

    task, infer = run.task, run.inference
    mixture = DriftMixture(seed=args.shift_seed)
    data = f"{mixture.key} seed {mixture.seed}"
    loader = make_loader(corrupted_dataset(task.val_set, mixture), batch_size, False, workers)
    params = getattr(args, "calibrator_params", None) or {}
    val_ids = getattr(task.val_set, "ids", None) or list(range(len(task.val_set)))
    records = {name: calibrator_record(run, name, params.get(name, {}), val_ids, data=data,
                                       precision=infer.amp, protocol=infer.protocol)
               for name in names}
    cals, fits = load_or_fit_calibrators(
        names, Path(folder) / f"drift_s{mixture.seed}", task.num_classes, infer, loader,
        task.ignore_index, args.refit_calibrators, params, fitted_for=records)
    suffix = lambda d: {f"{k}{DRIFT_SUFFIX}": v for k, v in d.items()}  # noqa: E731
    fits = {k: {**v, "fit_data": data} for k, v in fits.items()}
    return suffix(cals), suffix(fits)


def fixed_test(run: Any, loader: Any, temperature: float | None,
               calibrators: Mapping[str, Any], extra: Sequence[Any] = ()) -> dict[str, Any]:
    """The metrics of ``calibrated_test`` with the temperature and calibrators already fitted:
    ``{"temperature", "pre_ts", "post_ts" (None without T), "calibrators"}``; ``extra``
    image consumers see the same pass."""
    from cals_seg.evaluation.engine import run_test_pass

    n_bins = run.config.eval.n_bins
    out = run_test_pass(run.inference, loader, lambda: run.task.meters(n_bins, test=True),
                        temperature, calibrators, run.config.train.progress, "shift", extra)
    out["temperature"] = temperature if temperature is not None else 1.0
    if not calibrators:
        out.pop("calibrators", None)
    return out


def shift_results(run: Any, args: argparse.Namespace, split_set: Any, result: Mapping[str, Any],
                  calibrators: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{NAME:SEVERITY: metrics}`` of every corruption of ``args.shift`` on ``split_set``, and
    the entropy flag of :mod:`cals_seg.evaluation.ood` (its limit on the validation images, the
    fraction flagged on the clean and on each corrupted split, at the run's T)."""
    from cals_seg.evaluation.ood import QUANTILE, MeanEntropy, entropy_limit, flagged_rate
    from cals_seg.evaluation.shift import shift_evaluation
    from cals_seg.evaluation.stream import evaluate
    from cals_seg.training.engine import make_loader

    e, workers = run.config.eval, run.config.data.num_workers
    temperature = result["temperature"] if result.get("post_ts") else None
    t = temperature or 1.0

    def loader(dataset: Any) -> Any:
        return make_loader(dataset, e.batch_size, False, workers)

    def entropies(dataset: Any) -> list[float]:
        ref = MeanEntropy(t)
        evaluate(run.model, loader(dataset), run.device, [], run.precision,
                 protocol=run.task.protocol, image_consumers=[ref])
        return ref.values

    limit = entropy_limit(entropies(run.task.val_set), QUANTILE)
    flags: dict[str, Any] = {"quantile": QUANTILE, "limit_nats": limit, "temperature": t,
                             "clean_rate": flagged_rate(entropies(split_set), limit), "rates": {}}

    def once(dataset: Any) -> dict[str, Any]:
        ref = MeanEntropy(t)
        metrics = fixed_test(run, loader(dataset), temperature, calibrators, [ref])
        flags["rates"][dataset.corruption.key] = flagged_rate(ref.values, limit)
        return metrics

    shifted = shift_evaluation(once, split_set, args.shift)
    return shifted, flags


ENTROPY_FILE = "entropy_p{q}_{how}.json"


def read_entropy(path: Path, fix: str) -> dict[str, Any]:
    """The entropy reference saved at ``path``, validated: a JSON object with ``quantile`` in
    (0, 1), a finite ``limit_nats >= 0``, ``images >= 1``, a ``calibration`` string and a
    ``fitted_for`` object.

    Raises:
        UserError: one line naming the file, what is wrong and ``fix``.
    """
    import json

    def bad(what: str) -> UserError:
        return UserError(f"{path}: {what}; {fix}.")

    try:
        info = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise bad(f"cannot be read ({err.strerror or type(err).__name__})") from None
    except (ValueError, UnicodeDecodeError):
        raise bad("is not valid JSON (truncated or edited?)") from None
    if not isinstance(info, dict):
        raise bad(f"holds a {type(info).__name__}, not an entropy reference")

    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    checks = {
        "quantile": (lambda v: number(v) and 0 < v < 1, "a number in (0, 1)"),
        "limit_nats": (lambda v: number(v) and v >= 0, "a finite number >= 0"),
        "images": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                   "an integer >= 1"),
        "calibration": (lambda v: isinstance(v, str), "a string"),
        "fitted_for": (lambda v: isinstance(v, dict), "an object"),
    }
    for key, (ok, allowed) in checks.items():
        if key not in info:
            raise bad(f"has no {key!r} (not a complete entropy reference)")
        if not ok(info[key]):
            raise bad(f"{key}: expected {allowed}, got {json.dumps(info[key])[:40]}")
    return info


def entropy_record(run: Any, how: str, calibrator_file: Path | None, quantile: float,
                   val_ids: Sequence[Any] | None) -> dict[str, Any]:
    """What an entropy reference is for: the network (by content), classes, the validation
    ids (left out when they cannot be read), the calibration (T or calibrator, and the
    calibrator file's digest), the quantile and the protocol."""
    from cals_seg.commands._conformal import network_digest, protocol_record
    from cals_seg.utils.fits import file_digest, ids_digest, plain_record

    record = {"network": network_digest(run), "num_classes": len(run.class_names),
              "split": "val", "calibration": how, "quantile": quantile,
              "calibrator_file": file_digest(calibrator_file) if calibrator_file else None,
              "protocol": protocol_record(run.protocol)}
    if val_ids is not None:
        record["ids"] = ids_digest(val_ids)
    return plain_record(record)


def entropy_reference(run: Any, temperature: float, calibrator_name: str | None,
                      calibrator: Any) -> dict[str, Any] | None:
    """The validation images' mean-entropy limit for ``predict_seg``: read from
    ``<run>/calibrators/entropy_p99_<T or calibrator>.json`` when the record it holds
    (:func:`entropy_record`) is this use's, else computed over the validation split with the
    same calibration and saved; ``None`` (with a warning) when there is no file and the
    validation images cannot be read.

    Raises:
        UserError: a file that is not a valid reference (:func:`read_entropy`), or one fitted
            for something else while the validation images cannot be read to recompute it.
    """
    import torch

    from cals_seg.commands._conformal import validation_split
    from cals_seg.evaluation.inference import predict_image
    from cals_seg.evaluation.ood import QUANTILE, entropy_limit
    from cals_seg.utils.fits import fit_mismatch
    from cals_seg.utils.io import write_json

    how = f"calibrator-{calibrator_name}" if calibrator_name else f"T{temperature:.4f}"
    path = run.path / "calibrators" / ENTROPY_FILE.format(q=round(100 * QUANTILE), how=how)
    cal_file = run.run.calibrator_file(calibrator_name) if calibrator_name else None
    fix = (f"delete it to have it recomputed from the validation images of {run.path}, or "
           "give --no-ood-check")
    val, unreadable = validation_split(run)
    val_ids = None if val is None else getattr(val, "ids", None) or list(range(len(val)))
    if path.is_file():
        info = read_entropy(path, fix)
        wanted = entropy_record(run, how, cal_file, QUANTILE, val_ids)
        if val is None and "ids" in info["fitted_for"]:  # cannot be checked without the data
            wanted["ids"] = info["fitted_for"]["ids"]
        reason = fit_mismatch(info["fitted_for"], wanted)
        if reason is None:
            return info
        if val is None:
            raise UserError(f"{path}: {reason}, and the validation images cannot be read to "
                            f"recompute it ({unreadable}); {fix}.")
        print(f"{path.name}: {reason}; recomputing it on the validation images.", flush=True)
    elif val is None:
        print(f"warning: no far-from-validation check: the validation images of {run.path} "
              f"could not be read ({unreadable}).", file=sys.stderr, flush=True)
        return None
    try:
        values = []
        for i in range(len(val)):
            pred = predict_image(run.model, val[i]["image"][None], temperature, run.protocol,
                                 run.precision, calibrator=calibrator)
            values.append(float(pred.entropy[0].double().mean()))
        limit = entropy_limit(values, QUANTILE)
    except (OSError, UserError, ValueError) as err:
        print(f"warning: no far-from-validation check: the validation images of {run.path} "
              f"could not be read ({str(err).splitlines()[0]}).", file=sys.stderr, flush=True)
        return None
    if not math.isfinite(limit):
        raise UserError(f"the validation images of {run.path} give a mean predictive entropy "
                        f"of {limit} (the network's outputs are not finite); check the network, "
                        "or give --no-ood-check.")
    info = {"quantile": QUANTILE, "limit_nats": limit, "images": len(values), "calibration": how,
            "torch": torch.__version__,
            "fitted_for": entropy_record(run, how, cal_file, QUANTILE, val_ids)}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, info)
    return info


def write_shift(result: Mapping[str, Any], out: Path, title: str) -> None:
    """``out/shift.md``: the clean rows, each corruption's and the severity means."""
    from cals_seg.evaluation.shift import shift_table

    if not result.get("shift"):
        return
    table = shift_table(result["shift"], clean=result)
    flags = result.get("entropy_flag")
    if flags:
        rates = ", ".join(f"{k} {100 * v:.0f}%" for k, v in flags["rates"].items())
        table += (f"\nImages whose mean predictive entropy is above the validation's "
                  f"{100 * flags['quantile']:.0f}th percentile ({flags['limit_nats']:.4f} nats): "
                  f"clean {100 * flags['clean_rate']:.0f}%, {rates}.\n")
    (out / "shift.md").write_text(f"{title}: calibration under image corruptions "
                                  "(docs/shift.md). Values in % except NLL.\n\n" + table)
    print(table)
