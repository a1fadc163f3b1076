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
from typing import Any

from cals_seg.errors import MissingPathError, UserError
from cals_seg.evaluation.conformal_eval import (  # noqa: F401 (the commands' names)
    conformal_evaluation,
    conformal_sets,
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
    fit_conformal,
    fits_folder,
    load_conformal,
    module_digest,
    parse_conformal,
    read_conformal,
    save_conformal,
    saved_fit_mismatch,
    spec_text,
)


def load_or_fit_conformal(run: Any, spec: dict[str, Any], family: str = "segmentation") -> Any:
    """For predict_seg / predict_cls / export: the saved fit of ``spec`` (raw logits, one mode)
    when its record is this use's (:func:`~cals_seg.evaluation.conformal_fit.saved_fit_mismatch`),
    else fitted now on the run's held-out validation data and saved; refused in one line naming
    the file, the key that differs and the evaluation command that fits it (``eval_seg`` or
    ``eval_cls`` by ``family``) when the validation data cannot be read. An empty guarantee is
    said on stderr in one line.

    Raises:
        UserError / MissingPathError: one line naming the file and the fix.
    """
    from cals_seg.evaluation.evaluator import check_conformal, with_ids

    seg = family == "segmentation"
    if spec["calibrator"] or len(spec["mode"]) != 1:
        raise UserError(f"{'predict_seg ' if seg else ''}--conformal: one mode, on the network's "
                        "logits (no calibrator=); e.g. --conformal 0.1 or --conformal alpha=0.1 "
                        "mode=class.")
    if not seg:
        check_conformal(spec)
    mode, k = spec["mode"][0], len(run.class_names)
    path = conformal_file(fits_folder(run), mode, spec["score"], spec["alpha"], spec["seed"])
    refit = f"tools/{'eval_seg' if seg else 'eval_cls'}.py {run.path} --conformal {spec_text(spec)}"
    unit = "images" if seg else "inputs"
    if seg:  # read without the model; nothing generated
        val, unreadable = run.validation_set()
    else:
        val = with_ids(run.task.val_set, run.config.data.root) if run.task is not None else None
        unreadable = None  # known only once the run's data is loaded
    cs, reason = None, None
    if path.is_file():
        try:
            cs = load_conformal(path, k, f"refit it with {refit}")
        except UserError as err:  # damaged: remade from the validation data when readable
            if unreadable is not None:
                raise
            reason = str(err).removeprefix(f"{path}: ").split("; ")[0]
        else:
            reason = saved_fit_mismatch(run, spec, mode, cs, val)
        if reason is not None:
            cs = None
    if cs is None:
        data_run = run
        if run.task is None:
            try:  # the run's data (an embedded synthetic set is generated on first use)
                data_run = with_task(run)
            except (UserError, FileNotFoundError) as err:
                why = unreadable or str(err).splitlines()[0]
                if reason is not None:
                    raise UserError(f"{path}: {reason}, and the validation data cannot be read "
                                    f"to refit it ({why}); refit it with {refit}.") from None
                raise MissingPathError(f"{path} does not exist and the validation data cannot "
                                       f"be read to fit it ({why}); fit it with {refit}."
                                       ) from None
        if reason is not None:
            print(f"conformal: {path.name}: {reason}; refitting it on the validation {unit}.",
                  flush=True)
        val = data_run.task.val_set if seg else with_ids(data_run.task.val_set,
                                                        data_run.config.data.root)
        fit_conformal(data_run, spec, val)
        cs = load_conformal(path, k, f"refit it with {refit}")
    status = cs.guarantee()
    if not status["guarantee"]:
        print(f"warning: {path}: {status['warning']}", file=sys.stderr, flush=True)
    return cs


def with_task(run: Any) -> Any:
    """``run`` (loaded without its data) with its task built: the three splits of its
    config, checked as a command that reads the data checks them. The loaded network, device,
    precision and temperature are kept: the run is not read again (the task's own network,
    built with it, is not used).

    Raises:
        UserError / FileNotFoundError: the data cannot be read (one line).
    """
    from cals_seg.config.checks import check_config
    from cals_seg.tasks import build_task

    check_config(run.config, reads_data=True, writes_run=False)
    return run.replace(task=build_task(run.config, run.family))
