"""Everything checkable before a run trains, in one place, so that a mistake costs seconds, not
an epoch: the config's values (:func:`check_config`), the data (:func:`check_splits`) and what a
resume may change (:func:`check_resume`).

Each error names the config key and how to get what was wanted.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

from cals_seg.config.rules import check_all, check_class_names, check_eval_protocol, check_loggers
from cals_seg.config.schema import Config, ConfigError, config_to_dict
from cals_seg.data.voc_checks import check_voc_data
from cals_seg.errors import DataError
from cals_seg.losses import build_loss

# The direction of each validation metric a run can select its best epoch by.
LOWER_BETTER = ("ece", "aece", "mce", "cwce", "nll", "brier", "loss")
HIGHER_BETTER = ("miou", "acc")
BEST_MODES = ("max", "min")

# Keys a resume may change; any other difference is refused. ``train.epochs`` rebuilds the
# learning-rate schedule for the new length (see ``trainer.restore_training_state``).
RESUMABLE_KEYS = (
    "name", "output_dir", "data.root", "data.num_workers", "train.epochs", "train.device",
    "train.threads", "train.progress", "train.loggers", "train.debug_checks", "eval.batch_size",
    "eval.n_bins", "eval.temperature_scaling", "eval.num_maps", "eval.mode", "eval.resize",
    "eval.pad", "eval.window", "eval.stride",
    "data.class_names",  # display names only
)

# An evaluation image above this many pixels gets a warning (a 4000 x 3000 image takes
# minutes per forward pass of a ResNet encoder on a CPU).
LARGE_IMAGE_PIXELS = 2048 * 2048


def check_config(cfg: Config, reads_data: bool = False, writes_run: bool = False) -> None:
    """Refuse a config whose values cannot give a sensible run (before any data or model work):
    every key by the table of :mod:`cals_seg.config.rules` (ranges, choices, devices, names, paths),
    then the rules between keys (best metric and mode, the loss parameters, the evaluation
    protocol).

    Args:
        cfg: the resolved config.
        reads_data: the command reads the data (its paths must exist); off: the values only.
        writes_run: the command writes a run folder (``output_dir`` must be writable).

    Raises:
        ConfigError: naming the key, the value, what is allowed and the fix.
    """
    check_all(cfg, reads_data, writes_run)
    t = cfg.train
    check_eval_protocol(cfg)
    check_class_names(cfg)
    check_loggers(t.loggers)  # a missing package fails here, with its install command
    if t.best_mode not in BEST_MODES:
        raise ConfigError(f"train.best_mode: expected 'max' or 'min', got {t.best_mode!r}.")
    direction = ("min" if t.best_metric in LOWER_BETTER
                 else "max" if t.best_metric in HIGHER_BETTER else None)
    if direction is not None and direction != t.best_mode:
        better = "lower" if direction == "min" else "higher"
        raise ConfigError(
            f"train.best_metric={t.best_metric!r} is {better}-better, but train.best_mode="
            f"{t.best_mode!r} would keep its worst epoch; set train.best_mode={direction}."
        )
    for key, value in cfg.loss.params.items():  # NaN and infinities: refused like everywhere
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"loss.params.{key}: expected a finite number, got {value!r}; "
                              f"remove it (the loss's default) or set a number.")
    try:  # types and ranges of the loss parameters, before any data is read
        build_loss(cfg.loss.name, cfg.data.num_classes, ignore_index=cfg.data.ignore_index,
                   **cfg.loss.params)
    except (ValueError, TypeError) as err:
        raise ConfigError(_loss_message(str(err), cfg)) from None


def _loss_message(message: str, cfg: Config) -> str:
    """A loss's own refusal (``Expected `alpha` in [0, 1], but got -1.``) as the one format,
    naming the key: ``loss.params.alpha: expected ... ; set loss.params.alpha=...``."""
    if message.startswith("loss."):
        return message
    named = re.search(r"`(\w+)`", message)
    if named and named.group(1) in cfg.loss.params:
        key = f"loss.params.{named.group(1)}"
        return (f"{key}: {message[0].lower()}{message[1:].rstrip('.')}; set {key} in that "
                f"range (the loss {cfg.loss.name!r} refuses {cfg.loss.params[named.group(1)]!r}).")
    if named and named.group(1) != cfg.loss.name:
        key = f"loss.params.{named.group(1)}"
        return f"{key} (default): {message} Set {key} to a value the loss takes."
    return f"loss.params ({cfg.loss.name}): {message}"


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in ("params", "synthetic", "split_files"):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    a, b = _flat(old), _flat(new)
    return sorted(k for k in b if k in a and a[k] != b[k])


def check_resume(cfg: Config, saved: dict[str, Any], where: Any) -> list[str]:
    """The keys a resume changes; refuse any but :data:`RESUMABLE_KEYS`.

    Args:
        cfg: the config of the resumed run (the run's own config and ``--set`` overrides).
        saved: the config stored in the checkpoint.
        where: the checkpoint, for the message.

    Raises:
        ConfigError: a key that a resume cannot change (the model, the loss, the data ...).
    """
    old, new = _flat(saved), _flat(config_to_dict(cfg))
    changed = changed_keys(saved, config_to_dict(cfg))
    refused = [k for k in changed if k not in RESUMABLE_KEYS]
    if refused:
        shown = ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in refused)
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


def check_splits(task: Any, batch_size: int, bounded_input: bool = False,
                 world_size: int = 1) -> None:
    """Refuse splits that would fail later (empty, fewer training samples than a batch, no
    valid validation label) and warn about evaluation images large enough to take minutes
    (unless ``bounded_input``: the network input is resized or tiled). Under torch.distributed
    each of the ``world_size`` processes trains on its share of the split.

    Raises:
        DataError: naming the split and the fix.
    """
    for split in ("train", "val", "test"):
        if len(getattr(task, f"{split}_set")) == 0:
            raise DataError(
                f"The {split} split is empty; check the split files under data.root (for VOC "
                "layouts, ImageSets/Segmentation/train.txt holds train + validation, val.txt the "
                "test set) and data.val_fraction."
            )
    check_voc_data(task)  # split files, mask values, image/mask sizes: each named with its file
    if len(task.train_set) // world_size < batch_size:
        share = "" if world_size == 1 else f" ({len(task.train_set) // world_size} per process)"
        raise DataError(
            f"The training split has {len(task.train_set)} samples{share}, fewer than "
            f"train.batch_size={batch_size} per process; lower train.batch_size."
        )
    val = task.val_set
    if hasattr(val, "load_mask") and not any(
        (val.load_mask(i) != task.ignore_index).any() for i in val.ids
    ):
        raise DataError(
            f"Every pixel of the {len(val)} validation images is void ({task.ignore_index}): "
            "nothing to validate or select the best epoch on. Check the masks, or raise "
            "data.val_fraction."
        )
    for split in ("val", "test"):
        warn_large_images(getattr(task, f"{split}_set"), split, bounded_input)


def bounded_input(cfg: Config) -> bool:
    """Whether the evaluation's network input is bounded whatever the image size (resized or
    tiled)."""
    return cfg.eval.mode == "slide" or cfg.eval.resize is not None


def warn_large_images(dataset: Any, split: str, bounded_input: bool = False) -> None:
    """Warn (once per split) when an image whose network input is the whole image, at its own
    size, is large enough to take minutes: reads image headers only."""
    if bounded_input or not hasattr(dataset, "image_size"):
        return
    for sample_id in dataset.ids:
        width, height = dataset.image_size(sample_id)
        if width * height > LARGE_IMAGE_PIXELS:
            warnings.warn(
                f"The {split} split holds a {width}x{height} image ({sample_id}); with "
                "eval.mode: whole and eval.resize: null the network sees it at that size, which "
                "can take minutes and gigabytes per image on a CPU. Set eval.resize (e.g. 1024) "
                "or eval.mode: slide (tiles of eval.window); the metrics stay on the original "
                "pixels either way.",
                stacklevel=2,
            )
            return
