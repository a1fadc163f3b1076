"""The one registry type (losses, calibrators, meters, datasets, corruptions), the built-ins'
order, a task's meters read from the registry, the meter base class with its declared states,
and the one integer check."""

from __future__ import annotations

import pytest
import torch

from cals_seg.calibrators import CALIBRATORS, build_calibrator
from cals_seg.errors import UserError
from cals_seg.losses import LOSSES, build_loss
from cals_seg.metrics import METERS, CalibrationMeter, Meter
from cals_seg.tasks import DATASETS
from cals_seg.utils.registry import Registry, UnknownNameError
from cals_seg.utils.validation import check_int


def test_registry_registers_looks_up_and_lists_the_names():
    reg: Registry[int] = Registry("thing")
    assert reg.register("b", 2) == 2

    @reg.register("a")
    def one() -> int:
        return 1

    assert list(reg) == ["b", "a"] and sorted(reg) == ["a", "b"] and len(reg) == 2
    assert "a" in reg and "c" not in reg and reg["b"] == 2 and reg.lookup("a") is one
    assert dict(reg.items()) == {"b": 2, "a": one} and reg.get("c") is None
    with pytest.raises(ValueError, match="'b' is registered twice"):
        reg.register("b", 3)
    with pytest.raises(UnknownNameError) as err:
        reg["c"]
    assert isinstance(err.value, KeyError) and isinstance(err.value, UserError)
    assert str(err.value) == "Unknown thing 'c'; valid names are ['a', 'b']."
    with pytest.raises(UserError, match=r"Unknown thing 'c'; valid names are \['a', 'b'\]"):
        reg.lookup("c")


def test_the_package_registries_are_registries():
    for reg in (LOSSES, CALIBRATORS, METERS, DATASETS):
        assert isinstance(reg, Registry)
    assert LOSSES["cals_alm"].__name__ == "CALSALMLoss" and "ce" in LOSSES
    core = [n for n, c in CALIBRATORS.items() if not c.__module__.startswith("cals_seg.contrib.")]
    assert sorted(core) == sorted(["ts", "vector", "dirichlet", "lts", "selective", "boundary_ts",
                                   "boundary_ts_fine", "cms_ap", "cms_op", "image_ts"])
    assert METERS["calibration"].cls is CalibrationMeter
    with pytest.raises(ValueError, match=r"Unknown loss 'cals'; valid names are \['cals_alm'"):
        build_loss("cals", 3)
    with pytest.raises(UserError, match=r"Unknown calibrator 'tss'; valid names are \['boundary"):
        build_calibrator("tss", 3)


def test_the_built_ins_register_in_their_listed_order():
    """The docs' tables, the tools' choices and a misspelt name's list keep this order; each
    entry registers itself where it is defined, the package imports the built-ins in order."""
    from cals_seg.data.corruptions import CORRUPTIONS, FAMILIES, FIT_CORRUPTIONS

    core = [n for n, c in LOSSES.items() if not c.__module__.startswith("cals_seg.contrib.")]
    assert core == ["ce", "ls", "fl", "flsd", "ecp", "mbls", "cals_hr", "cals_alm", "svls",
                    "nacl", "crac"]
    assert list(METERS) == ["calibration", "segmentation", "boundary", "size", "rings", "groups"]
    assert list(DATASETS) == ["imagefolder", "split_files", "tiny_imagenet", "imagenet",
                              "imagenet_lt", "synthetic_cls", "voc", "synthetic", "cityscapes",
                              "ade20k", "folder", "20news", "synthetic_text"]
    assert {n: e.kind for n, e in DATASETS.items() if e.kind != e.family} == {
        "20news": "text", "synthetic_text": "text"}
    assert FAMILIES == {
        "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
        "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
        "weather": ("fog", "brightness"),
        "digital": ("contrast", "jpeg_compression", "pixelate"),
    }
    assert CORRUPTIONS == tuple(n for names in FAMILIES.values() for n in names)
    assert FIT_CORRUPTIONS == ("speckle_noise", "gaussian_blur", "saturate")


def test_a_tasks_meters_are_the_registered_ones_of_its_family():
    from cals_seg.tasks import ClassificationTask, SegmentationTask

    class Counts:
        def class_counts(self):
            return [5, 3, 1]

    seg = SegmentationTask(Counts(), None, None, None, 3, 255, ["background", "a", "b"])
    assert list(seg.meters()) == ["calibration", "segmentation", "boundary", "rings"]
    test = seg.meters(n_bins=10, test=True)
    assert list(test) == ["calibration", "segmentation", "boundary", "size", "rings"]
    assert test["size"].background_index == 0 and test["calibration"].n_bins == 10
    assert test["calibration"].classwise and not seg.meters()["calibration"].classwise
    cls = ClassificationTask(Counts(), None, None, None, 3, -100)
    assert list(cls.meters()) == ["calibration"]
    assert list(cls.meters(test=True)) == ["calibration", "groups"]


@pytest.mark.parametrize(("value", "minimum", "message"), [
    (0, 1, "Expected `n` to be a positive integer, but got 0."),
    (True, 1, "Expected `n` to be a positive integer, but got True."),
    (2.0, 1, "Expected `n` to be a positive integer, but got 2.0."),
    (-1, 0, "Expected `n` to be an integer >= 0, but got -1."),
    (2, 3, "Expected `n` to be an integer >= 3, but got 2."),
])
def test_check_int_refuses_with_one_message(value, minimum, message):
    with pytest.raises(UserError) as err:
        check_int("n", value, minimum)
    assert str(err.value) == message
    check_int("n", minimum, minimum)  # the bound itself passes


class _HitCount(Meter):
    """A meter written against the base class: correct top-1 predictions per class."""

    def __init__(self, num_classes: int, ignore_index: int = -100) -> None:
        super().__init__(num_classes, ignore_index)
        self.add_state("hits", torch.zeros(num_classes, dtype=torch.int64))
        self.add_state("seen", torch.zeros((), dtype=torch.int64))

    def batch_stats(self, logits, target):
        valid = target != self.ignore_index
        pred = logits.argmax(dim=1)
        right = target[valid & (pred == target)]
        return {"hits": torch.bincount(right, minlength=self.num_classes),
                "seen": valid.sum()}

    def compute_states(self, states):
        return {"hits": states["hits"].tolist(), "seen": int(states["seen"])}


def test_a_meter_declares_its_states_and_the_base_streams_resets_and_saves_them():
    torch.manual_seed(0)
    logits, target = torch.randn(6, 4, 5, 5), torch.randint(0, 4, (6, 5, 5))
    target[:, 0] = 255
    meter = _HitCount(4, ignore_index=255)
    assert [(s.name, s.reduction) for s in meter.states] == [("hits", "sum"), ("seen", "sum")]
    for part in (slice(0, 2), slice(2, 6)):
        meter.update(logits[part], target[part])
    valid = target != 255
    right = valid & (logits.argmax(dim=1) == target)
    want = {"hits": [int((right & (target == k)).sum()) for k in range(4)],
            "seen": int(valid.sum())}
    assert meter.compute() == want and meter.compute() == want  # compute leaves the state
    assert list(meter.state_dict()) == ["hits", "seen"]
    meter.reset()
    assert meter.compute() == {"hits": [0, 0, 0, 0], "seen": 0}
    with pytest.raises(ValueError, match="declared twice"):
        meter.add_state("hits", torch.zeros(4))
    with pytest.raises(UserError, match="`num_classes` to be an integer >= 2"):
        _HitCount(1)
    with pytest.raises(UserError, match="`ignore_index` to be an integer"):
        _HitCount(3, ignore_index=None)  # type: ignore[arg-type]


def test_unregister_removes_an_entry_and_refuses_an_unknown_one():
    reg: Registry[int] = Registry("thing")
    reg.register("a", 1)
    reg.register("b", 2)
    assert reg.unregister("a") == 1 and list(reg) == ["b"] and "a" not in reg
    with pytest.raises(UnknownNameError, match="Unknown thing 'a'; valid names are \\['b'\\]"):
        reg.unregister("a")
    reg.register("a", 3)  # the name is free again
    assert reg["a"] == 3
