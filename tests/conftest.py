"""Shared test helpers: the command-line tools loaded as modules, the ``cuda`` marker, nested
results compared within a tolerance, and the single-thread fixture."""

from __future__ import annotations

import contextlib
import importlib
import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped without one")
    # Consent remembered by import_model / train_seg (cals_seg.models.consent) goes to a file of
    # this test process, never to the developer's own ~/.config; removed when the process ends.
    # Each process its own file (pytest-xdist's workers inherit the controller's environment,
    # and two workers writing one file could drop each other's records).
    if os.environ.get("_CALS_SEG_CONSENT_PID", str(os.getpid())) != str(os.getpid()) \
            or "CALS_SEG_CONSENT_FILE" not in os.environ:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="cals_seg_consent_")
        atexit.register(shutil.rmtree, folder, True)
        os.environ["CALS_SEG_CONSENT_FILE"] = os.path.join(folder, "consent.json")
        os.environ["_CALS_SEG_CONSENT_PID"] = str(os.getpid())


def autocast_nesting() -> int:
    """Autocast's nesting count in this thread (a torch 2.14 dynamo trace that raises leaves it
    one too high; tests/test_autocast.py)."""
    import torch

    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth - 1


def load_tool(name: str) -> ModuleType:
    """The command behind ``tools/<name>.py``: ``cals_seg.commands.<name>``."""
    return importlib.import_module(f"cals_seg.commands.{name}")


def recomputed_test_accuracy(run_dir: Path) -> tuple[float, int]:
    """Accuracy of ``run_dir/checkpoint_best.pt`` on the test split, one sample at a time with a
    plain loop (no meter, no DataLoader): an independent check of ``test_metrics.json``."""
    import torch

    from cals_seg.config.schema import load_config
    from cals_seg.tasks import build_task
    from cals_seg.utils.io import load_checkpoint

    cfg = load_config(run_dir / "config.yaml")
    task = build_task(cfg)
    task.model.load_state_dict(load_checkpoint(run_dir / "checkpoint_best.pt")["model"])
    task.model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(len(task.test_set)):
            x, y = task.test_set[i]
            correct += int(task.model(x[None]).argmax(dim=1).item() == int(y))
    return correct / len(task.test_set), len(task.test_set)


# No test touches the network: pretrained weights that are not cached fail at once
# (cals_seg.models.hub reads this), and huggingface_hub itself stays offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
def assert_tree_close(got: Any, want: Any, rel: float = 1e-12, abs_: float = 1e-15,
                      path: str = "") -> None:
    """``got`` has the structure of ``want`` (dicts with the same keys, lists and tuples of the
    same length) and the same leaves: floats within ``math.isclose(rel_tol=rel, abs_tol=abs_)``,
    anything else (ints, None, strings) equal. ``path`` names the leaf that differs."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            assert_tree_close(got[key], want[key], rel, abs_, f"{path}.{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_tree_close(a, b, rel, abs_, f"{path}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=rel, abs_tol=abs_), (path, got, want)
    else:
        assert got == want, (path, got, want)


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Iterator[None]:
    """Every test on one torch thread: on a shared machine the many small ops of the meters and
    losses are faster without OpenMP hand-offs, and float64 sums that a test compares to
    1e-12 (streamed against one-shot) do not depend on how a parallel reduction splits them.
    The distributed workers of ``tests/_dist.py`` set one thread themselves."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fake_run(run: Path, cfg: Any, epoch: int | None = 0, model: Any = None,
             config: bool = False, temperature: float | None = None) -> Path:
    """A run folder without training: ``checkpoint_best.pt`` of ``model`` (default: the
    random-weight model of ``cfg`` after ``torch.manual_seed(0)``), with ``epoch`` unless None;
    ``config``: also ``config.yaml``; ``temperature``: also ``temperature.json``."""
    import torch

    from cals_seg.config.schema import save_config
    from cals_seg.runs.run import Run
    from cals_seg.tasks.segmentation import build_model

    run.mkdir(parents=True, exist_ok=True)
    if config:
        save_config(cfg, run / "config.yaml")
    if model is None:
        torch.manual_seed(0)
        model = build_model(cfg)
    state = {"model": model.state_dict(), "num_classes": cfg.data.num_classes}
    if epoch is not None:
        state["epoch"] = epoch
    torch.save(state, run / "checkpoint_best.pt")
    if temperature is not None:
        Run(run).write_temperature(temperature)
    return run


# ----------------------------------------------------------------------------- figures
# A 1 x 1 transparent PNG: what a figure saved without drawing holds.
PLACEHOLDER_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360606060000000050001a5f645400000000049454e44ae426082")


def _placeholder_savefig(self: Any, fname: Any, *args: Any, **kwargs: Any) -> None:
    """``matplotlib.figure.Figure.savefig`` without drawing: :data:`PLACEHOLDER_PNG` written to
    ``fname`` (a path or a binary file)."""
    if hasattr(fname, "write"):
        fname.write(PLACEHOLDER_PNG)
    else:
        Path(fname).write_bytes(PLACEHOLDER_PNG)


@contextlib.contextmanager
def figures_undrawn() -> Iterator[None]:
    """Inside the block, every matplotlib figure (the library's plots and confidence maps, in
    this process and in the children it forks) is saved as :data:`PLACEHOLDER_PNG` without
    being drawn. Drawing is most of the time of an ``eval_seg`` call or of a short run's end
    (about 85% of a tiny ``eval_seg`` with every option); the files are still written, at their
    names, through the library's own writer. For tests that check what is computed and which
    files are written, not how a figure looks: the figures themselves are drawn for real in
    tests/test_plotting*.py and in every file that does not ask for this."""
    import matplotlib.figure

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matplotlib.figure.Figure, "savefig", _placeholder_savefig)
        yield


@pytest.fixture(scope="module")
def undrawn_figures() -> Iterator[None]:
    """:func:`figures_undrawn` for a whole test file: ``pytestmark =
    pytest.mark.usefixtures("undrawn_figures")``."""
    with figures_undrawn():
        yield


# ----------------------------------------------------------------------------- shared runs
# Each run below is built once per test process (per pytest-xdist worker) in a session folder
# and shared by every file that needs one. A test that changes a run works on copy_run(run, ...);
# the shared folders are never written to after they are built.
SEG_SETUP = ROOT / "configs" / "synthetic_deeplabv3.yaml"
SEG_K = 11  # the embedded synthetic dataset's classes
UNTRAINED_T = 1.7  # the temperature written into the untrained run
TRAINED_NAME = "synthetic_deeplabv3_ce_seed0"  # what tools/compare.py names seed 0 of ce


def tiny_seg_sets(data: Path) -> list[str]:
    """``--set`` values that make the synthetic segmentation setup tiny: 8 images of 32 x 32
    (5 train, 3 validation) and 4 test images generated under ``data``, a small DeepLabV3
    (output stride 16, 16 decoder channels), batches of 4, one epoch, one thread, on the CPU,
    no confidence maps."""
    return [
        f"data.root={data}", "data.synthetic={num_train: 8, num_test: 4, image_size: 32}",
        "data.crop_size=32", "data.val_fraction=0.375",
        "model.params={encoder_output_stride: 16, decoder_channels: 16}",
        "train.batch_size=4", "eval.batch_size=4", "train.threads=1", "train.progress=false",
        "train.epochs=1", "train.device=cpu", "eval.num_maps=0",
    ]


@dataclass(frozen=True)
class TrainedRun:
    """A finished run of :data:`SEG_SETUP` (``folder``), the session folder it was trained in
    (``root``: data under ``root / "synthetic"``, the run under ``root / "runs"``) and the
    ``--set`` values it was trained with (``sets``, ``name`` and ``output_dir`` excluded)."""

    folder: Path
    root: Path
    sets: list[str]


def copy_run(run: Path, where: Path, name: str | None = None) -> Path:
    """A copy of the run folder ``run`` at ``where / (name or run.name)`` (``where`` created),
    for a test that changes it; a factory the user allowed for ``run`` is allowed for the copy
    too (:func:`cals_seg.models.consent.remember`)."""
    import shutil

    import yaml

    from cals_seg.models.consent import remember

    copy = where / (name or run.name)
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run, copy)
    factory = (yaml.safe_load((run / "config.yaml").read_text()).get("model") or {}).get("factory")
    if factory:
        remember(copy, factory)
    return copy


def untrained_seg_run(run: Path, data: Path, seed: int = 0, sets: Sequence[str] = (),
                      temperature: float | None = None) -> Path:
    """A run folder without training (:func:`fake_run`, epoch 0, ``config.yaml``): the
    random-weight network of the synthetic setup's ``ce`` after ``torch.manual_seed(seed)``,
    with a MobileNetV3 encoder (``tu-mobilenetv3_small_050``, output stride 16, 16 decoder
    channels), float32 on one CPU thread, no confidence maps, its data under ``data``
    (generated when a command first reads it); ``sets``: more ``--set`` values (the data's
    sizes, ...); ``temperature``: also ``temperature.json``."""
    import torch

    from cals_seg.config.schema import load_config
    from cals_seg.tasks.segmentation import build_model

    cfg = load_config(SEG_SETUP, [
        f"data.root={data}", "train.amp=none", "train.threads=1", "train.progress=false",
        "eval.num_maps=0", "train.device=cpu", "model.encoder_name=tu-mobilenetv3_small_050",
        "model.params={encoder_output_stride: 16, decoder_channels: 16}", *sets], "ce")
    torch.manual_seed(seed)
    return fake_run(run, cfg, epoch=0, model=build_model(cfg), config=True,
                    temperature=temperature)


@pytest.fixture(scope="session")
def untrained_run(tmp_path_factory) -> Path:
    """:func:`untrained_seg_run` of seed 0 with T = :data:`UNTRAINED_T` (read only): 8 images
    of 32 x 32 (5 train, 3 validation), 4 test images."""
    root = tmp_path_factory.mktemp("untrained")
    return untrained_seg_run(root / "run", root / "synthetic", sets=[
        "data.synthetic={num_train: 8, num_test: 4, image_size: 32}", "data.crop_size=32",
        "data.val_fraction=0.375"], temperature=UNTRAINED_T)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> TrainedRun:
    """One epoch of ``ce`` on the tiny synthetic setup (:func:`tiny_seg_sets`, seed 0, with its
    temperature), named as tools/compare.py names seed 0: ``checkpoint_last.pt`` kept; its
    plots are placeholders (:func:`figures_undrawn`), whichever file asks for it first."""
    import warnings

    from cals_seg.config.schema import load_config
    from cals_seg.tasks import build_task
    from cals_seg.training.engine import seed_everything
    from cals_seg.training.trainer import fit

    root = tmp_path_factory.mktemp("trained")
    sets = tiny_seg_sets(root / "synthetic")
    cfg = load_config(SEG_SETUP, [*sets, f"name={TRAINED_NAME}", f"output_dir={root / 'runs'}",
                                  "train.seed=0"], "ce")
    seed_everything(cfg.train.seed)
    with warnings.catch_warnings(), figures_undrawn():
        warnings.simplefilter("ignore")
        fit(cfg, build_task(cfg))
    return TrainedRun(cfg.run_dir, root, sets)


# The imported run's network: every image it is run on is counted in SEEN (tests/test_one_pass).
SEEN: Counter = Counter()


def counted_segmenter() -> Any:
    """The factory ``tests.conftest:counted_segmenter`` of :func:`imported_run`: two
    convolutions (3 -> 8 -> 11 channels, logits at the input's size, times 3), seeded, that add
    each input image's digest to :data:`SEEN`."""
    import torch
    from torch import nn

    from cals_seg.evaluation.logit_cache import image_digest

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(8, SEG_K, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i in range(x.shape[0]):
                SEEN[image_digest(x[i])] += 1
            return self.body(x) * 3

    torch.manual_seed(0)
    return Counted()


@pytest.fixture(scope="session")
def imported_run(tmp_path_factory) -> Path:
    """A run made by tools/import_model.py from a config naming
    ``tests.conftest:counted_segmenter``: the synthetic set at 32 x 32 (8 images, half of them
    validation, and 3 test images), eval batches of 4, 2 confidence maps, its temperature."""
    import yaml

    from cals_seg.commands import import_model

    root = tmp_path_factory.mktemp("imported")
    cfg = {
        "data": {"name": "synthetic", "root": str(root / "synthetic"), "num_classes": SEG_K,
                 "crop_size": 32, "val_fraction": 0.5,
                 "synthetic": {"num_train": 8, "num_test": 3, "image_size": 32}},
        "model": {"arch": "external", "factory": "tests.conftest:counted_segmenter"},
        "train": {"device": "cpu", "amp": "none", "progress": False},
        "eval": {"batch_size": 4, "num_maps": 2},
    }
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert import_model.main([str(config), "--out", str(root / "run")]) == 0
    return root / "run"


# ----------------------------------------------------------------------------- classification runs
# One epoch of ce on the embedded image and text setups at tiny sizes (tests/test_eval_cls.py,
# tests/test_predict_cls.py): data generated under the session folder, read only once built.
CLS_SETS = {
    # 10 classes, 40 ... 5 training images of 16 x 16, 4 validation and 6 test images per class,
    # timm's MobileNetV3 (small, 0.5) instead of the setup's ResNet-18
    "synthetic_cls": ["data.synthetic={max_train: 40, min_train: 5, num_val: 4, num_test: 6, "
                      "image_size: 16}", "data.image_size=16", "eval.batch_size=64",
                      "model.encoder_name=mobilenetv3_small_050", "train.batch_size=32"],
    # 6 groups, 30 training posts each (30 of them validation), 10 test posts each, a narrow GPCN
    "synthetic_text": ["data.synthetic={num_train: 30, num_test: 10}", "data.val_count=30",
                       "model.embed_dim=16", "model.params={channels: 16, hidden: 16, "
                       "dropout: 0.3}", "train.batch_size=16"],
}


def tiny_cls_run(root: Path, setup: str) -> Path:
    """One epoch of ``ce`` of ``configs/<setup>.yaml`` at the sizes of :data:`CLS_SETS`, seed
    0, float32 on one CPU thread, its data under ``root / setup``, the run in ``root / "runs"``
    (figures undrawn)."""
    import warnings

    from cals_seg.config.schema import load_config
    from cals_seg.tasks import build_task
    from cals_seg.training.engine import seed_everything
    from cals_seg.training.trainer import fit

    cfg = load_config(ROOT / "configs" / f"{setup}.yaml", [
        f"data.root={root / setup}", f"output_dir={root / 'runs'}", f"name={setup}_ce",
        "train.epochs=1", "train.progress=false", "train.threads=1", "train.amp=none",
        "train.device=cpu", "train.seed=0", *CLS_SETS[setup]], "ce")
    seed_everything(cfg.train.seed)
    with warnings.catch_warnings(), figures_undrawn():
        warnings.simplefilter("ignore")
        fit(cfg, build_task(cfg))
    return cfg.run_dir


@pytest.fixture(scope="session")
def cls_run(tmp_path_factory) -> Path:
    """:func:`tiny_cls_run` of the embedded long-tailed image set (read only: copy_run it to
    write into it)."""
    return tiny_cls_run(tmp_path_factory.mktemp("cls"), "synthetic_cls")


@pytest.fixture(scope="session")
def text_run(tmp_path_factory) -> Path:
    """:func:`tiny_cls_run` of the embedded topic corpus (read only: copy_run it to write into
    it)."""
    return tiny_cls_run(tmp_path_factory.mktemp("text"), "synthetic_text")


@pytest.fixture(scope="session")
def fitted_calibrators(tmp_path_factory) -> Path:
    """tests/test_export_calibrators.py's run with every registered calibrator fitted
    (:func:`~tests.test_export_calibrators.fitted_run`; read only: a test that changes it works
    on a :func:`copy_run`), built once for the two files that export it: under pytest-xdist the
    first worker that asks builds it in the session's common temporary folder, the others wait
    for it and read it. Its network's factory (a function of that file) is allowed for it in
    every process that reads it (consent is remembered per test process)."""
    import shutil

    from filelock import FileLock  # a dependency of torch

    from cals_seg.models.consent import remember

    from .test_export_calibrators import FACTORY, fitted_run

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        run = fitted_run(tmp_path_factory.mktemp("fitted_calibrators"))
    else:
        root = tmp_path_factory.getbasetemp().parent / "fitted_calibrators"
        with FileLock(f"{root}.lock"):
            if not (root / "built").is_file():
                shutil.rmtree(root, ignore_errors=True)  # a worker that failed half-way
                root.mkdir()
                fitted_run(root)
                (root / "built").write_text("")
        run = root / "run"
    remember(run, FACTORY)
    return run
