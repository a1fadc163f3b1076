"""Export a trained segmentation run as a standalone program: ONNX, or a ``torch.export`` ``.pt2``.

The exported program maps a float32 RGB batch ``(N, 3, H, W)`` with values in ``[0, 255]`` to
calibrated probabilities ``(N, K, H, W)`` at the input's resolution (raw logits with
``logits=True``). Everything between is inside the program:

1. zero-pad the image at the bottom / right to the next multiple of the network's output stride
   (what the toolkit's evaluation does: a zero pixel normalises to ``-mean / std``, its padding
   value), written with index arithmetic so that ``H`` and ``W`` stay dynamic;
2. normalise, ``(x / 255 - mean) / std`` (ImageNet statistics, as in training);
3. run the network and crop the padding off the logits;
4. divide by the run's temperature (fitted on the validation split, ``temperature.json``) and
   take the softmax over the K classes.

``N``, ``H`` and ``W`` are dynamic: one file serves every batch size and image size with sides
``>= min_size`` (default: twice the output stride, e.g. 32 pixels for stride 16; smaller
inputs make the network's deepest feature map 1 x 1, which the traced program does not cover).
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
``(N, K, H, W)`` bool that ``predict_seg --conformal`` writes (:class:`ConformalSegmenter`)::

    probs, sets = torch.export.load("model.pt2").module()(images)
    probs, sets = session.run(None, {"image": images.numpy()})

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

from cals_seg.errors import UserError
from cals_seg.evaluation.inference import IMAGENET_MEAN, IMAGENET_STD, input_multiple

FORMATS = ("onnx", "pt2")
# Post-hoc calibrators an exported program can apply: the run's temperature, or none (T = 1).
CALIBRATORS = ("ts", "none")
INPUT_NAME, OUTPUT_NAMES, SETS_NAME = "image", {False: "probs", True: "logits"}, "sets"


def _zero_pad(x: Tensor, dim: int, size: Any, length: Any) -> Tensor:
    """``x`` zero-padded along ``dim`` from ``length`` to ``size >= length`` entries.

    A gather of the clamped indices times a 0/1 mask instead of ``F.pad``: ``F.pad`` branches
    on whether the pad is zero, which ties a dynamic size to one case when exported.
    """
    index = torch.arange(size, device=x.device)
    keep = (index < length).to(x.dtype)
    shape = [1] * x.dim()
    shape[dim] = size
    return x.index_select(dim, index.clamp(max=length - 1)) * keep.view(shape)


class CalibratedSegmenter(nn.Module):
    """A segmentation network with its input normalisation and calibration built in.

    ``forward(x) = softmax(crop(model(normalise(pad(x)))) / T)`` over the classes, or the
    cropped logits with ``logits=True``.

    Args:
        model: maps normalised ``(N, 3, h, w)`` (sides divisible by ``multiple``) to logits
            ``(N, K, h, w)``; put in eval mode here.
        temperature: ``T > 0`` (1.0: uncalibrated softmax).
        mean, std: per-channel statistics of ``[0, 1]`` RGB pixels.
        multiple: the side multiple the network needs (its output stride).
        logits: return the logits instead of the probabilities.

    Shape:
        ``x (N, 3, H, W)`` float32 in ``[0, 255]`` -> ``(N, K, H, W)`` float32.
    """

    def __init__(self, model: nn.Module, temperature: float = 1.0,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 multiple: int = 1, logits: bool = False) -> None:
        super().__init__()
        if not (isinstance(temperature, int | float) and temperature > 0):
            raise ValueError(f"Expected a temperature > 0, but got {temperature!r}.")
        if not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"Expected `multiple` to be a positive integer, but got {multiple!r}.")
        self.model = model.eval()
        self.multiple, self.logits, self.temperature = multiple, logits, float(temperature)
        # (x / 255 - mean) / std = (x - 255 mean) / (255 std)
        f32 = torch.float32
        self.register_buffer("shift", 255.0 * torch.tensor(mean, dtype=f32).view(1, 3, 1, 1))
        self.register_buffer("scale", 255.0 * torch.tensor(std, dtype=f32).view(1, 3, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.outputs(x)[0]

    def outputs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(forward(x), the cropped logits)``."""
        h, w = x.shape[-2], x.shape[-1]
        m = self.multiple
        if m > 1:
            x = _zero_pad(x, 2, (h + m - 1) // m * m, h)
            x = _zero_pad(x, 3, (w + m - 1) // m * m, w)
        out = self.model((x - self.shift) / self.scale)
        if m > 1:  # crop the padding off
            out = out.index_select(2, torch.arange(h, device=x.device))
            out = out.index_select(3, torch.arange(w, device=x.device))
        if self.logits:
            return out, out
        return torch.softmax(out / self.temperature, dim=1), out


class ConformalSegmenter(nn.Module):
    """A :class:`CalibratedSegmenter` that also returns the conformal prediction sets of a
    fitted :class:`~cals_seg.evaluation.conformal.ConformalSets` (what ``predict_seg
    --conformal`` writes): class ``k`` is in a pixel's set when its score (LAC ``1 - p_k`` or
    randomised APS, :func:`~cals_seg.evaluation._scores.class_scores`, on ``p = softmax`` of the
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
        from cals_seg.evaluation._scores import class_scores

        out, raw = self.segmenter.outputs(x)
        n, k, h, w = raw.shape
        probs = torch.softmax(raw.float(), dim=1).reshape(n, k, h * w)
        scores = class_scores(probs, self.score, self.seed)
        return out, (scores <= self.threshold).reshape(n, k, h, w)


def _dynamic_shapes(min_size: int) -> dict[str, dict[int, Any]]:
    dim = torch.export.Dim
    return {"x": {0: dim("batch", min=1, max=4096), 2: dim("height", min=min_size),
                  3: dim("width", min=min_size)}}


def export_program(module: CalibratedSegmenter | ConformalSegmenter, path: str | Path, fmt: str,
                   min_size: int | None = None) -> Path:
    """Write ``module`` as ONNX (``fmt="onnx"``) or a ``torch.export`` program (``"pt2"``),
    with dynamic batch size, height and width (sides ``>= min_size``, default ``2 * multiple``).
    A :class:`ConformalSegmenter` has a second output, ``sets``.

    Raises:
        ValueError: an unknown format.
        ImportError: ONNX without the ``onnx`` / ``onnxscript`` packages (with the command).
    """
    if fmt not in FORMATS:
        raise UserError(f"--format: expected one of {list(FORMATS)}, got {fmt!r}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{path}.data").unlink(missing_ok=True)  # a sidecar of an earlier export
    module = module.eval().to("cpu", torch.float32)
    min_size = min_size or max(2 * module.multiple, 16)
    # Two images whose sides are no multiple of the stride: nothing gets specialised on them.
    example = (torch.rand(2, 3, min_size + 3, min_size + 5) * 255,)
    dynamic = _dynamic_shapes(min_size)
    if fmt == "pt2":
        with torch.no_grad():
            program = torch.export.export(module, example, dynamic_shapes=dynamic)
        torch.export.save(program, path)
        return path
    for package in ("onnx", "onnxscript"):
        try:
            importlib.import_module(package)
        except ImportError:
            raise ImportError(
                f"--format onnx needs the {package} package; install it with: "
                f'pip install "cals_seg[export]" (or: pip install onnx onnxscript onnxruntime).'
            ) from None
    # One self-contained file (weights inside), unless they pass protobuf's 2 GB limit: then
    # the weights go to FILE.data next to it, and written_files() names both.
    if isinstance(module, ConformalSegmenter) and module.score == "aps":
        raise UserError("--format onnx --conformal score=aps: the APS randomisation reads the "
                        "bits of the probabilities, which ONNX cannot; use --format pt2, or "
                        "score=lac.")
    external = _weight_bytes(module) > ONNX_SINGLE_FILE_LIMIT
    names = [OUTPUT_NAMES[module.logits]]
    names += [SETS_NAME] if isinstance(module, ConformalSegmenter) else []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example, str(path), dynamo=True, dynamic_shapes=dynamic,
                          input_names=[INPUT_NAME], output_names=names,
                          verbose=False, external_data=external)
    return path


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


def export_run(run: str | Path, out: str | Path, fmt: str = "onnx", calibrator: str = "ts",
               logits: bool = False, checkpoint: str = "best",
               min_size: int | None = None, conformal: Any = None) -> dict[str, Any]:
    """Export a trained segmentation run; writes ``out`` and ``<out>.json`` (what the program
    expects and returns: input name and range, normalisation, class names, temperature, and
    the conformal threshold).

    Args:
        run: a run directory (or a checkpoint file inside one).
        out: the file to write (``.onnx`` / ``.pt2``).
        fmt: ``onnx`` or ``pt2``.
        calibrator: ``ts`` (the run's fitted temperature) or ``none``.
        logits: output raw logits instead of calibrated probabilities.
        checkpoint: ``best`` or ``last`` (for a run directory; read by
            :func:`cals_seg.runs.run.load_run`).
        min_size: smallest height / width the program accepts (default ``2 * stride``).
        conformal: a fitted :class:`~cals_seg.evaluation.conformal.ConformalSets` (on the
            run's logits, mode ``risk``, ``image:TAU`` or ``class``): the program also returns
            its prediction sets, ``(N, K, H, W)`` bool (:class:`ConformalSegmenter`).

    Returns:
        The metadata written to ``<out>.json``.

    Raises:
        ValueError / FileNotFoundError: a bad argument or run, naming the fix.
    """
    from cals_seg.runs.run import load_run

    if calibrator not in CALIBRATORS:
        raise UserError(f"--calibrator: expected one of {list(CALIBRATORS)}, got {calibrator!r}.")
    if fmt not in FORMATS:
        raise UserError(f"--format: expected one of {list(FORMATS)}, got {fmt!r}.")
    loaded = load_run(run, checkpoint, device="cpu", amp="none", family="segmentation")
    run_dir, cfg, model, fitted = loaded.path, loaded.config, loaded.model, loaded.temperature
    temperature = 1.0
    if calibrator == "ts" and not logits:
        if fitted is None:
            raise UserError(f"{run_dir} has no {loaded.run.temperature_file.name} (the run did "
                             "not finish, or eval.temperature_scaling is false); export with "
                             "--calibrator none for uncalibrated probabilities.")
        temperature = fitted
    e = cfg.eval
    if e.mode != "whole" or e.resize is not None or e.pad is not None:
        warnings.warn(f"{run_dir} is evaluated with eval.mode={e.mode}, resize={e.resize}, "
                      f"pad={e.pad}; the exported program runs the network once on the whole "
                      "image as given: resize or tile images before calling it.", stacklevel=2)
    module = CalibratedSegmenter(model, temperature, multiple=input_multiple(model),
                                 logits=logits)
    if conformal is not None:
        module = ConformalSegmenter(module, conformal)
    path = export_program(module, out, fmt, min_size)
    info = {
        "format": fmt,
        "run": str(run_dir),
        "input": {"name": INPUT_NAME, "shape": ["N", 3, "H", "W"], "dtype": "float32",
                  "range": [0, 255], "channels": "RGB",
                  "min_size": min_size or max(2 * module.multiple, 16)},
        "output": {"name": OUTPUT_NAMES[logits], "shape": ["N", "K", "H", "W"],
                   "what": "logits" if logits else "softmax(logits / T)"},
        "calibrator": "none" if logits else calibrator,
        "temperature": None if logits else temperature,
        "normalisation": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        "num_classes": cfg.data.num_classes,
        "class_names": list(loaded.class_names),
    }
    if conformal is not None:
        info["outputs"] = [OUTPUT_NAMES[logits], SETS_NAME]
        info["conformal"] = {
            "output": {"name": SETS_NAME, "shape": ["N", "K", "H", "W"], "dtype": "bool",
                       "what": "class k is in the pixel's set (scores of softmax(logits), T = 1)"},
            "alpha": conformal.alpha, "mode": conformal.mode, "score": conformal.score,
            "seed": conformal.seed, "threshold": conformal.thresholds(),
            "calibration_images": conformal.calibration_images}
    Path(f"{path}.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


__all__ = ["CALIBRATORS", "FORMATS", "CalibratedSegmenter", "ConformalSegmenter", "export_program",
           "export_run", "written_files"]
