"""Load a trained run: the one place where a run folder becomes a model ready to evaluate.

Every tool that reads a finished (or interrupted) run calls :func:`load_run`::

    run = load_run("runs/synthetic_deeplabv3_cals_alm")        # checkpoint_best.pt
    logits = run.model(x.to(run.device))                        # eval mode, on run.device
    probs = (logits / run.temperature).softmax(dim=1)           # T fitted on validation

It resolves the folder (or a checkpoint inside one), reads the run's own resolved
``config.yaml`` (``overrides`` on top, e.g. another evaluation protocol), checks the checkpoint
against it (class count, architecture) with messages that name the files, and returns the
config, the model, the device, the precision, the evaluation protocol, the class names, the task
family and its headline metric, and the fitted temperature. ``with_data=True`` also builds the
task (its three splits), which needs the data on disk; without it (predicting on new images,
exporting) nothing but the run folder is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cals_seg.config.schema import Config, load_config
from cals_seg.errors import MissingPathError, UserError
from cals_seg.runs.folder import CHECKPOINT_FILES, RunDir
from cals_seg.utils.io import CheckpointError, load_checkpoint

CHECKPOINTS = {"best": "checkpoint_best.pt", "last": "checkpoint_last.pt"}


@dataclass
class LoadedRun:
    """A run folder loaded by :func:`load_run`.

    Attributes:
        path: the run folder; ``checkpoint``: the checkpoint file read.
        config: the run's resolved config (with the overrides given).
        model: the network with the checkpoint's weights, in eval mode, on ``device``.
        device, precision: where and in which precision (``none``/``bf16``/``fp16``) to run it.
        family, score_metric: the task family (``segmentation``/``classification``) and its
            headline metric (``miou``/``acc``), from the registry of ``data.name``.
        class_names: K names. ``protocol``: the evaluation protocol (segmentation), else None.
        temperature: the temperature fitted on validation (``temperature.json``), None if none.
        epoch: the epoch the checkpoint holds. ``task``: the task (splits), with ``with_data``.
    """

    path: Path
    checkpoint: Path
    config: Config
    model: Any
    device: Any
    precision: str
    family: str
    score_metric: str
    class_names: list[str]
    protocol: Any = None
    temperature: float | None = None
    epoch: int | None = None
    task: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def run(self) -> RunDir:
        return RunDir(self.path)


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
            found = found[:1] if found and found[0].name == CHECKPOINTS["last"] else []
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
    if need_config and not (run / "config.yaml").is_file():
        raise MissingPathError(
            f"{run} has no config.yaml: the run's resolved config is needed to rebuild the model "
            "and its normalisation (the training tools write it next to the checkpoints)."
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
) -> LoadedRun:
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

    Raises:
        FileNotFoundError, CheckpointError, ConfigError, ValueError: with the file or key and
            the fix.
    """
    import torch

    from cals_seg.config.checks import check_config
    from cals_seg.tasks import TASK_TYPES, build_task, task_family
    from cals_seg.utils.precision import resolve_amp, resolve_device

    folder, file = resolve_run(path, checkpoint, need_config=config is None)
    config_file = Path(config) if config is not None else folder / "config.yaml"
    given = [f"train.{key}={value}" for key, value in (("device", device), ("amp", amp))
             if value is not None]  # checked by the rules of the keys they replace
    cfg = load_config(config_file, [*overrides, *given], method)
    try:
        check_config(cfg, reads_data=with_data, writes_run=False)  # every key, before any work
    except UserError as err:  # a value given as device= / amp= is named as the tools' flag
        raise _as_flag(err, device, amp) from None
    found = task_family(cfg)
    if family is not None and found != family:
        raise UserError(f"{folder} is a {found} run ({cfg.data.name!r}); this command needs a "
                         f"{family} run.")
    task = None
    if with_data:
        task = build_task(cfg)
        model, protocol, names = task.model, task.protocol, task.class_names
    elif found == "segmentation":
        from cals_seg.tasks.segmentation import build_model, class_names, eval_protocol

        model = build_model(cfg, encoder_weights=None)  # every weight comes from the checkpoint
        protocol, names = eval_protocol(cfg, model), class_names(cfg)
    else:
        raise UserError(f"{folder} is a {found} run: loading it needs its data (with_data).")
    state = load_checkpoint(file)
    load_weights(model, state, file, config_file, cfg.data.num_classes)
    dev = resolve_device(cfg.train.device)
    precision = resolve_amp(cfg.train.amp, dev, warn=False)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    return LoadedRun(
        path=folder, checkpoint=file, config=cfg, model=model.to(dev).eval(), device=dev,
        precision=precision, family=found, score_metric=TASK_TYPES[found].score_metric,
        class_names=list(names), protocol=protocol,
        temperature=RunDir(folder).read_temperature(), epoch=state.get("epoch"), task=task,
    )


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


__all__ = ["LoadedRun", "load_run", "load_weights", "resolve_run"]
