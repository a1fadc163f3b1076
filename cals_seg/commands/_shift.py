"""Shift for the commands: the options ``eval_seg --shift``, ``--ensemble`` and
``--calibrator-fit-shift`` (docs/shift.md), the ensemble of run folders, and the library calls
with the options' values. The library: :mod:`cals_seg.evaluation.shift` (the evaluation under
corruptions and its table), :mod:`cals_seg.evaluation.drift` (calibrators fitted under drift)
and :mod:`cals_seg.evaluation.ood` (the entropy flag and predict_seg's saved reference).

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cals_seg.config.schema import config_to_dict
from cals_seg.errors import UserError
from cals_seg.utils.fits import members_digest


def add_shift_arguments(parser: argparse.ArgumentParser) -> None:
    """``--shift --shift-seed --ensemble --calibrator-fit-shift``."""
    parser.add_argument("--shift", nargs="+", default=None, metavar="NAME:SEVERITY",
                        help="also evaluate with each image corruption (severity 1-5; all:3 "
                        "every corruption at 3; all: every one at every severity); "
                        "docs/shift.md")
    parser.add_argument("--shift-seed", default=None, metavar="SEED",
                        help="seed of the corruptions, an integer >= 0 (the same for every "
                        "method compared; default: eval.shift_seed, 0)")
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
    """Check ``--shift`` (corruptions) and ``--shift-seed`` (an integer), and refuse
    inconsistent options (one line each); the values are passed on as given (they become
    ``eval.shift`` and ``eval.shift_seed``)."""
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
    seed = parse_seed(0 if args.shift_seed is None else args.shift_seed)
    if args.shift:
        parse_shifts(args.shift, seed)


def ensemble_folder(out: str | Path, digest: str) -> Path:
    """Where an ensemble's fits (calibrators, conformal thresholds, drift fits) live: in its
    own ``--out``, one folder per set of members (by content), never in a member's run."""
    return Path(out) / "calibrators" / f"ensemble_{digest[:16]}"


def open_ensemble(args: argparse.Namespace, open_run: Any) -> Any:
    """``(the first member's run with the :class:`Ensemble` of every member as its model, the
    folder of its fits)``; the members' data and protocols checked to match, and each network
    given once (by content: a byte copy of a checkpoint is the same network). Its fits go to
    :func:`ensemble_folder`; ``extra["ensemble"]["network"]`` is the members' digest."""
    from cals_seg.evaluation.ensemble import Ensemble, check_members, protocol_of

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
    folder = ensemble_folder(args.out, digest)
    return first.replace(model=model, extra={
        **first.extra, "ensemble": {"members": [str(r.checkpoint) for r in runs],
                                    "size": len(runs), "forward_passes_per_image": len(runs),
                                    "network": digest,
                                    "fits_folder": str(folder)}}), folder


# The library's names, imported where used: eval_seg imports this module for its arguments,
# and its --help does not import torch.


def entropy_reference(run: Any, temperature: float, calibrator_name: str | None,
                      calibrator: Any) -> dict[str, Any] | None:
    """:func:`cals_seg.evaluation.ood.entropy_reference` on the run's validation split, read
    without the model (:meth:`cals_seg.runs.run.Run.validation_set`): the saved or
    recomputed mean-entropy limit, or None (with a warning) when neither can be had.

    Raises:
        UserError: a broken reference file, or one for another use that cannot be recomputed.
    """
    from cals_seg.evaluation import ood

    val, unreadable = run.validation_set()
    return ood.entropy_reference(run, temperature, calibrator_name, calibrator, val, unreadable)


def write_shift(result: Mapping[str, Any], out: Path, title: str) -> None:
    """``out/shift.md``: the clean rows, each corruption's and the severity means
    (:func:`cals_seg.evaluation.shift.shift_report`); printed too."""
    from cals_seg.evaluation.shift import shift_report

    table = shift_report(result)
    if table is None:
        return
    (out / "shift.md").write_text(f"{title}: calibration under image corruptions "
                                  "(docs/shift.md). Values in % except NLL.\n\n" + table)
    print(table)
