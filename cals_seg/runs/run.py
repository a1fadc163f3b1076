"""The run: one folder, its files, its model, and the one test pass.

    runs/<name>/
        config.yaml          the resolved config (every default filled in)
        history.jsonl        one JSON line per finished epoch
        checkpoint_last.pt   the state to resume from (model, optimizer, schedule, multipliers, RNG)
        checkpoint_best.pt   the same state at the best validation epoch
        test_metrics.json    the best checkpoint's test metrics, before and after temperature
                             scaling (and of post-hoc calibrators added by compare)
        temperature.json     the temperature fitted on the validation split
        plots/*.png
        calibrators/<name>.pt   post-hoc calibrators fitted on the validation split
        eval_<split>/metrics.json   what ``eval_seg`` writes by default

This module is the only place that spells these names: every other module asks a :class:`Run`
for its paths (``run.best``, ``run.test_metrics``, ...) or uses the constants below.

Every file is written atomically (:mod:`cals_seg.utils.io`: a temporary file, fsync, rename),
and an epoch's files are written in an order that leaves a consistent run whatever instant the
process dies at: the history line first, then ``checkpoint_last.pt``, then
``checkpoint_best.pt``. A resume keeps the history lines of the epochs the checkpoint holds and
repairs a best checkpoint the crash left behind (:meth:`Run.trim_history`,
:meth:`Run.repair_best`). Checkpoints are read with ``torch.load(weights_only=True)``: loading a
checkpoint someone shared cannot run code.

Every file is read back through one typed reader of :class:`Run` (:meth:`Run.read_config`,
:meth:`Run.read_checkpoint`, :meth:`Run.read_temperature`, :meth:`Run.history`,
:meth:`Run.read_test_metrics`, :meth:`Run.read_eval_metrics`), which validates it (empty,
truncated, another type, a key missing, a value out of range, NaN / inf, random bytes) and ends
in one line naming the file and the way out (:class:`~cals_seg.errors.RunFileError`), or, where
the content can be made again from the run (the temperature, fitted on the validation split),
remakes it with a one-line notice. A torn last line of ``history.jsonl`` (a crash while it was
written) is dropped with a notice when a resume trims the history.

Loading a trained run for evaluation or prediction is :func:`load_run` (or :meth:`Run.load`)::

    run = load_run("runs/synthetic_deeplabv3_cals_alm")        # checkpoint_best.pt
    logits = run.model(x.to(run.device))                        # eval mode, on run.device
    probs = (logits / run.temperature).softmax(dim=1)           # T fitted on validation
    result = run.test(test_loader, temperature=run.temperature)  # the one test pass

It resolves the folder (or a checkpoint inside one), reads the run's own resolved
``config.yaml`` (``overrides`` on top, e.g. another evaluation protocol), checks the checkpoint
against it (class count, architecture) with messages that name the files, and returns the
config, the model, the device, the precision, the evaluation protocol, the class names, the task
family and its headline metric, and the fitted temperature. ``with_data=True`` also builds the
task (its three splits), which needs the data on disk; without it (predicting on new images,
exporting) nothing but the run folder is read.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cals_seg.config.schema import Config, config_to_dict, load_config
from cals_seg.errors import (
    CheckpointError,
    MissingPathError,
    RunExistsError,
    RunFileError,
    UserError,
)
from cals_seg.evaluation.engine import run_test_pass
from cals_seg.evaluation.inference import EvalProtocol
from cals_seg.evaluation.stream import Inference
from cals_seg.models.consent import code_consent
from cals_seg.utils.fits import FitStore
from cals_seg.utils.io import (
    atomic_write,
    finite_number,
    json_safe,
    load_checkpoint,
    of_type,
    read_json_file,
    read_jsonl_lines,
    save_checkpoint,
    short_text,
    write_json,
)

if TYPE_CHECKING:  # the tasks import the data and model libraries; the loader imports them
    from cals_seg.tasks import Task

# The names of a run's files: spelt here and nowhere else.
CONFIG_FILE = "config.yaml"
HISTORY_FILE = "history.jsonl"
LAST_CHECKPOINT = "checkpoint_last.pt"
BEST_CHECKPOINT = "checkpoint_best.pt"
TEST_METRICS_FILE = "test_metrics.json"
TEMPERATURE_FILE = "temperature.json"
PLOTS_DIR = "plots"
CALIBRATORS_DIR = "calibrators"
EVAL_METRICS_FILE = "metrics.json"

CHECKPOINTS = {"best": BEST_CHECKPOINT, "last": LAST_CHECKPOINT}
CHECKPOINT_FILES = (LAST_CHECKPOINT, BEST_CHECKPOINT)
RUN_FILES = (CONFIG_FILE, HISTORY_FILE, *CHECKPOINT_FILES, TEST_METRICS_FILE)
# The sections every saved config.yaml holds (the training tools write every key).
CONFIG_SECTIONS = ("name", "data", "model", "loss", "train", "eval")


class Run:
    """One run folder: every file it may hold, each read by one typed reader and written by one
    atomic writer (see the module docstring), and, once loaded (:func:`load_run`,
    :meth:`load`), its network ready to evaluate. Only the main process writes.

    ``Run(path)`` is the folder alone (it need not exist yet): its files, their readers and
    writers. Loading fills in the rest.

    Attributes:
        path: the run folder as given.
        checkpoint: the checkpoint file read (None before loading).
        config: the run's resolved config (with the overrides given when loaded; read from
            ``config.yaml`` on first use otherwise).
        model: the network with the checkpoint's weights, in eval mode, on ``device``.
        device, precision: where and in which precision (``none``/``bf16``/``fp16``) to run it
            (:meth:`trained_precision` is the one it was trained at).
        family, score_metric: the task family (``segmentation``/``classification``) and its
            headline metric (``miou``/``acc``), from the registry of ``data.name``.
        class_names: K names. ``protocol``: the evaluation protocol (segmentation), else None.
        temperature: the temperature fitted on validation (``temperature.json``), None if none.
        epoch: the epoch the checkpoint holds. ``task``: the task (splits), with ``with_data``.
        extra: what else the loader knows (an ensemble's members: ``extra["ensemble"]``).
    """

    def __init__(self, path: str | Path, checkpoint: Path | None = None,
                 config: Config | None = None, model: nn.Module | None = None,
                 device: torch.device | None = None,
                 precision: str = "none", family: str | None = None,
                 score_metric: str | None = None, class_names: list[str] | None = None,
                 protocol: EvalProtocol | None = None, temperature: float | None = None,
                 epoch: int | None = None, task: Task | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.checkpoint = checkpoint
        self._config = config
        self.model, self.device, self.precision = model, device, precision
        self.family, self.score_metric = family, score_metric
        self.class_names = list(class_names) if class_names is not None else []
        self.protocol, self.temperature, self.epoch, self.task = protocol, temperature, epoch, task
        self.extra = dict(extra) if extra is not None else {}

    @property
    def config(self) -> Config:
        """The run's resolved config: the one loaded, else ``config.yaml`` read on first use
        (:meth:`read_config`)."""
        if self._config is None:
            self._config = self.read_config()
        return self._config

    @config.setter
    def config(self, value: Config) -> None:
        self._config = value

    def replace(self, **changes: Any) -> Run:
        """A copy with ``changes`` (e.g. an ensemble's ``model`` and ``extra``)."""
        other = copy.copy(self)
        for key, value in changes.items():
            setattr(other, key, value)
        return other

    def __repr__(self) -> str:
        loaded = f", checkpoint={self.checkpoint.name!r}" if self.checkpoint is not None else ""
        return f"Run({str(self.path)!r}{loaded})"

    @property
    def folder(self) -> Path:
        """Where the files are read and written: the folder of the checkpoint read (symbolic
        links resolved, so that nothing is written through a link), else :attr:`path`."""
        if self.checkpoint is None:
            return self.path
        real = Path(self.checkpoint).resolve().parent
        return self.path if self.path.resolve() == real else real

    @property
    def run(self) -> Run:
        """Deprecated: the run itself (``LoadedRun.run`` of earlier versions, when the loaded
        network and the folder's files were two objects)."""
        return self

    config_file = property(lambda self: self.folder / CONFIG_FILE)
    history_file = property(lambda self: self.folder / HISTORY_FILE)
    last = property(lambda self: self.folder / LAST_CHECKPOINT)
    best = property(lambda self: self.folder / BEST_CHECKPOINT)
    test_metrics = property(lambda self: self.folder / TEST_METRICS_FILE)
    temperature_file = property(lambda self: self.folder / TEMPERATURE_FILE)
    plots = property(lambda self: self.folder / PLOTS_DIR)
    calibrators = property(lambda self: self.folder / CALIBRATORS_DIR)

    def checkpoint_file(self, which: str) -> Path:
        """The file of checkpoint ``which`` (``best`` or ``last``)."""
        return self.folder / CHECKPOINTS[which]

    @property
    def fits(self) -> FitStore:
        """The run's own fits (``calibrators/``: calibrators, drift calibrators, conformal
        thresholds, entropy limits), which ``predict_seg`` and ``export`` use; each reused
        only when its :class:`~cals_seg.utils.fits.FitKey` is the use's."""
        return FitStore(self.calibrators)

    def calibrator_file(self, name: str) -> Path:
        """Where the post-hoc calibrator ``name`` fitted on validation is saved."""
        return self.fits.calibrator(name)

    def eval_dir(self, split: str) -> Path:
        """The default output folder of ``eval_seg`` on ``split``."""
        return self.folder / f"eval_{split}"

    @staticmethod
    def eval_metrics(folder: str | Path) -> Path:
        """The metrics file ``eval_seg`` writes into ``folder``."""
        return Path(folder) / EVAL_METRICS_FILE

    # ------------------------------------------------------------------------- state
    def holds_run(self) -> list[str]:
        """The files of a run found here (empty for a new or empty folder)."""
        return [name for name in RUN_FILES if (self.folder / name).exists()]

    def has_config(self) -> bool:
        return self.config_file.is_file()

    def finished(self) -> bool:
        """The run was tested (its ``test_metrics.json`` exists)."""
        return self.test_metrics.is_file()

    def check_start(self, resume: bool) -> None:
        """Before training: a new run needs a folder without a run in it (``RunExistsError``
        otherwise), a resumed one a resumable folder (:meth:`check_resumable`). A run stopped
        before its first checkpoint (a data error in epoch 1, Ctrl-C) starts again, with or
        without --resume, instead of asking for the folder to be deleted."""
        if self.config_file.is_file() and not any(p.is_file() for p in (self.last, self.best,
                                                                     self.test_metrics)):
            self.history_file.unlink(missing_ok=True)
            return
        if resume:
            self.check_resumable()
        elif self.holds_run():
            raise RunExistsError(
                f"{self.path} already holds a run ({', '.join(self.holds_run())}). Continue it "
                f"with --resume {self.path}, or choose another name (--set name=...)."
            )

    def check_resumable(self) -> None:
        """Refuse to resume from a folder without ``config.yaml`` and ``checkpoint_last.pt``.

        Raises:
            FileNotFoundError: naming what is missing and what to do instead.
        """
        if self.config_file.is_file() and (self.last.is_file() or not (
                self.best.is_file() or self.test_metrics.is_file())):
            return  # a checkpoint to continue from, or none yet: the run starts again
        found = self.holds_run()
        what = ("does not exist" if not self.path.exists() else
                "holds no run" if not found else
                f"has no {LAST_CHECKPOINT} (it holds {', '.join(found)}: a finished run keeps "
                f"only {BEST_CHECKPOINT})")
        raise MissingPathError(
            f"--resume {self.path}: the folder {what}, so there is nothing to continue; start a "
            "new run without --resume (or name the run directory, runs/<name>)."
        )

    # ------------------------------------------------------------------------- files
    def read_config(self, overrides: list[str] | tuple[str, ...] = (),
                    method: str | None = None, saved: Mapping[str, Any] | None = None) -> Config:
        """The run's resolved ``config.yaml`` (``overrides`` on top), checked first as a saved
        run's config (:meth:`check_config_file`; ``saved``: the checkpoint's own copy)."""
        self.check_config_file(saved)
        return load_config(self.config_file, list(overrides), method)

    def config_fix(self) -> str:
        """The way out of a damaged ``config.yaml``."""
        return (f"restore the run's {CONFIG_FILE} (a copy of the run, or the config it was "
                f"trained with: tools/eval_seg.py CONFIG --checkpoint {self.best}), or retrain")

    def check_config_file(self, saved: Mapping[str, Any] | None = None,
                          checkpoint: str | Path | None = None) -> None:
        """Refuse a ``config.yaml`` that is not a whole saved config: empty, not YAML (cut
        short, random bytes), not a mapping, without a section every saved run writes
        (:data:`CONFIG_SECTIONS`), or (``saved``: the copy of the config a checkpoint holds)
        without a key that copy has: the file was cut short or edited. Nothing when the file
        does not exist (the callers say what is missing).

        Raises:
            RunFileError: one line naming the file, what is missing and the way out.
        """
        import yaml

        path, fix = self.config_file, self.config_fix()
        if not path.is_file():
            return
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise RunFileError(path, f"cannot be read ({err.strerror})", fix) from None
        if not raw.strip():
            raise RunFileError(path, "is empty (the write that made it did not finish)", fix)
        try:
            data = _parsed_config(raw.decode("utf-8-sig"))
        except UnicodeDecodeError:
            raise RunFileError(path, "is not YAML (it holds binary bytes)", fix) from None
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or type(err).__name__
            raise RunFileError(path, f"is not valid YAML ({problem}: cut short or edited?)",
                               fix) from None
        except RecursionError:
            raise RunFileError(path, "is not a config (nested too deep)", fix) from None
        if not isinstance(data, dict):
            raise RunFileError(path, f"holds a YAML {type(data).__name__}, not a config", fix)
        missing = [k for k in CONFIG_SECTIONS if k not in data]
        where = f" that {Path(checkpoint).name}'s own copy of the config holds" \
            if checkpoint is not None else ""
        if isinstance(saved, Mapping):  # keys this version still has (one retired since the
            # checkpoint was written is not required)
            known = config_to_dict(Config())
            missing = [k for k in _leaf_keys(saved) if not _has_key(data, k)
                       and _has_key(known, k)]
            where = where or " that the checkpoint's own copy of the config holds"
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more"
                                              if len(missing) > 4 else "")
            where = where or ", which every saved run writes"
            raise RunFileError(path, f"is damaged: it lacks {shown}{where} (cut short or "
                               "edited)", fix)

    def history(self) -> list[dict[str, Any]]:
        """The lines of ``history.jsonl`` (one per finished epoch), those that are whole
        records: a line that is not a JSON object with an integer ``epoch >= 0`` is left out
        with one warning naming it (the history is a log; the checkpoints hold the run)."""
        records, problems = self.read_history()
        if problems:
            warnings.warn(self._history_problems(problems, "left out"), stacklevel=2)
        return records

    def read_history(self) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
        """``(whole records, [(line number, what is wrong), ...])`` of ``history.jsonl``
        (:func:`~cals_seg.utils.io.read_jsonl_lines`).

        Raises:
            RunFileError: the file cannot be read or is not text.
        """
        return read_jsonl_lines(self.history_file, _is_epoch_record)

    def _history_problems(self, problems: list[tuple[int, str]], done: str) -> str:
        lines = "; ".join(f"line {i} is {why}" for i, why in problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        return f"{self.history_file}: {lines}{more}: {done}"

    def append_history(self, record: dict[str, Any]) -> None:
        """Append one line and fsync it, so it survives before the checkpoint is written."""
        with self.history_file.open("a") as f:
            f.write(json.dumps(json_safe(record)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def trim_history(self, next_epoch: int) -> None:
        """Keep the lines of the epochs before ``next_epoch`` (a crash after an epoch's line
        and before its checkpoint leaves a line that the resumed run writes again). A line
        that is not a whole record (torn by a crash while it was written, or edited) is dropped
        with a one-line notice; the complete lines the checkpoint covers are kept."""
        records, problems = self.read_history()
        kept = [h for h in records if h["epoch"] < next_epoch]
        if problems:
            print(f"notice: {self._history_problems(problems, 'dropped')}; kept the {len(kept)} "
                  f"whole line(s) of the {next_epoch} epoch(s) the checkpoint holds.",
                  file=sys.stderr, flush=True)
        lost = sorted(set(range(next_epoch)) - {h["epoch"] for h in kept})
        if lost and self.history_file.is_file():  # a file emptied or cut: said, not refused
            shown = ", ".join(str(e + 1) for e in lost[:5]) + (", ..." if len(lost) > 5 else "")
            print(f"notice: {self.history_file} has no line for epoch(s) {shown} of the "
                  f"{next_epoch} the checkpoint holds (emptied or cut); the training goes on, "
                  "and their curves lack those points.", file=sys.stderr, flush=True)
        text = "".join(json.dumps(h) + "\n" for h in kept)
        atomic_write(self.history_file, lambda tmp: Path(tmp).write_text(text))

    def repair_best(self, last: dict[str, Any]) -> None:
        """A crash between ``checkpoint_last.pt`` and ``checkpoint_best.pt`` of an improving
        epoch leaves an older best: the last checkpoint IS the best one then, so copy it."""
        if last.get("best_epoch") != last.get("epoch"):
            return
        if self.best.is_file():
            try:
                if load_checkpoint(self.best).get("epoch") == last["epoch"]:
                    return
            except CheckpointError as err:  # damaged: remade from the same epoch's state
                print(f"notice: {self.best} {err.problem or 'cannot be read'}; rewritten from "
                      f"{self.last.name}, which holds the same (best) epoch.", file=sys.stderr,
                      flush=True)
        save_checkpoint(last, self.best)

    def checkpoint_fix(self, file: str | Path) -> str:
        """The way out of an unreadable checkpoint ``file``: the run's other checkpoint (and
        the flag that selects it), or retraining."""
        file = Path(file)
        other = {BEST_CHECKPOINT: LAST_CHECKPOINT, LAST_CHECKPOINT: BEST_CHECKPOINT}.get(file.name)
        if other is None or not (file.parent / other).is_file():
            return "retrain the run (it has no other checkpoint)"
        which = "last" if other == LAST_CHECKPOINT else "best"
        if which == "best":  # the resume point is gone: the best epoch's state is whole
            return (f"use the best one: --checkpoint best (eval_seg, export), or give "
                    f"{file.parent / other}; to resume from the best epoch, copy {other} over "
                    f"{file.name}; or retrain")
        return (f"use the last one: --checkpoint last (eval_seg, export), or give "
                f"{file.parent / other} (predict_seg); or retrain")

    def read_checkpoint(self, which: str | Path = "best", map_location: Any = "cpu"
                        ) -> dict[str, Any]:
        """Checkpoint ``which`` (``best``, ``last`` or a file) read safely
        (:func:`~cals_seg.utils.io.load_checkpoint`), refused in one line naming the other
        checkpoint and the flag that selects it."""
        file = self.checkpoint_file(which) if which in CHECKPOINTS else Path(which)
        return load_checkpoint(file, map_location, fix=self.checkpoint_fix(file))

    def test_metrics_fix(self) -> str:
        return (f"delete it and run tools/train_seg.py --resume {self.path} to test the best "
                f"checkpoint again (it needs {LAST_CHECKPOINT}), or tools/eval_seg.py "
                f"{self.path} for the same metrics in {self.eval_dir('test')}")

    def read_test_metrics(self) -> dict[str, Any]:
        """``test_metrics.json``, validated: a JSON object with the ``pre_ts`` metrics (an
        object), ``post_ts`` an object or null, and a finite ``temperature > 0`` when present.

        Raises:
            RunFileError: one line naming the file, what is wrong and the way out.
        """
        metrics = read_json_file(self.test_metrics, self.test_metrics_fix(), "test metrics",
                                 {"pre_ts": of_type(dict, "an object of metrics")})
        if metrics.get("post_ts") is not None and not isinstance(metrics["post_ts"], dict):
            raise RunFileError(self.test_metrics, "post_ts: expected an object of metrics or "
                               "null", self.test_metrics_fix())
        if "temperature" in metrics and finite_number(0, above=True)(metrics["temperature"]):
            raise RunFileError(self.test_metrics, "temperature: expected a finite number > 0",
                               self.test_metrics_fix())
        return metrics

    def write_test_metrics(self, metrics: Mapping[str, Any]) -> None:
        write_json(self.test_metrics, metrics)

    def write_temperature(self, temperature: float, split: str = "val") -> None:
        write_json(self.temperature_file, {"temperature": temperature, "fitted_on": split})

    def temperature_fix(self) -> str:
        return (f"refit it: with the run's validation data readable, run the command again (it "
                f"refits a damaged {TEMPERATURE_FILE}), or tools/eval_seg.py {self.path}; or "
                "retrain")

    def read_temperature(self, remake: Callable[[], float | None] | None = None,
                         save: bool = True) -> float | None:
        """The temperature fitted on validation (``temperature.json``), None when the run has
        none.

        A damaged file (empty, truncated, random bytes, not an object, no ``temperature``, not
        a finite number > 0) is remade when ``remake`` can: ``remake()`` refits T on the
        validation split (None when it cannot be read), the file is rewritten (``save``) and a
        one-line notice says so. Otherwise it is refused.

        Raises:
            RunFileError: a damaged file that cannot be remade, naming the way out.
        """
        if not self.temperature_file.is_file():
            return None
        try:
            saved = read_json_file(self.temperature_file, self.temperature_fix(),
                                   "a fitted temperature",
                                   {"temperature": finite_number(0, above=True)})
        except RunFileError as err:
            temperature = remake() if remake is not None else None
            if temperature is None:
                raise
            if save:
                self.write_temperature(temperature)
            where = "rewritten" if save else "not saved: the evaluation protocol is overridden"
            print(f"notice: {self.temperature_file} {err.problem}; refitted on the validation "
                  f"split: T = {temperature:.4f} ({where}).", file=sys.stderr, flush=True)
            return temperature
        return float(saved["temperature"])

    @staticmethod
    def read_eval_metrics(folder: str | Path, fix: str | None = None) -> dict[str, Any]:
        """``folder/metrics.json`` written by ``eval_seg``, validated (a JSON object with the
        ``pre_ts`` metrics).

        Raises:
            RunFileError: one line naming the file and the way out (default: evaluate again).
        """
        path = Run.eval_metrics(folder)
        fix = fix or f"delete it and run tools/eval_seg.py again with --out {Path(folder)}"
        return read_json_file(path, fix, "an evaluation's metrics",
                              {"pre_ts": of_type(dict, "an object of metrics")})

    def trained_precision(self) -> str | None:
        """The precision the run was trained at (``none``/``bf16``/``fp16``), from its history
        (else its test metrics: an imported run); None if unknown. Its test pass may have run at
        another, the inference precision (``test_metrics.json["precision"]``)."""
        history = self.history() if self.history_file.is_file() else []
        if history and history[-1].get("precision"):
            return history[-1]["precision"]
        if self.test_metrics.is_file():  # any JSON object (an imported run's may hold no more)
            return read_json_file(self.test_metrics, self.test_metrics_fix(),
                                  "test metrics").get("precision")
        return None

    def drop_checkpoints(self, keep: str) -> None:
        """Delete the checkpoints a finished run no longer needs: ``keep="all"`` none,
        ``"best"`` the last one, anything else both."""
        drop = {"all": [], "best": [LAST_CHECKPOINT]}.get(keep, list(CHECKPOINT_FILES))
        for name in drop:
            (self.folder / name).unlink(missing_ok=True)

    # ------------------------------------------------------------------------- loading
    @staticmethod
    def resolve(path: str | Path, checkpoint: str = "best",
                need_config: bool = True) -> tuple[Run, Path]:
        """``(run, checkpoint file)`` of a run folder or of a checkpoint inside one (see
        :func:`resolve_run`)."""
        folder, file = resolve_run(path, checkpoint, need_config)
        return Run(folder), file

    def load(self, checkpoint: str = "best", **kwargs: Any) -> Run:
        """This run loaded for evaluation or prediction (:func:`load_run`)."""
        return load_run(self.path, checkpoint, **kwargs)

    # ------------------------------------------------------------------------- the network
    def _loaded(self, what: str) -> None:
        if self.model is None:
            raise UserError(f"{self.path}: {what} needs the run loaded (cals_seg.load_run("
                            f"{str(self.path)!r}) or Run.load()).")

    @property
    def inference(self) -> Inference:
        """The model, device, precision and protocol as one
        :class:`~cals_seg.evaluation.stream.Inference`."""
        self._loaded("inference")
        return Inference(self.model, self.device, self.precision, self.protocol)

    def temperature_for(self, given: float | None = None) -> float:
        """The temperature a prediction divides the logits by: ``given`` (``--temperature``),
        else the one fitted on validation, else 1 with a warning that the confidences are not
        calibrated.

        Raises:
            UserError: a given temperature that is not a number > 0.
        """
        temperature = given
        if temperature is None:
            temperature = self.temperature
            if temperature is None:
                warnings.warn(f"{self.path} has no {self.temperature_file.name} (the run did "
                              "not finish, or eval.temperature_scaling is false): confidences "
                              "are not calibrated (T = 1).", stacklevel=2)
                temperature = 1.0
        if not temperature > 0:
            raise UserError(f"--temperature: expected a number > 0, got {temperature}.")
        return float(temperature)

    def validation_set(self) -> tuple[Any, str | None]:
        """``(the validation split, None)``, from the task when built, else read without the
        model (nothing generated or downloaded); ``(None, why it cannot be read)``."""
        if self.task is not None:
            return self.task.val_set, None
        root = Path(self.config.data.root)
        if not root.is_dir():
            return None, f"data.root {root} does not exist"
        try:
            from cals_seg.tasks.segmentation import segmentation_splits

            return segmentation_splits(self.config)["val"], None
        except (OSError, UserError, ValueError) as err:
            return None, short_text(str(err) or type(err).__name__)

    def refit_temperature(self) -> float | None:
        """T fitted on the validation split (as the training's test pass fits it), or None
        when the split cannot be read or holds no image."""
        from torch.utils.data import DataLoader

        from cals_seg.evaluation.engine import fit_post_temperature
        from cals_seg.evaluation.stream import eval_collate

        val, _ = self.validation_set()
        if val is None or len(val) == 0:
            return None
        loader = DataLoader(val, batch_size=self.config.eval.batch_size, shuffle=False,
                            collate_fn=eval_collate)
        try:
            return fit_post_temperature(self.inference, loader, self.config.data.ignore_index)
        except (OSError, UserError) as err:
            print(f"warning: the validation split of {self.path} cannot be read to refit T "
                  f"({short_text(str(err))}).", file=sys.stderr, flush=True)
            return None

    def meters(self) -> Callable[[], dict[str, Any]]:
        """The factory of the task's test meter sets (``eval.n_bins`` bins)."""
        task, n_bins = self.task, self.config.eval.n_bins
        return lambda: task.meters(n_bins, test=True)

    def test(self, loader: Any, *, temperature: float | None = None,
             calibrators: Mapping[str, Any] | None = None,
             progress: bool | None = None) -> dict[str, Any]:
        """The one test pass (:func:`cals_seg.evaluation.engine.run_test_pass`) of this run's
        model over ``loader`` with the task's test meters."""
        if progress is None:
            progress = self.config.train.progress
        return run_test_pass(self.inference, loader, self.meters(), temperature, calibrators,
                             progress)


# Deprecated: the loaded run was a second class; it is the one :class:`Run` now.
LoadedRun = Run


@functools.lru_cache(maxsize=8)
def _parsed_config(text: str) -> Any:
    """``yaml.safe_load(text)``, remembered for the same text: a command checks the run's
    config.yaml twice (as a saved config, then against the checkpoint's own copy), and
    PyYAML's pure-Python parser is most of each check. Read only (shared by the callers)."""
    import yaml

    return yaml.safe_load(text)


def _is_epoch_record(record: Mapping[str, Any]) -> bool:
    """A history line the readers can use: an integer ``epoch >= 0``."""
    epoch = record.get("epoch")
    return isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0


def _leaf_keys(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of the sections of a saved config (a section's free-form mappings,
    e.g. ``loss.params``, count as one key)."""
    keys = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and not prefix:
            keys += _leaf_keys(value, f"{dotted}.")
        else:
            keys.append(dotted)
    return keys


def _has_key(tree: Mapping[str, Any], dotted: str) -> bool:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def resolve_run(path: str | Path, checkpoint: str = "best",
                need_config: bool = True) -> tuple[Path, Path]:
    """``(run folder, checkpoint file)`` of a run folder or of a checkpoint inside one.

    Args:
        path: a run folder, or a checkpoint file in one.
        checkpoint: for a folder, ``best`` (``checkpoint_best.pt``, else ``checkpoint_last.pt``
            of an interrupted run) or ``last``.
        need_config: the folder must hold the run's ``config.yaml``.

    Raises:
        FileNotFoundError: no such path, no checkpoint, or no ``config.yaml`` next to it.
    """
    path = Path(path)
    if checkpoint not in CHECKPOINTS:
        raise UserError(f"checkpoint: expected one of {list(CHECKPOINTS)}, got {checkpoint!r}.")
    if path.is_dir():
        order = [CHECKPOINTS[checkpoint], *(f for f in reversed(CHECKPOINT_FILES)
                                             if f != CHECKPOINTS[checkpoint])]
        found = [path / name for name in order if (path / name).is_file()]
        if checkpoint == "last":
            found = found[:1] if found and found[0].name == LAST_CHECKPOINT else []
        if not found:
            wanted = CHECKPOINTS[checkpoint] if checkpoint == "last" else " or ".join(order)
            raise MissingPathError(
                f"{path} holds no checkpoint ({wanted}); give a run folder written by "
                "tools/train_seg.py or tools/train_cls.py, or a checkpoint file."
            )
        run, file = path, found[0]
    elif path.is_file():
        run, file = path.parent, path
    else:
        raise MissingPathError(f"{path} does not exist; give a run folder or a checkpoint.")
    if need_config and not Run(run).has_config():
        raise MissingPathError(
            f"{run} has no {CONFIG_FILE}: the run's resolved config is needed to rebuild the "
            "model and its normalisation (the training tools write it next to the checkpoints)."
        )
    return run, file


def load_weights(model: Any, state: dict[str, Any], checkpoint: Path, config: Path,
                 num_classes: int) -> None:
    """Load ``state["model"]`` into ``model`` after checking the class count.

    Raises:
        CheckpointError: another class count or another architecture than the config's, naming
            both files.
    """
    saved = state.get("num_classes")
    if saved is not None and saved != num_classes:
        raise CheckpointError(
            f"{checkpoint} was trained with {saved} classes, but {config} has "
            f"data.num_classes={num_classes}; use the config the run was trained with."
        )
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:  # another architecture: the user's input, not a bug
        raise CheckpointError(
            f"{checkpoint} does not fit the model of {config} ({str(err).splitlines()[0]}); use "
            "the config the run was trained with."
        ) from None


def load_run(
    path: str | Path,
    checkpoint: str = "best",
    *,
    device: str | None = None,
    amp: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    family: str | None = None,
    with_data: bool = False,
    config: str | Path | None = None,
    method: str | None = None,
    trust_code: bool | None = None,
) -> Run:
    """Load a trained run for evaluation or prediction (see the module docstring).

    Args:
        path: a run folder, or a checkpoint file in one.
        checkpoint: ``best`` or ``last`` (for a folder).
        device: ``auto``/``cpu``/``cuda[:i]``; default: the run's ``train.device``.
        amp: ``auto``/``none``/``bf16``/``fp16``; default: the run's ``train.amp``.
        overrides: ``KEY=VALUE`` items applied to the run's config (``--set``).
        family: refuse a run of another task family (e.g. ``segmentation`` for predict_seg).
        with_data: also build the task (the three splits; reads the data).
        config, method: another config file (and setup method) instead of the run's own
            ``config.yaml`` (the older ``CONFIG --checkpoint FILE`` form of the tools).
        trust_code: allow the run's ``model.factory`` to import code outside the known model
            builders (:mod:`cals_seg.models.consent`). None: the enclosing command's
            ``--trust-code`` (:func:`~cals_seg.models.consent.code_consent`), else consent
            remembered on this machine for the folder, else refused before any import. A
            ``config`` given here is the caller's own file: its factory is allowed.

    Raises:
        FileNotFoundError, CheckpointError, ConfigError, ValueError: with the file or key and
            the fix.
    """
    folder, file = resolve_run(path, checkpoint, need_config=config is None)
    config_file = Path(config) if config is not None else Run(folder).config_file
    given = [f"train.{key}={value}" for key, value in (("device", device), ("amp", amp))
             if value is not None]  # checked by the rules of the keys they replace
    if config is None:  # the run's own config.yaml: checked as a saved run's first
        cfg = Run(folder).read_config([*overrides, *given], method)
    else:
        cfg = load_config(config_file, [*overrides, *given], method)
    with code_consent(_consent_for(cfg, config_file, folder, trust_code, config is not None)):
        return _load(cfg, folder, file, config_file, with_data, family, device, amp,
                     own_config=config is None, overridden=bool(overrides))


def _consent_for(cfg: Config, config_file: Path, folder: Path, trust_code: bool | None,
                 own_config: bool) -> bool:
    """True when the run's ``model.factory`` may be imported (refused otherwise, before any
    import, by :func:`~cals_seg.models.consent.check_consent`)."""
    from cals_seg.models.consent import check_consent, consent_given

    decision = True if own_config else trust_code if trust_code is not None else consent_given()
    factory = cfg.model.factory if cfg.model.arch == "external" else None
    if isinstance(factory, str):
        check_consent(factory, config_file, bool(decision), folder)
    return True


def _load(cfg: Config, folder: Path, file: Path, config_file: Path, with_data: bool,
          family: str | None, device: str | None, amp: str | None, own_config: bool = True,
          overridden: bool = False) -> Run:
    """:func:`load_run` once the config is read and its factory allowed."""
    import torch

    from cals_seg.config.checks import check_config
    from cals_seg.tasks import TASK_TYPES, build_task, task_family
    from cals_seg.tasks.base import DATASETS, class_names_or_default
    from cals_seg.utils.precision import resolve_amp, resolve_device

    try:
        check_config(cfg, reads_data=with_data, writes_run=False)  # every key, before any work
    except UserError as err:  # a value given as device= / amp= is named as the tools' flag
        raise _as_flag(err, device, amp) from None
    found = task_family(cfg)
    if family is not None and found != family:
        tools = "tools/eval_cls.py or tools/predict_cls.py" if found == "classification" \
            else "tools/eval_seg.py or tools/predict_seg.py"
        raise UserError(f"{folder} is a {found} run ({cfg.data.name!r}); this command needs a "
                        f"{family} run: use {tools} for it.")
    if not with_data and found != "segmentation" and \
            DATASETS[cfg.data.name].kind != "classification":  # text
        raise UserError(f"{folder} is a text run: its vocabulary is built from the training "
                        "split, so loading it needs its data (with_data=True).")
    # the checkpoint read, and a damaged one or a config.yaml cut short refused, before the
    # network is built and the data read
    run = Run(folder)
    state = run.read_checkpoint(file)
    if own_config and isinstance(state.get("config"), Mapping):  # cut short: not "another" one
        run.check_config_file(state["config"], file)
    task = None
    if with_data:
        task = build_task(cfg)
        model, protocol, names = task.model, task.protocol, task.class_names
    elif found == "segmentation":
        from cals_seg.tasks.segmentation import build_model, class_names, eval_protocol

        model = build_model(cfg, encoder_weights=None)  # every weight comes from the checkpoint
        protocol, names = eval_protocol(cfg, model), class_names(cfg)
    else:  # image classification: the timm model alone
        from cals_seg.models.classification import build_classification_model

        model = build_classification_model(cfg.model.encoder_name, cfg.data.num_classes, None,
                                           **cfg.model.params)
        protocol, names = None, None  # the names the checkpoint records, read below
    if names is None:
        names = class_names_or_default(cfg.data.class_names or state.get("class_names"),
                                       cfg.data.num_classes)
    load_weights(model, state, file, config_file, cfg.data.num_classes)
    dev = resolve_device(cfg.train.device)
    # auto: float32 on every CPU for an evaluation, a prediction or an export (bf16 only when
    # asked): the same confidences whatever CPU computes them
    precision = resolve_amp(cfg.train.amp, dev, warn=False, inference=True)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    loaded = Run(
        folder, checkpoint=file, config=cfg, model=model.to(dev).eval(), device=dev,
        precision=precision, family=found, score_metric=TASK_TYPES[found].score_metric,
        class_names=list(names), protocol=protocol, epoch=state.get("epoch"), task=task,
    )
    # a damaged temperature.json is refitted on the validation split when it can be read
    loaded.temperature = run.read_temperature(loaded.refit_temperature, save=not overridden)
    return loaded


def _as_flag(err: UserError, device: str | None, amp: str | None) -> UserError:
    """``err`` about ``train.device`` / ``train.amp`` when the value came from the ``device`` /
    ``amp`` argument: the message names ``--device`` / ``--amp`` (what the user typed, e.g.
    ``predict_seg RUN IMAGES --device cuda``), not a config key they never wrote."""
    message = str(err)
    for key, flag, given in (("train.device", "--device", device), ("train.amp", "--amp", amp)):
        if given is not None and message.startswith(f"{key}:"):
            message = message.replace(f"--set {key}=", f"{flag} ").replace(key, flag)
            return type(err)(message)
    return err


__all__ = [
    "BEST_CHECKPOINT",
    "CALIBRATORS_DIR",
    "CHECKPOINTS",
    "CHECKPOINT_FILES",
    "CONFIG_FILE",
    "EVAL_METRICS_FILE",
    "HISTORY_FILE",
    "LAST_CHECKPOINT",
    "LoadedRun",
    "PLOTS_DIR",
    "RUN_FILES",
    "Run",
    "TEMPERATURE_FILE",
    "TEST_METRICS_FILE",
    "load_run",
    "load_weights",
    "resolve_run",
]
