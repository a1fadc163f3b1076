"""What every tool checks before any work, so that a mistake costs seconds, not an epoch: the
config's values (:func:`check_config`, which runs the one rule table of
:mod:`cals_seg.config.rules`), the metric the best epoch is chosen by (:func:`check_best_metric`)
and what a resume may change (:func:`check_resume`). The data are checked by
:mod:`cals_seg.data.checks`.

Each error names the config key and how to get what was wanted.
"""

from __future__ import annotations

from typing import Any

from cals_seg.config.rules import (
    KEY_GROUPS,
    changed_keys,
    check_all,
    flatten_config,
    keys_of,
)
from cals_seg.config.schema import Config, ConfigError, config_to_dict

# Keys a resume may change (KEY_GROUPS); any other difference is refused. ``train.epochs``
# rebuilds the learning-rate schedule for the new length (``trainer.restore_training_state``).
RESUMABLE_KEYS = keys_of("resumable", "neutral")


def check_config(cfg: Config, reads_data: bool = False, writes_run: bool = False) -> None:
    """Refuse a config whose values cannot give a sensible run (before any data or model work):
    every rule of :mod:`cals_seg.config.rules`, each run once, in its order: the range of every
    key (``RULES``), the rules between keys and of what consumes a value (``CROSS_RULES``: the
    dataset, device and model names, the evaluation protocol, the class names, the best-epoch
    direction, the loss parameters, the loggers), then the paths.

    Args:
        cfg: the resolved config.
        reads_data: the command reads the data (its paths must exist); off: the values only.
        writes_run: the command writes a run folder (``output_dir`` must be writable).

    Raises:
        ConfigError: naming the key, the value, what is allowed and the fix.
    """
    check_all(cfg, reads_data, writes_run)


def check_resume(cfg: Config, saved: dict[str, Any], where: Any) -> list[str]:
    """The keys a resume changes; refuse any but :data:`RESUMABLE_KEYS`.

    Args:
        cfg: the config of the resumed run (the run's own config and ``--set`` overrides).
        saved: the config stored in the checkpoint.
        where: the checkpoint, for the message.

    Raises:
        ConfigError: a key that a resume cannot change (the model, the loss, the data ...).
    """
    new = config_to_dict(cfg)
    changed = changed_keys(saved, new)
    refused = [k for k in changed if k not in RESUMABLE_KEYS]
    if refused:
        old, now = flatten_config(saved), flatten_config(new)
        shown = ", ".join(f"{k}: {old[k]!r} -> {now[k]!r}" for k in refused)
        raise ConfigError(
            f"--resume: {where} was trained with other settings ({shown}); a resume may only "
            f"change {list(RESUMABLE_KEYS)}. To train with the new settings, start a new run "
            "without --resume (--set name=...)."
        )
    return changed


def check_best_metric(task: Any, best_metric: str, n_bins: int) -> None:
    """Refuse a ``train.best_metric`` the task's validation meters do not compute (found by
    feeding them one dummy prediction, so no epoch is spent to find out)."""
    import torch

    shape = (1, task.num_classes, 1, 1) if task.family == "segmentation" else (1, task.num_classes)
    meters = task.meters(n_bins)
    for meter in meters.values():
        meter.update(torch.zeros(shape), torch.zeros((1, *shape[2:]), dtype=torch.long))
    names = sorted(k for m in meters.values() for k, v in m.compute().items()
                   if isinstance(v, int | float) and not isinstance(v, bool))
    if best_metric not in names:
        raise ConfigError(
            f"train.best_metric: the validation split has no metric {best_metric!r}; choose one "
            f"of {names}."
        )


def bounded_input(cfg: Config) -> bool:
    """Whether the evaluation's network input is bounded whatever the image size (resized or
    tiled): then no image is too large to evaluate
    (:func:`cals_seg.data.checks.warn_large_images`)."""
    return cfg.eval.mode == "slide" or cfg.eval.resize is not None


__all__ = ["KEY_GROUPS", "RESUMABLE_KEYS", "bounded_input", "changed_keys", "check_best_metric",
           "check_config", "check_resume"]
