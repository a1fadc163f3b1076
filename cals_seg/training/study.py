"""Studies: train one run per (config, method, seed), reuse finished ones, complete old ones.

The library behind ``tools/compare.py`` (and the margin sweep of ``tools/margin.py``): a run is
trained in its own process (``python -m cals_seg.commands.train_seg`` or ``train_cls``), reused
when its ``test_metrics.json`` exists and its saved config matches, given the test metrics or
calibrators it lacks. The tables of a study (one row per method, mean and standard deviation
over seeds) are written by :mod:`cals_seg.training.tables`; the demo's reference numbers (the test
ECE per method and calibration, with the machine, date and command) by :func:`write_reference`
(``tools/compare.py --reference-out FILE``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from cals_seg.config.rules import changed_keys, keys_of
from cals_seg.config.schema import Config, config_to_dict, load_config
from cals_seg.errors import MissingPathError, UserError
from cals_seg.evaluation.evaluator import EvalPlan, Evaluator
from cals_seg.evaluation.stream import compute
from cals_seg.runs.run import Run, load_run
from cals_seg.tasks import build_task, task_family
from cals_seg.training.engine import make_loader
from cals_seg.utils.precision import resolve_amp, resolve_device

# Keys naming a folder: two spellings of one folder (relative and absolute, through a symbolic
# link) are the same value.
PATH_KEYS = ("data.root",)


def _same_folder(saved: dict[str, Any], now: dict[str, Any], key: str) -> bool:
    """Whether ``key`` names the same existing folder in both config dicts (relative paths
    taken from the working directory, as the loaders take them)."""
    section, name = key.split(".")
    try:
        a = Path(str(saved[section][name])).expanduser().resolve()
        b = Path(str(now[section][name])).expanduser().resolve()
    except (KeyError, OSError, RuntimeError):
        return False
    return a == b and a.is_dir()


def config_differences(run_dir: Path, expected: Config) -> list[str]:
    """Dotted keys whose value in ``run_dir/config.yaml`` differs from ``expected`` (a folder
    spelled two ways, :data:`PATH_KEYS`, is one value), and
    ``train.amp (resolved)`` when ``amp: auto`` resolved to another precision there (another
    CPU or GPU) than it does here."""
    run = Run(run_dir)
    saved = config_to_dict(run.read_config())
    neutral = keys_of("neutral")  # where the run is written, how it is shown
    now = config_to_dict(expected)
    differ = [k for k in changed_keys(saved, now)
              if k not in neutral and not (k in PATH_KEYS and _same_folder(saved, now, k))]
    there = run.trained_precision()
    here = resolve_amp(expected.train.amp, resolve_device(expected.train.device), warn=False)
    if there is not None and there != here:
        differ.append(f"train.amp (resolved: {there} there, {here} here)")
    return differ


def run_one(
    config: Path, method: str | None, seed: int, out: Path, sets: list[str],
    checkpoints: str = "best",
) -> tuple[Path, str | None]:
    """Train one (config, method, seed) run unless it has finished already; return
    (run dir, error).

    A run directory left by an earlier call is reused (finished) or resumed (interrupted) only
    if it was trained with the same config, in the same resolved precision; otherwise the run is
    reported as failed with the keys that differ, and nothing is overwritten."""
    cfg = load_config(config, sets, method)
    name = f"{cfg.name}_seed{seed}"
    run_dir = out / "runs" / name
    run = Run(run_dir)
    if run.has_config():
        expected = load_config(
            config, [*sets, f"name={name}", f"output_dir={out / 'runs'}", f"train.seed={seed}"],
            method,
        )
        differ = config_differences(run_dir, expected)
        if differ:
            return run_dir, (
                f"{run_dir} was trained with another config (differs in {', '.join(differ)}); "
                "delete it to retrain, or pass another --out"
            )
    if run.finished():
        print(f"reusing {run_dir}", flush=True)
        return run_dir, None
    tool = "train_seg" if task_family(cfg) == "segmentation" else "train_cls"
    cmd = [
        sys.executable,
        "-m",
        f"cals_seg.commands.{tool}",
        str(config),
        *(["--method", method] if method else []),
        "--set",
        *sets,
        f"name={name}",
        f"output_dir={out / 'runs'}",
        f"train.seed={seed}",
        "train.progress=false",
    ]
    if run.last.is_file():  # interrupted: continue it
        cmd += ["--resume", str(run_dir)]
    elif run_dir.exists():  # stopped (with a matching config) before its first checkpoint
        shutil.rmtree(run_dir)
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return run_dir, lines[-1] if lines else f"exit code {proc.returncode}"
    # a finished run is reused from test_metrics.json: its resume point is no longer needed
    run.drop_checkpoints(checkpoints)
    return run_dir, None


def backfill_test_metrics(run_dir: Path) -> list[str]:
    """Add to ``run_dir/test_metrics.json`` the keys the task's test meters write now and the
    file lacks (a run finished before those meters existed); return them (``[]``: none missing).

    The run's ``checkpoint_best.pt`` is evaluated once on its test split (the one test pass,
    :meth:`cals_seg.runs.run.Run.test`), in the precision it was tested in, with the saved
    temperature for the post-TS view (no refit); keys already in the file are kept as they are.
    Raises ``FileNotFoundError`` when keys are missing and the checkpoint is not there.
    """

    folder = Run(run_dir)
    metrics = folder.read_test_metrics()
    cfg = folder.read_config()
    task = build_task(cfg)
    missing = sorted(set(compute(task.meters(cfg.eval.n_bins, test=True))) - set(metrics["pre_ts"]))
    if not missing:
        return []
    if not folder.best.is_file():
        raise MissingPathError(f"{run_dir} lacks the test metrics {missing} and "
                               f"{folder.best.name}")
    print(f"adding {', '.join(missing)} to {folder.test_metrics} (one test pass of "
          f"{folder.best.name})", flush=True)
    run = load_run(folder.best, amp=metrics.get("precision"), with_data=True)
    loader = make_loader(run.task.test_set, cfg.eval.batch_size, False, cfg.data.num_workers)
    new = run.test(loader, temperature=metrics["temperature"] if metrics.get("post_ts") else None,
                   progress=False)
    for view in ("pre_ts", "post_ts"):
        if metrics.get(view):
            metrics[view].update({k: new[view][k] for k in missing})
    metrics["added_keys"] = sorted(set(metrics.get("added_keys", [])) | set(missing))
    folder.write_test_metrics(metrics)
    return missing


def add_calibrators(run_dir: Path, names: list[str]) -> list[str]:
    """Post-hoc calibrators of a finished segmentation run: fit the ones not saved in
    ``<run>/calibrators/`` on its validation split (and save them), evaluate the ones missing
    from ``test_metrics.json["calibrators"]`` on its test split in one pass of
    ``checkpoint_best.pt``, and add them (and ``calibrator_fits``) to that file; return the
    names added."""

    folder = Run(run_dir)
    metrics = folder.read_test_metrics()
    missing = [n for n in names if n not in (metrics.get("calibrators") or {})]
    if not missing:
        return []
    if not folder.best.is_file():
        raise MissingPathError(f"{run_dir} lacks {folder.best.name}, needed for --calibrators")
    run = load_run(folder.best, amp=metrics.get("precision"), with_data=True)
    print(f"{run_dir.name}: calibrators {', '.join(missing)} (fit on val, one test pass)",
          flush=True)
    plan = replace(EvalPlan.from_config(run.config, split="test"), calibrators=tuple(missing),
                   calibrator_params={}, conformal=None, shift=(), fit_shift=False,
                   num_maps=0, progress=False)  # the run's own fits: reused when for this use
    result = Evaluator(run, plan, say=lambda line: None).run()
    if result.skipped:
        name, why = next(iter(result.skipped.items()))
        raise UserError(f"{run_dir}: calibrator {name} cannot be fitted ({why}).")
    out, fits = result.metrics, result.metrics["calibrator_fits"]
    metrics.setdefault("calibrators", {}).update({n: out["calibrators"][n] for n in missing})
    metrics.setdefault("calibrator_fits", {}).update(fits)
    folder.write_test_metrics(metrics)
    return missing


# ----------------------------------------------------------------------------- reference data
# The demo's reference numbers (tools/demo.py prints them beside its one-seed rows): per setup
# file, the test ECE of each (method, calibration) over the seeds of a study, with where, when
# and by which command it was measured. ``tools/compare.py --reference-out FILE`` writes it.
REFERENCE_SCHEMA = 1
REFERENCE_HOW = ("regenerate it with: python tools/compare.py SETUP --methods ce cals_alm "
                 "--seeds 0 1 2 --calibrators ts boundary_ts --out OUT --reference-out FILE")


def describe_machine() -> str:
    """Where a study ran, in words: the CPU's model name and visible cores (and whether its
    bf16 kernels are native), or the GPU's name, and torch's version."""
    import os
    import platform

    import torch

    from cals_seg.utils.precision import cpu_has_native_bf16

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    bf16 = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    return f"{cpu}, {os.cpu_count()} cores visible, {bf16}; torch {torch.__version__}"


def _ece_cell(values: list[float | None]) -> dict[str, Any] | None:
    """``{"mean", "std", "n"}`` of per-seed ECEs (fractions) in %, std None for one seed."""
    import statistics

    found = [100.0 * v for v in values if v is not None]
    if not found:
        return None
    std = round(statistics.stdev(found), 4) if len(found) > 1 else None
    return {"mean": round(statistics.fmean(found), 4), "std": std, "n": len(found)}


def reference_entry(
    rows: dict[str, dict[str, Any]], calibrators: list[str], *, command: str, seeds: list[int],
    precision: str | None = None, machine: str | None = None, date: str | None = None,
) -> dict[str, Any]:
    """One setup's entry of the reference file, from ``tools/compare.py``'s rows: per row
    (method) the test ECE in % before calibration (``raw``) and after each of ``calibrators``
    (fitted on each run's validation split): mean, standard deviation over the seeds (None for
    one seed) and the number of seeds; with the command, the seeds, the machine
    (:func:`describe_machine` unless given), the runs' precision in words
    (:func:`precision_words`) and the date (today, UTC, unless given). A calibration no run
    of a row has is left out of that row."""
    import datetime

    ece: dict[str, dict[str, Any]] = {}
    for method, row in rows.items():
        cells = {"raw": _ece_cell([s.get("ece") for s in row.get("summaries", [])])}
        per_seed = row.get("calibrators") or []
        for name in calibrators:
            cells[name] = _ece_cell([s[name].get("ece") for s in per_seed if name in s])
        cells = {k: v for k, v in cells.items() if v is not None}
        if cells:
            ece[method] = cells
    entry: dict[str, Any] = {
        "machine": machine or describe_machine(),
        "date": date or datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "command": command,
        "seeds": list(seeds),
        "ece": ece,
    }
    if precision:
        entry["precision"] = precision
    return entry


def precision_words(trained: str | None, tested: str | None) -> str | None:
    """The precisions of a run in words: ``"training bfloat16, test pass float32"`` from its
    training's and its test pass's ``none`` / ``bf16`` / ``fp16`` (one phrase when they agree,
    None when neither is known)."""
    names = {"none": "float32", "bf16": "bfloat16", "fp16": "float16"}
    train, test = (names.get(p, p) if p else None for p in (trained, tested))
    if train and test:
        return train if train == test else f"training {train}, test pass {test}"
    return f"training {train}" if train else f"test pass {test}" if test else None


def check_reference(data: Any, where: str) -> dict[str, Any]:
    """The reference file's content, checked against :data:`REFERENCE_SCHEMA`: ``{"schema": 1,
    "setups": {SETUP: entry}}``, each entry with ``machine``, ``date`` (YYYY-MM-DD),
    ``command`` (or ``source``, the doc section it was taken from), ``seeds`` and ``ece``:
    ``{method: {calibration: {"mean": %, "std": % or None, "n": seeds}}}``.

    Raises:
        UserError: one line naming ``where``, what is wrong and how to regenerate the file.
    """
    import re

    def bad(what: str) -> UserError:
        return UserError(f"{where}: {what}; {REFERENCE_HOW}")

    def number(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and x == x and x >= 0

    if not isinstance(data, dict) or data.get("schema") != REFERENCE_SCHEMA:
        raise bad(f"not a reference file of schema {REFERENCE_SCHEMA}")
    setups = data.get("setups")
    if not isinstance(setups, dict) or not setups:
        raise bad("'setups' must map setup files to their entries")
    for setup, entry in setups.items():
        if not isinstance(entry, dict):
            raise bad(f"setups[{setup!r}] is not an object")
        for key in ("machine", "date"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise bad(f"setups[{setup!r}] lacks '{key}'")
        if not re.fullmatch(r"\d{4}-\d\d-\d\d", entry["date"]):
            raise bad(f"setups[{setup!r}].date {entry['date']!r} is not YYYY-MM-DD")
        if not any(isinstance(entry.get(k), str) and entry[k].strip()
                   for k in ("command", "source")):
            raise bad(f"setups[{setup!r}] names neither the 'command' nor the 'source'")
        seeds = entry.get("seeds")
        if not isinstance(seeds, list) or not seeds or not all(
                isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            raise bad(f"setups[{setup!r}].seeds must be a list of integers")
        ece = entry.get("ece")
        if not isinstance(ece, dict) or not ece:
            raise bad(f"setups[{setup!r}].ece must map methods to calibrations")
        for method, cells in ece.items():
            if not isinstance(cells, dict) or not cells:
                raise bad(f"setups[{setup!r}].ece[{method!r}] must map calibrations to values")
            for name, cell in cells.items():
                at = f"setups[{setup!r}].ece[{method!r}][{name!r}]"
                if not isinstance(cell, dict) or not number(cell.get("mean")):
                    raise bad(f"{at} needs a 'mean' (a number >= 0, in %)")
                if cell.get("std") is not None and not number(cell["std"]):
                    raise bad(f"{at}.std must be a number >= 0 or null")
                n = cell.get("n")
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise bad(f"{at}.n must be the number of seeds (>= 1)")
    return data


def read_reference(path: str | Path) -> dict[str, Any]:
    """The reference file at ``path``, checked (:func:`check_reference`).

    Raises:
        UserError: the file is missing, not JSON or not of the schema (one line).
    """
    import json

    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MissingPathError(f"{path}: no such reference file; {REFERENCE_HOW}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"{path}: not readable as JSON ({first}); {REFERENCE_HOW}") from None
    return check_reference(data, str(path))


def write_reference(path: str | Path, setup: str, entry: dict[str, Any]) -> None:
    """Write ``entry`` as ``setup``'s in the reference file at ``path`` (atomically), keeping the
    other setups of an existing, valid file; an existing file that is not valid is refused.

    Raises:
        UserError: the existing file is not a reference file, or the entry is not valid.
    """
    from cals_seg.utils.io import write_json

    path = Path(path)
    data: dict[str, Any] = {"schema": REFERENCE_SCHEMA, "setups": {}}
    if path.exists():
        data = read_reference(path)
    data["setups"][setup] = entry
    check_reference(data, f"the reference entry of {setup}")
    write_json(path, data)
