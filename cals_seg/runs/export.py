"""Export a trained segmentation run as a standalone program: ONNX, or a ``torch.export`` ``.pt2``.

The exported program maps a float32 RGB batch ``(N, 3, H, W)`` with values in ``[0, 255]`` to
calibrated probabilities ``(N, K, H, W)`` at the input's resolution (raw logits with
``logits=True``). Everything between is inside the program, in float32:

1. normalise, ``(x / 255 - mean) / std`` (ImageNet statistics, as in training), with the
   float32 operations of the toolkit's evaluation (:func:`normalisation_constants`);
2. pad at the bottom / right to the next multiple of the network's output stride with the
   normalised value of a black pixel, ``-mean / std`` (what the evaluation does), written with
   index arithmetic so that ``H`` and ``W`` stay dynamic;
3. run the network and crop the padding off the logits;
4. calibrate: the run's temperature (``temperature.json``, what ``predict_seg`` uses by
   default), or the post-hoc calibrator ``NAME`` saved in ``<run>/calibrators/NAME.pt`` (what
   ``predict_seg --calibrator NAME`` uses; any registered calibrator, as the program of its
   :meth:`~cals_seg.calibrators.Calibrator.export_module`, its predicted boundary bands computed
   from the program's own ``argmax`` map), then the softmax over the K classes.

``N``, ``H`` and ``W`` are dynamic: one file serves every batch size and image size with sides
``>= min_size``. By default ``min_size`` is the smallest side the traced network holds, found
by the export itself (``torch.export`` with automatic dynamic sides records the range of sizes
its program is valid for; e.g. 17 for a network of stride 16, whose padded input is then at
least 32). A ``min_size`` given is kept, or refused naming the smallest one the network holds.
The program runs the network once on the whole image: a run evaluated with ``eval.resize``,
``eval.pad`` or ``eval.mode: slide`` should get its images resized / tiled by the caller.

Loading::

    program = torch.export.load("model.pt2").module()       # .pt2
    probs = program(images)                                   # (N, K, H, W)

    session = onnxruntime.InferenceSession("model.onnx")      # ONNX
    probs = session.run(None, {"image": images.numpy()})[0]

The ``.onnx`` file holds its weights (one self-contained file to copy) unless they pass
protobuf's 2 GB limit; then they are written to ``FILE.data``, which must stay next to it
(:func:`written_files` names every file an export wrote).

With a fitted conformal threshold (``export_run(..., conformal=...)``, ``tools/export.py RUN
--conformal ALPHA``), the program has a second output, ``sets``: the prediction sets
``(N, K, H, W)`` bool that ``predict_seg --conformal`` writes (:class:`ConformalSegmenter`), on
the network's logits whatever the calibrator, as there::

    probs, sets = torch.export.load("model.pt2").module()(images)
    probs, sets = session.run(None, {"image": images.numpy()})

An image classification run (``tools/train_cls.py``) exports the same way without space: the
program maps ``(N, 3, S, S)`` (``S = data.image_size``, the images resized and cropped as
``predict_cls`` and the evaluation make them) to probabilities ``(N, K)``, and its sets are
``(N, K)``; only ``N`` is dynamic (:func:`trace_fixed`). A text run is refused
(:func:`export_family`): its input is token ids of its vocabulary, not an image.

The ONNX export needs the ``onnx`` and ``onnxscript`` packages, checking it ``onnxruntime``
(``pip install "cals_seg[export]"``).
"""

from __future__ import annotations

import importlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from cals_seg.calibrators import CALIBRATORS as REGISTRY
from cals_seg.errors import UserError
from cals_seg.evaluation.inference import IMAGENET_MEAN, IMAGENET_STD, input_multiple
from cals_seg.runs._trace import first_line, root_cause, trace_program

FORMATS = ("onnx", "pt2")


def calibrator_choices() -> tuple[str, ...]:
    """What an exported program can calibrate with: ``none`` (T = 1) or any post-hoc calibrator
    registered now (its file in <run>/calibrators/); without a name, the run's temperature."""
    return ("none", *REGISTRY)


INPUT_NAME, OUTPUT_NAMES, SETS_NAME = "image", {False: "probs", True: "logits"}, "sets"
# (calibrator, format) pairs a format cannot hold, with the reason (none at present: every
# registered calibrator is exported in both formats; tests/test_export_calibrators.py).
REFUSED: dict[tuple[str, str], str] = {}


def _pad(x: Tensor, dim: int, size: Any, length: Any, fill: Tensor) -> Tensor:
    """``x`` padded along ``dim`` from ``length`` to ``size >= length`` entries with ``fill``
    (broadcast against ``x``).

    A gather of the clamped indices and a ``where`` instead of ``F.pad``: ``F.pad`` branches
    on whether the pad is zero, which ties a dynamic size to one case when exported.
    """
    index = torch.arange(size, device=x.device)
    shape = [1] * x.dim()
    shape[dim] = size
    keep = (index < length).view(shape)
    return torch.where(keep, x.index_select(dim, index.clamp(max=length - 1)), fill)


def normalisation_constants(mean: Sequence[float], std: Sequence[float]
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """``(shift, inverse, fill)`` float32 ``(1, 3, 1, 1)``: the normalisation of the toolkit's
    evaluation, bit for bit. ``x`` in ``[0, 255]`` normalises to ``(x - shift) * inverse`` with
    ``shift = float32(mean) * 255`` and ``inverse = 1 / (float32(std) * 255)`` in float32
    (albumentations' ``Normalize``, what :func:`~cals_seg.evaluation.inference.normalise`
    applies), and padding holds ``fill = -mean / std`` in float32 (the value
    :func:`~cals_seg.evaluation.inference.segment_logits` pads with)."""
    m = torch.tensor(list(mean), dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(list(std), dtype=torch.float32).view(1, 3, 1, 1)
    return m * 255.0, torch.reciprocal(s * 255.0), -m / s


class CalibratedSegmenter(nn.Module):
    """A segmentation network with its input normalisation and calibration built in.

    ``forward(x) = softmax(calibrate(crop(model(normalise(pad(x))))))`` over the classes, with
    ``calibrate`` the division by ``T`` or the post-hoc ``calibrator`` (given the normalised
    image when it needs one); the cropped logits with ``logits=True``.

    Args:
        model: maps normalised ``(N, 3, h, w)`` (sides divisible by ``multiple``) to logits
            ``(N, K, h, w)``; put in eval mode here.
        temperature: ``T > 0`` (1.0: uncalibrated softmax), used without ``calibrator``.
        mean, std: per-channel statistics of ``[0, 1]`` RGB pixels.
        multiple: the side multiple the network needs (its output stride).
        logits: return the logits instead of the probabilities.
        calibrator: a fitted :class:`~cals_seg.calibrators.Calibrator`; the program holds its
            :meth:`~cals_seg.calibrators.Calibrator.export_module` for ``fmt``.
        fmt: the format the module will be exported to (``pt2`` or ``onnx``).

    Shape:
        ``x (N, 3, H, W)`` float32 in ``[0, 255]`` -> ``(N, K, H, W)`` float32.
    """

    def __init__(self, model: nn.Module, temperature: float = 1.0,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 multiple: int = 1, logits: bool = False, calibrator: nn.Module | None = None,
                 fmt: str = "pt2") -> None:
        super().__init__()
        if not (isinstance(temperature, int | float) and temperature > 0):
            raise ValueError(f"Expected a temperature > 0, but got {temperature!r}.")
        if not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"Expected `multiple` to be a positive integer, but got {multiple!r}.")
        self.model = model.eval()
        self.multiple, self.logits, self.temperature = multiple, logits, float(temperature)
        self.needs_image = bool(calibrator is not None and calibrator.needs_image)
        self.calibrator = None if calibrator is None else calibrator.export_module(fmt).eval()
        shift, inverse, fill = normalisation_constants(mean, std)
        self.register_buffer("shift", shift)
        self.register_buffer("inverse", inverse)
        self.register_buffer("fill", fill)

    def forward(self, x: Tensor) -> Tensor:
        return self.outputs(x)[0]

    def outputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(forward(x), the cropped logits)``."""
        h, w = x.shape[-2], x.shape[-1]
        m = self.multiple
        image = (x - self.shift) * self.inverse
        padded = image
        if m > 1:
            padded = _pad(padded, 2, (h + m - 1) // m * m, h, self.fill)
            padded = _pad(padded, 3, (w + m - 1) // m * m, w, self.fill)
        out = self.model(padded).float()
        if m > 1:  # crop the padding off
            out = out.index_select(2, torch.arange(h, device=x.device))
            out = out.index_select(3, torch.arange(w, device=x.device))
        if self.logits:
            return out, out
        if self.calibrator is not None:
            calibrated = self.calibrator(out, image if self.needs_image else None)
            return torch.softmax(calibrated.float(), dim=1), out
        return torch.softmax(out / self.temperature, dim=1), out


class ConformalSegmenter(nn.Module):
    """A :class:`CalibratedSegmenter` that also returns the conformal prediction sets of a
    fitted :class:`~cals_seg.evaluation.conformal.ConformalSets` (what ``predict_seg
    --conformal`` writes): class ``k`` is in a pixel's set when its score (a registered score,
    LAC ``1 - p_k`` or randomised APS, ...:
    :func:`~cals_seg.evaluation.conformal_score.class_scores`, on ``p = softmax`` of the
    network's logits, T = 1) is at most the threshold (one number, or the threshold of class
    ``k`` in ``class`` mode).

    The scores are compared with the thresholds ``g / grid`` in float32, which is exact:
    ``grid`` is a power of two and the toolkit's rule, ``ceil(s * grid) <= g``, holds iff
    ``s <= g / grid`` for the same float32 score ``s``.

    Shape:
        ``x (N, 3, H, W)`` float32 in ``[0, 255]`` -> ``(probs or logits (N, K, H, W) float32,
        sets (N, K, H, W) bool)``.
    """

    def __init__(self, segmenter: CalibratedSegmenter, sets: Any) -> None:
        super().__init__()
        if sets.kind == "band":
            raise UserError("export --conformal: mode=band needs the distance to the predicted "
                            "boundaries, which is not exported; use mode=risk, image:TAU or "
                            "class.")
        self.segmenter = segmenter
        self.multiple, self.logits = segmenter.multiple, segmenter.logits
        self.score, self.seed = sets.score, sets.seed
        index = sets.threshold_index.detach().to("cpu", torch.float64) / sets.grid
        shape = (1, -1, 1) if sets.kind == "class" else (1, 1, 1)
        self.register_buffer("threshold", index.to(torch.float32).view(shape))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        from cals_seg.evaluation.conformal_score import class_scores

        out, raw = self.segmenter.outputs(x)
        n, k = raw.shape[:2]
        if raw.dim() == 2:  # a classifier: each input one position, as ConformalSets sees it
            probs = torch.softmax(raw.float().reshape(n, k, 1), dim=1)
        else:
            probs = torch.softmax(raw.float(), dim=1).reshape(n, k, -1)
        scores = class_scores(probs, self.score, self.seed)
        return out, (scores <= self.threshold).reshape(raw.shape)


def trace_fixed(module: nn.Module, side: int, what: str = "this network") -> Any:
    """``module`` traced by ``torch.export`` for ``(N, 3, side, side)`` inputs, ``N`` dynamic
    (1 to 4096): an image classifier, whose input is made at the size it was trained at
    (``predict_cls``: shorter side to ``data.eval_size``, centre crop of ``data.image_size``).

    Raises:
        UserError: ``torch.export`` cannot trace it (its first line).
    """
    from cals_seg.runs._trace import _export

    module = module.eval().to("cpu", torch.float32)
    example = (torch.rand(2, 3, side, side, generator=torch.Generator().manual_seed(0)) * 255,)
    static = torch.export.Dim.STATIC
    return _export(module, example, [static, static], what)


def export_program(module: CalibratedSegmenter | ConformalSegmenter, path: str | Path, fmt: str,
                   min_size: int | None = None, what: str = "the program",
                   side: int | None = None) -> Path:
    """Write ``module`` as ONNX (``fmt="onnx"``) or a ``torch.export`` program (``"pt2"``),
    with dynamic batch size, height and width (:func:`trace_program`); the smallest side
    accepted is then ``module.min_size``. With ``side`` (an image classifier: the input size it
    was trained at) the input is ``side x side`` and only the batch is dynamic
    (:func:`trace_fixed`). A :class:`ConformalSegmenter` has a second output, ``sets``. An ONNX
    file is run once with onnxruntime (when installed) on the traced example and compared with
    the PyTorch program: a format that does not hold ``what`` faithfully is refused, the file
    removed.

    Raises:
        UserError: an unknown format, a network or calibrator a format cannot hold (one line
            naming what stops it), a folder that cannot be written.
        ImportError: ONNX without the ``onnx`` / ``onnxscript`` packages (with the command).
    """
    if fmt not in FORMATS:
        raise UserError(f"--format: expected one of {list(FORMATS)}, got {fmt!r}.")
    path = Path(path)
    if fmt == "onnx":
        for package in ("onnx", "onnxscript"):
            try:
                importlib.import_module(package)
            except ImportError:
                raise ImportError(
                    f"--format onnx needs the {package} package; install it with: "
                    f'pip install "cals_seg[export]" (or: pip install onnx onnxscript '
                    "onnxruntime).") from None
        if isinstance(module, ConformalSegmenter):
            from cals_seg.evaluation.conformal_score import refuse_onnx

            refuse_onnx(module.score)  # a score ONNX cannot hold, in one line
    module.fixed_side = side
    if side is not None:
        program, module.min_size = trace_fixed(module, side, what), side
    else:
        program, module.min_size = trace_program(module, min_size, what)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{path}.data").unlink(missing_ok=True)  # a sidecar of an earlier export
        if fmt == "pt2":
            torch.export.save(program, path)
            return path
        _write_onnx(module, program, path, what)
    except OSError as err:
        from cals_seg.utils.paths import os_error

        raise os_error(err, path, "write the exported program") from None
    return path


def _write_onnx(module: nn.Module, program: Any, path: Path, what: str) -> None:
    """The ONNX file of ``program``, checked against it with onnxruntime when installed."""
    # One self-contained file (weights inside), unless they pass protobuf's 2 GB limit: then
    # the weights go to FILE.data next to it, and written_files() names both.
    external = _weight_bytes(module) > ONNX_SINGLE_FILE_LIMIT
    names = [OUTPUT_NAMES[module.logits]]
    names += [SETS_NAME] if isinstance(module, ConformalSegmenter) else []
    side = getattr(module, "fixed_side", None)
    h, w = (side, side) if side is not None else (module.min_size + 3, module.min_size + 6)
    example = torch.rand(2, 3, h, w, generator=torch.Generator().manual_seed(1)) * 255
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(program, (example,), str(path), dynamo=True,
                              input_names=[INPUT_NAME], output_names=names, verbose=False,
                              external_data=external)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 (the exporter raises many types, one line here)
        cause = root_cause(err)
        raise UserError(f"--format onnx: the ONNX exporter cannot convert {what} "
                        f"({type(cause).__name__}: {first_line(cause)}); use --format pt2."
                        ) from None
    deviation = _onnx_deviation(program, path, example)
    if deviation is not None and deviation > ONNX_TOLERANCE:
        for file in (path, Path(f"{path}.data")):
            file.unlink(missing_ok=True)
        raise UserError(f"--format onnx: ONNX does not hold {what} faithfully (its first output "
                        f"differs from the PyTorch program's by {deviation:.3g} on a test batch, "
                        f"more than {ONNX_TOLERANCE:g}); use --format pt2.")
    module.onnx_check = deviation


# The largest difference allowed between the ONNX file's first output and the PyTorch
# program's on the export's test batch (float32 kernels of two runtimes).
ONNX_TOLERANCE = 1e-4


def _onnx_deviation(program: Any, path: Path, example: Tensor) -> float | None:
    """Largest difference between the ONNX file's first output (onnxruntime, CPU) and the
    PyTorch ``program``'s on ``example``; None without onnxruntime."""
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {INPUT_NAME: example.numpy()})[0])
    with torch.no_grad():
        want = program.module()(example)
    want = want[0] if isinstance(want, tuple | list) else want
    return float((got.float() - want.float()).abs().max())


# Weights above this many bytes make an ONNX file that protobuf cannot hold (2 GiB), so they go
# to a sidecar FILE.data; below it the export is one file.
ONNX_SINGLE_FILE_LIMIT = 1_800_000_000


def _weight_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def written_files(path: str | Path) -> list[Path]:
    """Every file an export to ``path`` wrote: the program, its weights sidecar when there is
    one (``FILE.data``, ONNX over 2 GB only; it must stay next to the ``.onnx``), and
    ``FILE.json``."""
    path = Path(path)
    sidecars = [Path(f"{path}.data")] if Path(f"{path}.data").is_file() else []
    return [path, *sidecars, Path(f"{path}.json")]


def _calibration(loaded: Any, calibrator: str | None, logits: bool) -> dict[str, Any]:
    """What calibrates the program: ``{"name", "temperature", "module", "file"}``."""
    run_dir = loaded.path
    if logits:
        if calibrator not in (None, "none", "ts"):
            raise UserError(f"--logits outputs the network's raw logits: leave out --calibrator "
                            f"{calibrator}, or drop --logits for its probabilities.")
        return {"name": "none", "temperature": None, "module": None, "file": None}
    if calibrator == "none":
        return {"name": "none", "temperature": 1.0, "module": None, "file": None}
    temperature_file = loaded.temperature_file
    if calibrator == "ts" and not loaded.calibrator_file("ts").is_file():
        calibrator = None  # the run's own temperature scaling (what --calibrator ts meant)
    if calibrator is None:
        if loaded.temperature is None:
            raise UserError(f"{run_dir} has no {temperature_file.name} (the run did not "
                            "finish, or eval.temperature_scaling is false); export with "
                            "--calibrator none for uncalibrated probabilities, or with "
                            "--calibrator NAME for a calibrator fitted by tools/eval_seg.py.")
        return {"name": "ts", "temperature": float(loaded.temperature), "module": None,
                "file": str(temperature_file)}
    from cals_seg.calibrators import load_run_calibrator

    # validated, and refused unless fitted for this network, its classes and precision (the
    # export's forward pass is float32), as predict_seg --calibrator NAME refuses it
    try:
        module = load_run_calibrator(loaded, calibrator).eval()
    except UserError as err:
        if "[precision]" not in str(err):
            raise
        raise UserError(f"{loaded.calibrator_file(calibrator)} was fitted on logits of a "
                        "lower-precision forward pass; the exported program's is float32: refit "
                        f"it with tools/eval_seg.py {run_dir} --calibrators {calibrator} "
                        "--refit-calibrators --set train.amp=none.") from None
    return {"name": calibrator, "temperature": None, "module": module,
            "file": str(loaded.calibrator_file(calibrator))}


def export_family(run: str | Path, checkpoint: str = "best") -> str:
    """The task family of the run at ``run`` (its config read, nothing else) when export takes
    it: ``segmentation``, or ``classification`` for an image classifier.

    Raises:
        UserError: a text run (its input is token ids of its training split's vocabulary, not
            an image), in one line naming predict_cls.
    """
    from cals_seg.runs.run import Run, resolve_run
    from cals_seg.tasks import DATASETS, task_family

    folder, _ = resolve_run(run, checkpoint)
    cfg = Run(folder).read_config()
    family = task_family(cfg)
    if DATASETS[cfg.data.name].kind == "text":
        raise UserError(f"{folder} is a text run: export takes image runs (a text run's input "
                        "is the token ids of its training split's vocabulary); predict with "
                        f"tools/predict_cls.py {folder} TEXTS --out DIR.")
    return family


# Not split (over 80 lines): most of it is the docstring and the metadata written.
def export_run(run: str | Path, out: str | Path, fmt: str = "onnx", calibrator: str | None = None,
               logits: bool = False, checkpoint: str = "best",
               min_size: int | None = None, conformal: Any = None,
               loaded: Any = None) -> dict[str, Any]:
    """Export a trained segmentation or image classification run; writes ``out`` and
    ``<out>.json`` (what the program expects and returns: input name and range, smallest side
    (a classifier: its input size), normalisation, class names, the forward precision, the
    calibration, and the conformal threshold).

    Args:
        run: a run directory (or a checkpoint file inside one).
        out: the file to write (``.onnx`` / ``.pt2``).
        fmt: ``onnx`` or ``pt2``.
        calibrator: None (the run's fitted temperature, ``temperature.json``: ``predict_seg``'s
            default), ``none`` (T = 1), or a registered calibrator's name: the one saved in
            ``<run>/calibrators/NAME.pt`` by ``tools/eval_seg.py RUN --calibrators NAME``, as
            ``predict_seg --calibrator NAME`` uses it (``ts`` without ``ts.pt``: the run's
            temperature).
        logits: output raw logits instead of calibrated probabilities.
        checkpoint: ``best`` or ``last`` (for a run directory; read by
            :func:`cals_seg.runs.run.load_run`).
        min_size: smallest height / width the program accepts (default: the smallest the
            network holds, found by the export).
        conformal: a fitted :class:`~cals_seg.evaluation.conformal.ConformalSets` (on the
            run's logits, mode ``risk``, ``image:TAU`` or ``class``): the program also returns
            its prediction sets, ``(N, K, H, W)`` bool (:class:`ConformalSegmenter`; a
            classifier's: ``(N, K)``, modes ``risk`` and ``class``).
        loaded: the run already loaded (:func:`~cals_seg.runs.run.load_run` of ``run`` and
            ``checkpoint`` on the CPU in float32), so that it is read once.

    Returns:
        The metadata written to ``<out>.json``.

    Raises:
        UserError / FileNotFoundError: a bad argument, run or calibrator file, a calibrator a
            format cannot hold, a folder that cannot be written; one line naming the fix.
    """
    from cals_seg.runs.run import load_run

    if calibrator is not None and calibrator not in calibrator_choices():
        raise UserError(f"--calibrator: expected one of {list(calibrator_choices())}, got "
                        f"{calibrator!r}.")
    if fmt not in FORMATS:
        raise UserError(f"--format: expected one of {list(FORMATS)}, got {fmt!r}.")
    if (calibrator, fmt) in REFUSED:
        raise UserError(f"--format {fmt} --calibrator {calibrator}: {REFUSED[calibrator, fmt]}")
    if loaded is None:
        family = export_family(run, checkpoint)
        loaded = load_run(run, checkpoint, device="cpu", amp="none", family=family)
    run_dir, cfg, model = loaded.path, loaded.config, loaded.model
    classifier = loaded.family == "classification"
    side = None
    if classifier:  # the same program without space: (N, 3, S, S) -> (N, K)
        export_family(loaded.checkpoint)  # a text run refused in one line
        if min_size is not None:
            raise UserError(f"--min-size: an image classifier's program takes the inputs of "
                            f"its training, {cfg.data.image_size} x {cfg.data.image_size} "
                            "(data.image_size); leave --min-size out.")
        side = int(cfg.data.image_size)
        try:
            calibration = _calibration(loaded, calibrator, logits)
        except UserError as err:  # a classification run's calibrators are eval_cls's
            text = str(err).replace("tools/eval_seg.py", "tools/eval_cls.py")
            raise type(err)(text) if type(err).__init__ is UserError.__init__ else \
                UserError(text) from None
    else:
        calibration = _calibration(loaded, calibrator, logits)
        e = cfg.eval
        if e.mode != "whole" or e.resize is not None or e.pad is not None:
            warnings.warn(f"{run_dir} is evaluated with eval.mode={e.mode}, resize={e.resize}, "
                          f"pad={e.pad}; the exported program runs the network once on the "
                          "whole image as given: resize or tile images before calling it.",
                          stacklevel=2)
    module = CalibratedSegmenter(model, calibration["temperature"] or 1.0,
                                 multiple=1 if classifier else input_multiple(model),
                                 logits=logits, calibrator=calibration["module"], fmt=fmt)
    if conformal is not None:
        module = ConformalSegmenter(module, conformal)
    what = (f"this network with the calibrator {calibration['name']}"
            if calibration["module"] is not None else "this network")
    path = export_program(module, out, fmt, min_size, what, side=side)
    cal = calibration["module"]
    shape = ["N", "K"] if classifier else ["N", "K", "H", "W"]
    info = {
        "format": fmt,
        "run": str(run_dir),
        "family": loaded.family,
        "input": {"name": INPUT_NAME, "shape": ["N", 3, "H", "W"], "dtype": "float32",
                  "range": [0, 255], "channels": "RGB", "min_size": module.min_size},
        "output": {"name": OUTPUT_NAMES[logits], "shape": shape,
                   "what": "logits" if logits else "softmax(logits / T)" if cal is None
                   else f"softmax({calibration['name']}(logits))"},
        # The network's forward precision (the vocabulary of metrics.json: none is float32);
        # the calibration and the softmax are float32 too.
        "precision": "none",
        "calibrator": calibration["name"],
        "calibrator_file": calibration["file"],
        "temperature": calibration["temperature"],
        "normalisation": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        "num_classes": cfg.data.num_classes,
        "class_names": list(loaded.class_names),
    }
    if cal is not None:
        info["calibrator_params"] = _plain(dict(cal.params))
        if hasattr(cal.export_module(fmt), "thresholds"):
            info["bands"] = BANDS_RULE
    if getattr(module, "onnx_check", None) is not None:
        info["onnx_check"] = {"max_difference_to_pt2": module.onnx_check,
                              "tolerance": ONNX_TOLERANCE}
    if classifier:
        info["input"].update(shape=["N", 3, side, side], size=side, resize=(
            f"shorter side to {getattr(cfg.data, 'eval_size', None) or side}, centre crop of "
            f"{side} x {side} (as predict_cls and the evaluation make the network input)"))
    if conformal is not None:
        info["outputs"] = [OUTPUT_NAMES[logits], SETS_NAME]
        where = "input's" if classifier else "pixel's"
        info["conformal"] = {
            "output": {"name": SETS_NAME, "shape": shape, "dtype": "bool",
                       "what": f"class k is in the {where} set (scores of softmax(logits), "
                       "T = 1)"},
            "alpha": conformal.alpha, "mode": conformal.mode, "score": conformal.score,
            "seed": conformal.seed, "threshold": conformal.thresholds(),
            "calibration_images": conformal.calibration_images}
    try:
        Path(f"{path}.json").write_text(json.dumps(info, indent=2) + "\n")
    except OSError as err:
        from cals_seg.utils.paths import os_error

        raise os_error(err, f"{path}.json", "write") from None
    return info


# How the program's boundary bands are made (the JSON of a boundary calibrator's export).
BANDS_RULE = ("from the program's own argmax map (first maximal class): a boundary pixel has one "
              "of its 8 neighbours inside the image predicted as another class; d is the exact "
              "Euclidean distance to the nearest boundary pixel of the image; band i holds "
              "bands[i-1] <= d < bands[i] (the fitted calibrator's definition)")


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


__all__ = ["calibrator_choices", "FORMATS", "REFUSED", "CalibratedSegmenter", "ConformalSegmenter",
           "export_family", "export_program", "export_run", "normalisation_constants",
           "trace_fixed", "trace_program", "written_files"]
