"""The "Extending" steps hold: a new loss, dataset, corruption and meter, each registered from
this module only (no file of the package edited, no list named), are used through the user's
real paths: the loss by ``build_loss`` and a setup file's ``methods`` with ``--method``; the
dataset by ``data.name`` in a config, its checks and ``build_task`` (splits, model, one batch);
the corruption by ``--shift NAME:S`` parsing and ``corrupted_dataset``; the meter by the task's
meters. Each test fails when that registry's wiring is broken (a second list, a registry nobody
reads). The entries are registered by a fixture and removed after this module's tests, so the
other test modules see only the built-ins.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from cals_seg.config import load_config
from cals_seg.config.checks import check_config
from cals_seg.data.corruptions import (
    CORRUPTION_REGISTRY,
    Corruption,
    corrupted_dataset,
    parse_shifts,
    register_corruption,
)
from cals_seg.data.registry import DATASETS
from cals_seg.errors import ConfigError, UserError
from cals_seg.losses import LOSSES, SegLoss, build_loss
from cals_seg.metrics import METERS, Meter, register_meter
from cals_seg.tasks import build_task, dataset_names, task_family
from cals_seg.tasks.segmentation import class_names, segmentation_dataset, segmentation_splits
from cals_seg.utils.registry import Registry

LOSS, DATASET, CORRUPTION, METER = "test_double_ce", "test_tiny", "test_invert", "test_hits"
TINY_CLASSES = ("background", "square")


# ----------------------------------------------------------------------------- the four entries
class DoubleCE(SegLoss):
    """Twice the cross-entropy over the valid positions (a loss written against ``SegLoss``)."""

    def __init__(self, num_classes: int, ignore_index: int = -100, scale: float = 2.0) -> None:
        super().__init__(num_classes, ignore_index)
        self.scale = scale

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, target.masked_fill(~valid, 0), reduction="none")
        return self.scale * (ce * valid).sum() / valid.sum().clamp(min=1)


class TinySquares:
    """An in-memory split: 32 x 32 RGB images with a bright square (class 1) on a dark
    background (class 0); ``ids`` and ``load_image`` make it corruptible."""

    def __init__(self, n: int, transform: Any, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.ids = [f"tiny{seed}_{i}" for i in range(n)]
        self.transform = transform
        self.images, self.masks = {}, {}
        for sample_id in self.ids:
            y, x = rng.integers(4, 20, size=2)
            mask = np.zeros((32, 32), np.uint8)
            mask[y:y + 10, x:x + 10] = 1
            noise = rng.integers(0, 40, (32, 32, 3))
            self.images[sample_id] = (noise + 180 * mask[..., None]).astype(np.uint8)
            self.masks[sample_id] = mask

    def load_image(self, sample_id: str) -> np.ndarray:
        return self.images[sample_id]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample_id = self.ids[index]
        out = self.transform(image=self.load_image(sample_id), mask=self.masks[sample_id])
        return {"image": torch.as_tensor(out["image"], dtype=torch.float32),
                "mask": torch.as_tensor(out["mask"]).long(), "id": sample_id}


def tiny_splits(cfg: Any, transforms: Any) -> dict[str, TinySquares]:
    """The dataset's splits (what ``@segmentation_dataset`` registers)."""
    return {split: TinySquares(n, transforms[split], seed)
            for split, n, seed in (("train", 4, 0), ("val", 2, 1), ("test", 2, 2))}


def invert(image: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    """A corruption: the negative image (every severity alike)."""
    return 255 - image


class HitCount(Meter):
    """A meter written against the base class: correct top-1 predictions and valid pixels."""

    def __init__(self, num_classes: int, ignore_index: int = -100) -> None:
        super().__init__(num_classes, ignore_index)
        self.add_state("hits", torch.zeros((), dtype=torch.int64))
        self.add_state("seen", torch.zeros((), dtype=torch.int64))

    def batch_stats(self, logits: Tensor, target: Tensor) -> dict[str, Tensor]:
        valid = target != self.ignore_index
        return {"hits": (valid & (logits.argmax(dim=1) == target)).sum(), "seen": valid.sum()}

    def compute_states(self, states: dict[str, Tensor]) -> dict[str, Any]:
        return {"hit_rate": float(states["hits"]) / max(int(states["seen"]), 1)}


@pytest.fixture(scope="module", autouse=True)
def registered() -> Iterator[None]:
    """Register the four entries the way a new file of the package would, and forget them
    after this module (the registry has no public removal: a test's entries must not outlive
    it)."""
    LOSSES.register(LOSS)(DoubleCE)
    segmentation_dataset(DATASET, TINY_CLASSES)(tiny_splits)
    register_corruption(CORRUPTION, "digital")(invert)
    register_meter(METER, families=("segmentation",), build=lambda task, n_bins, test: HitCount(
        task.num_classes, task.ignore_index))(HitCount)
    yield
    for reg, name in ((LOSSES, LOSS), (DATASETS, DATASET), (CORRUPTION_REGISTRY, CORRUPTION),
                      (METERS, METER)):
        if name in reg:
            reg.unregister(name)


def write_setup(folder: Path) -> Path:
    """A setup file of the new dataset with the new loss in its ``methods`` table."""
    path = folder / "tiny_deeplabv3.yaml"
    path.write_text(f"""name: tiny_deeplabv3
data:
  name: {DATASET}
  root: {folder / "data"}
  num_classes: 2
  ignore_index: 255
  crop_size: 32
  scale_range: [1.0, 1.0]
  color_jitter: 0.0
model:
  arch: deeplabv3
  encoder_name: resnet18
  encoder_weights: null
  params: {{encoder_output_stride: 16, decoder_channels: 16}}
train: {{epochs: 1, batch_size: 2, device: cpu, amp: none, threads: 1, progress: false}}
eval: {{batch_size: 2}}
method: ce
methods:
  ce: {{name: ce}}
  double: {{name: {LOSS}, params: {{scale: 3.0}}}}
""")
    return path


# ----------------------------------------------------------------------------- the tests
def test_the_registries_discover_their_folders():
    """A new file of the folder registers itself: each registry imports its package's modules
    the first time its names are read."""
    assert LOSSES.discover == "cals_seg.losses" and METERS.discover == "cals_seg.metrics"
    assert DATASETS.discover == "cals_seg.tasks"
    assert CORRUPTION_REGISTRY.discover == "cals_seg.data"
    for reg in (LOSSES, METERS, DATASETS, CORRUPTION_REGISTRY):
        assert isinstance(reg, Registry)


def test_a_new_loss_is_built_by_name_and_chosen_by_a_setups_method(tmp_path):
    logits = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 3, (2, 4, 4), generator=torch.Generator().manual_seed(1))
    target[:, 0] = 255
    loss = build_loss(LOSS, 3, ignore_index=255)
    assert isinstance(loss, DoubleCE) and list(LOSSES)[-1] == LOSS
    expected = 2 * F.cross_entropy(logits, target, ignore_index=255)
    assert torch.allclose(loss(logits, target), expected)
    with pytest.raises(ValueError, match=r"Unknown parameter\(s\) \['margin'\]"):
        build_loss(LOSS, 3, margin=1.0)

    cfg = load_config(write_setup(tmp_path), method="double")  # --method double
    assert cfg.loss.name == LOSS and cfg.loss.params == {"scale": 3.0}
    check_config(cfg)  # the config rules know the loss (and the dataset)
    assert build_loss(cfg.loss.name, 2, cfg.data.ignore_index, **cfg.loss.params).scale == 3.0


def test_a_new_dataset_is_named_by_a_config_and_builds_its_task(tmp_path):
    cfg = load_config(write_setup(tmp_path))
    check_config(cfg)  # data.name is a registered segmentation dataset
    assert task_family(cfg) == "segmentation" and DATASET in dataset_names("segmentation")
    assert DATASETS[DATASET].kind == "segmentation" and list(DATASETS)[-1] == DATASET
    assert class_names(cfg) == list(TINY_CLASSES)
    assert {s: len(d) for s, d in segmentation_splits(cfg).items()} == {
        "train": 4, "val": 2, "test": 2}

    task = build_task(cfg, family="segmentation")
    assert task.class_names == list(TINY_CLASSES) and task.num_classes == 2
    batch = next(iter(torch.utils.data.DataLoader(task.train_set, batch_size=2)))
    assert batch["image"].shape == (2, 3, 32, 32) and batch["mask"].shape == (2, 32, 32)
    task.model.eval()
    with torch.no_grad():
        logits = task.model(batch["image"])
    assert logits.shape == (2, 2, 32, 32)
    criterion = build_loss(cfg.loss.name, task.num_classes, task.ignore_index)
    assert torch.isfinite(criterion(logits, batch["mask"]))

    misspelt = load_config(write_setup(tmp_path), overrides=["data.name=test_tinny"])
    with pytest.raises(ConfigError) as err:
        check_config(misspelt)
    assert "\n" not in str(err.value) and f"'{DATASET}'" in str(err.value)


def test_a_new_corruption_is_a_shift_choice_and_corrupts_a_split(tmp_path):
    from cals_seg.data.corruptions import CORRUPTIONS, FAMILIES, FIT_CORRUPTIONS

    assert CORRUPTIONS[-1] == CORRUPTION and FAMILIES["digital"][-1] == CORRUPTION
    assert CORRUPTION not in FIT_CORRUPTIONS
    assert parse_shifts([f"{CORRUPTION}:1"], seed=3) == [Corruption(CORRUPTION, 1, 3)]
    assert f"{CORRUPTION}:2" in [c.key for c in parse_shifts(["all:2"])]
    with pytest.raises(UserError, match=rf"valid names are \[.*'{CORRUPTION}'\] and all"):
        parse_shifts([f"{CORRUPTION}x:1"])

    task = build_task(load_config(write_setup(tmp_path)))
    test_set = task.test_set
    shifted = corrupted_dataset(test_set, parse_shifts([f"{CORRUPTION}:1"])[0])
    sample_id = test_set.ids[0]
    assert np.array_equal(shifted.load_image(sample_id), 255 - test_set.load_image(sample_id))
    assert torch.equal(shifted[0]["mask"], test_set[0]["mask"])
    assert not torch.equal(shifted[0]["image"], test_set[0]["image"])


def test_a_new_meter_is_in_its_familys_task_meters(tmp_path):
    task = build_task(load_config(write_setup(tmp_path)))
    for test in (False, True):
        meters = task.meters(n_bins=15, test=test)
        assert list(meters)[-1] == METER and isinstance(meters[METER], HitCount)
    logits = torch.zeros(1, 2, 4, 4)
    logits[:, 1, :2] = 1.0  # class 1 on the top half
    target = torch.ones(1, 4, 4, dtype=torch.long)
    meters = task.meters()
    meters[METER].update(logits, target)
    assert meters[METER].compute() == {"hit_rate": 0.5}
    # a classification task does not run it (registered for segmentation only)
    from cals_seg.tasks import ClassificationTask

    assert METER not in ClassificationTask(None, None, None, None, 2, -100).meters()
