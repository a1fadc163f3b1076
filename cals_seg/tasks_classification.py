"""Build classification and text :class:`~cals_seg.trainer.Task` s from a config, and the
many / medium / few-shot evaluation of long-tailed data.

Classification is the flattened special case of segmentation: the model maps a batch to logits
``(N, K)``, the targets are ``(N,)``, and the same trainer, criterion and meters run on them
(``Task(..., segmentation=False)``). Only this module and ``tools/`` read the config's data and
model sections for these tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from .config import Config
from .data.classification import (
    IMAGENET_LT_FILES,
    ImageClassification,
    classification_eval_transform,
    classification_train_transform,
    image_folder_splits,
    imagenet_paper_split,
    split_file_splits,
    tiny_imagenet_paper_split,
)
from .data.synthetic_cls import (
    IMAGE_CLASSES,
    TEXT_GROUPS,
    generate_synthetic_corpus,
    generate_synthetic_images,
)
from .data.text import TextClassification, Vocabulary, load_glove, tokenize, twenty_news_paper_split
from .distributed import all_reduce_sum_
from .engine import load_checkpoint, predict
from .metrics import CalibrationMeter
from .models.classification import build_classification_model
from .models.text import GlobalPoolingCNN
from .trainer import Task

IMAGE_DATASETS = (
    "imagefolder", "split_files", "tiny_imagenet", "imagenet", "imagenet_lt", "synthetic_cls"
)
TEXT_DATASETS = ("20news", "synthetic_text")

# Long-tail groups by number of TRAINING samples of a class (ImageNet-LT convention).
SHOT_GROUPS: dict[str, tuple[int, int | None]] = {
    "many": (101, None),  # > 100
    "medium": (20, 100),  # 20 .. 100
    "few": (0, 19),  # < 20
}


def _check_common(cfg: Config) -> None:
    d = cfg.data
    if d.ignore_index >= 0:
        raise ValueError(
            f"data.ignore_index={d.ignore_index} could be a class label; classification and text "
            "configs use data.ignore_index: -100 (no sample is ignored)."
        )


def _check_classes(cfg: Config, classes: Sequence[str]) -> None:
    if len(classes) != cfg.data.num_classes:
        raise ValueError(
            f"data.num_classes={cfg.data.num_classes}, but {cfg.data.root} has "
            f"{len(classes)} classes ({list(classes)[:5]}...)."
        )


# ----------------------------------------------------------------------------- images
def image_splits(cfg: Config) -> dict[str, Any]:
    """``{"train", "val", "test": [(path, label)], "classes": names}`` of ``data.name``.

    ``synthetic_cls`` generates the embedded set at ``data.root`` first when it is missing
    (``data.synthetic`` holds the generator's keyword arguments).
    """
    d = cfg.data
    if d.name == "synthetic_cls":
        generate_synthetic_images(d.root, **d.synthetic)
        return image_folder_splits(d.root)
    if d.name == "imagefolder":
        return image_folder_splits(d.root)
    if d.name == "tiny_imagenet":
        return tiny_imagenet_paper_split(d.root, d.val_per_class, d.split_seed)
    if d.name == "imagenet":
        return imagenet_paper_split(d.root, d.val_fraction, d.split_seed)
    if d.name == "imagenet_lt":
        return split_file_splits(d.root, {**IMAGENET_LT_FILES, **d.split_files}, d.num_classes)
    if d.name == "split_files":
        return split_file_splits(d.root, d.split_files, d.num_classes)
    raise ValueError(
        f"data.name: unknown classification dataset {d.name!r}; valid names are "
        f"{list(IMAGE_DATASETS + TEXT_DATASETS)}."
    )


def build_image_task(cfg: Config) -> Task:
    """Datasets (paper splits, albumentations transforms) and the timm model."""
    _check_common(cfg)
    d, m = cfg.data, cfg.model
    if m.arch != "timm":
        raise ValueError(f"model.arch: image classification uses 'timm', got {m.arch!r}.")
    if d.name == "synthetic_cls" and d.num_classes != len(IMAGE_CLASSES):
        raise ValueError(
            f"data.num_classes: the synthetic image set has {len(IMAGE_CLASSES)} classes, "
            f"but the config says {d.num_classes}."
        )
    splits = image_splits(cfg)
    classes = splits["classes"]
    _check_classes(cfg, classes)
    train_tf = classification_train_transform(
        d.image_size, tuple(d.crop_scale), d.color_jitter, d.random_erasing
    )
    eval_tf = classification_eval_transform(d.image_size, d.eval_size)
    k = d.num_classes
    sets = {
        split: ImageClassification(splits[split], tf, k, classes)
        for split, tf in (("train", train_tf), ("val", eval_tf), ("test", eval_tf))
    }
    model = build_classification_model(m.encoder_name, k, m.encoder_weights, **m.params)
    return Task(
        sets["train"], sets["val"], sets["test"], model, k, d.ignore_index, classes,
        segmentation=False,
    )


# ----------------------------------------------------------------------------- text
def build_text_task(cfg: Config) -> Task:
    """20news-layout datasets (vocabulary from the training split) and the GPCN model.

    ``model.params`` go to :class:`GlobalPoolingCNN`, except ``freeze_glove`` (default false):
    keep the rows found in ``model.glove_path`` fixed and train only the others.
    """
    _check_common(cfg)
    d, m = cfg.data, cfg.model
    if m.arch != "gpcn":
        raise ValueError(f"model.arch: text classification uses 'gpcn', got {m.arch!r}.")
    if d.name == "synthetic_text":
        if d.num_classes != len(TEXT_GROUPS):
            raise ValueError(
                f"data.num_classes: the synthetic corpus has {len(TEXT_GROUPS)} groups, but the "
                f"config says {d.num_classes}."
            )
        generate_synthetic_corpus(d.root, **d.synthetic)
    elif d.name != "20news":
        raise ValueError(
            f"data.name: unknown text dataset {d.name!r}; valid names are {list(TEXT_DATASETS)}."
        )
    splits = twenty_news_paper_split(d.root, d.val_count, d.split_seed, d.text_strip)
    classes = splits["classes"]
    _check_classes(cfg, classes)
    train_texts = splits["train"][0]
    vocab = Vocabulary.build((tokenize(t) for t in train_texts), d.min_freq, d.vocab_size)
    k = d.num_classes
    sets = {
        split: TextClassification(*splits[split], vocab, d.max_len, k, classes)
        for split in ("train", "val", "test")
    }
    params = dict(m.params)
    freeze_glove = bool(params.pop("freeze_glove", False))
    embedding = found = None
    if m.glove_path is not None:
        embedding, found = load_glove(m.glove_path, vocab, m.embed_dim, seed=cfg.train.seed)
    try:
        model = GlobalPoolingCNN(
            len(vocab), m.embed_dim, k, embedding=embedding,
            freeze=found if freeze_glove else None, **params,
        )
    except TypeError as err:
        raise ValueError(f"model.params: {err}") from err
    if d.max_len < model.receptive_field():
        raise ValueError(
            f"data.max_len={d.max_len} is shorter than the GPCN's receptive field "
            f"({model.receptive_field()})."
        )
    return Task(
        sets["train"], sets["val"], sets["test"], model, k, d.ignore_index, classes,
        segmentation=False,
    )


def build_classification_task(cfg: Config) -> Task:
    """Image or text task, by ``data.name``."""
    if cfg.data.name in TEXT_DATASETS:
        return build_text_task(cfg)
    return build_image_task(cfg)


# ----------------------------------------------------------------------------- long-tail groups
def shot_groups(class_counts: Sequence[int]) -> dict[str, list[int]]:
    """Classes of each group by training count: many (> 100), medium (20-100), few (< 20)."""
    out: dict[str, list[int]] = {}
    for name, (low, high) in SHOT_GROUPS.items():
        out[name] = [
            k for k, c in enumerate(class_counts) if c >= low and (high is None or c <= high)
        ]
    return out


def _group_target(target: Tensor, member: Tensor, ignore_index: int) -> Tensor:
    """``target`` with every position whose class is not a member (or already void) void."""
    valid = target != ignore_index
    keep = valid & member[target.clamp(min=0)]
    return torch.where(keep, target, torch.full_like(target, ignore_index))


@torch.no_grad()
def evaluate_groups(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    class_counts: Sequence[int],
    ignore_index: int = -100,
    n_bins: int = 15,
    temperatures: dict[str, float] | None = None,
    amp: str = "none",
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """Per-class accuracy and many / medium / few-shot calibration in one pass over ``loader``.

    A group's metrics come from a :class:`CalibrationMeter` fed with the targets of the other
    groups set to ``ignore_index``: top-label ECE, AECE, NLL, accuracy ... over the samples whose
    TRUE class is in the group (predictions may be any class).

    Args:
        model: the classifier (set to eval mode).
        loader: test batches ``(inputs, target (N,))``.
        device: where the model runs.
        class_counts: training samples per class (length K), which define the groups.
        ignore_index: target value of void samples.
        n_bins: calibration bins.
        temperatures: ``{"pre_ts": 1.0, "post_ts": T}``; the logits are divided by each.
        amp: autocast mode of :func:`cals_seg.engine.predict`.
        progress: show a progress bar.

    Returns:
        ``{key: {"per_class_acc": K floats (None for classes without test samples),
        "per_class_count": K ints, "groups": {group: {"classes", "num_classes", metrics...}}}}``
        for each key of ``temperatures``. Exact under torch.distributed (sums over ranks).
    """
    temperatures = temperatures or {"pre_ts": 1.0}
    k = len(class_counts)
    groups = shot_groups(class_counts)
    members = {}
    for name, classes in groups.items():
        member = torch.zeros(k, dtype=torch.bool, device=device)
        member[classes] = True
        members[name] = member
    meters = {
        key: {
            name: CalibrationMeter(k, n_bins, ignore_index, classwise=False).to(device)
            for name in groups
        }
        for key in temperatures
    }
    correct = torch.zeros(k, dtype=torch.int64, device=device)
    total = torch.zeros(k, dtype=torch.int64, device=device)
    for logits, target in predict(model, loader, device, amp=amp, progress=progress, desc="groups"):
        valid = target != ignore_index
        y = target[valid]
        total += torch.bincount(y, minlength=k)
        correct += torch.bincount(y[logits[valid].argmax(dim=1) == y], minlength=k)
        for name, member in members.items():
            group_target = _group_target(target, member, ignore_index)
            for key, t in temperatures.items():
                meters[key][name].update(logits / t, group_target)
    all_reduce_sum_([correct, total])
    per_class = [
        c / n if n > 0 else None for c, n in zip(correct.tolist(), total.tolist(), strict=True)
    ]
    out = {}
    for key in temperatures:
        group_out = {}
        for name, classes in groups.items():
            metrics = meters[key][name].compute()
            metrics.pop("reliability", None)
            metrics = {m: v for m, v in metrics.items() if not m.endswith("_image_mean")}
            group_out[name] = {"classes": classes, "num_classes": len(classes), **metrics}
        out[key] = {
            "per_class_acc": per_class,
            "per_class_count": total.tolist(),
            "groups": group_out,
        }
    return out


def group_report(test: dict[str, Any]) -> str:
    """One line per group and temperature: ``many  pre_ts  acc 0.812  ece 0.051 (n=...)``."""
    lines = []
    for key in ("pre_ts", "post_ts"):
        block = test.get(key) or {}
        for name, g in (block.get("groups") or {}).items():
            if not g["count"]:
                continue
            lines.append(
                f"  {name:6s} {key:7s} classes {g['num_classes']:3d}  n {g['count']:6d}  "
                f"acc {g['acc']:.4f}  ece {g['ece']:.4f}  aece {g['aece']:.4f}"
            )
    return "\n".join(lines)


def load_best(model: nn.Module, run_dir: str | Path, device: torch.device) -> nn.Module:
    """Load ``run_dir/checkpoint_best.pt`` into ``model`` (moved to ``device``)."""
    state = load_checkpoint(Path(run_dir) / "checkpoint_best.pt", map_location=device)
    model.to(device).load_state_dict(state["model"])
    return model
