"""Conformal prediction sets for the commands: the ``--conformal key=value ...`` words of
``eval_seg``, ``predict_seg``, ``export`` and ``compare`` (docs/conformal.md), and the saved fit
``predict_seg`` / ``export`` use, refit from the run's validation data when it is not theirs.

The library is :mod:`cals_seg.evaluation.conformal_fit` (which images calibrate, the fit, its
record and file) and :mod:`cals_seg.evaluation.conformal_eval` (the sets measured on a split,
made for one image, their tables and pictures); its names are importable from here too.
``predict_seg`` / ``export`` use a saved fit only when the record matches; otherwise they refit
it (validation readable) or refuse in one line.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cals_seg.errors import MissingPathError, UserError
from cals_seg.evaluation import conformal_eval, conformal_fit
from cals_seg.evaluation.conformal_eval import (  # noqa: F401 (the commands' names)
    conformal_table,
    image_sets,
    set_summary,
    write_set_outputs,
    write_size_map,
)
from cals_seg.evaluation.conformal_fit import (  # noqa: F401 (the commands' names)
    CONFORMAL_KEYS,
    DEFAULT_EVERY,
    MAX_GRID,
    Loader,
    calibration_ids,
    choose_every,
    conformal_file,
    conformal_key,
    conformal_tag,
    fits_folder,
    load_conformal,
    module_digest,
    parse_conformal,
    read_conformal,
    save_conformal,
    saved_fit_mismatch,
    spec_text,
)
from cals_seg.training.engine import make_loader


def eval_loader(batch_size: int, workers: int) -> Loader:
    """The loader the library is given: a dataset -> its evaluation loader of ``batch_size``
    and ``workers``, in order."""

    def loader(dataset: Any) -> Any:
        return make_loader(dataset, batch_size, False, workers)

    return loader


def run_loader(run: Any) -> Loader:
    """:func:`eval_loader` at the run's ``eval.batch_size`` and ``data.num_workers``."""
    return eval_loader(run.config.eval.batch_size, run.config.data.num_workers)


def fit_conformal(run: Any, spec: dict[str, Any], val_set: Any, folder: Path | None = None,
                  quiet: bool = False) -> tuple[dict, dict, Any, list]:
    """:func:`cals_seg.evaluation.conformal_fit.fit_conformal` with the run's loader."""
    return conformal_fit.fit_conformal(run, spec, val_set, folder, quiet, loader=run_loader(run))


def conformal_evaluation(run: Any, spec: dict[str, Any], val_set: Any, test_set: Any,
                         progress: bool = False, maps_dir: Path | None = None, num_maps: int = 0,
                         folder: Path | None = None) -> dict[str, Any]:
    """:func:`cals_seg.evaluation.conformal_eval.conformal_evaluation` with the run's loader:
    ``{MODE: fit and test-split numbers}``."""
    return conformal_eval.conformal_evaluation(run, spec, val_set, test_set, progress, maps_dir,
                                               num_maps, folder, loader=run_loader(run))


def conformal_sets(run: Any, spec: dict[str, Any], val_set: Any, test_set: Any,
                   maps_dir: Path | None = None, num_maps: int = 0,
                   folder: Path | None = None) -> Any:
    """:func:`cals_seg.evaluation.conformal_eval.conformal_sets` with the run's loader: the
    fitted sets as a consumer of the test pass."""
    return conformal_eval.conformal_sets(run, spec, val_set, test_set, maps_dir, num_maps,
                                         folder, loader=run_loader(run))


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
    record is this use's (:func:`~cals_seg.evaluation.conformal_fit.saved_fit_mismatch`), else
    fitted now on the run's held-out validation images and saved; refused in one line naming
    the file and the key that differs when the validation data cannot be read. An empty
    guarantee is said on stderr in one line.

    Raises:
        UserError / MissingPathError: one line naming the file and the fix.
    """
    if spec["calibrator"] or len(spec["mode"]) != 1:
        raise UserError("predict_seg --conformal: one mode, on the network's logits (no "
                        "calibrator=); e.g. --conformal 0.1 or --conformal alpha=0.1 mode=class.")
    mode, k = spec["mode"][0], len(run.class_names)
    path = conformal_file(fits_folder(run), mode, spec["score"], spec["alpha"], spec["seed"])
    refit = f"tools/eval_seg.py {run.path} --conformal {spec_text(spec)}"
    val, unreadable = validation_split(run)  # without the model; nothing generated
    cs, reason = None, None
    if path.is_file():
        try:
            cs = load_conformal(path, k, f"refit it with {refit}")
        except UserError as err:  # damaged: remade from the validation images when readable
            if val is None:
                raise
            reason = str(err).removeprefix(f"{path}: ").split("; ")[0]
        else:
            reason = saved_fit_mismatch(run, spec, mode, cs, val)
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
