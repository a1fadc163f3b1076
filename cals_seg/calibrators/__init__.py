"""Post-hoc calibrators: fitted on the validation split, applied to a trained network's logits.

Every calibrator is a :class:`Calibrator` (an ``nn.Module``): ``fit(batches, ignore_index)``
streams over validation batches, ``forward(logits, image=None)`` returns calibrated logits of
the same shape. ``changes_argmax`` says whether the calibrated prediction can differ from the
network's; ``needs_image`` whether ``forward`` needs the image.

    ========== =================================================== ============== ===========
    name       what                                                changes argmax needs image
    ========== =================================================== ============== ===========
    ts         one temperature                                     no             no
    vector     a scale and a bias per class                        yes            no
    dirichlet  matrix on log-probabilities, ODIR regularisation    yes            no
    lts        a temperature per pixel from a small conv net       no             yes
    selective  large temperature on pixels flagged as mispredicted no             no
    boundary_ts a temperature per predicted-boundary distance band no             no
    boundary_ts_fine boundary_ts, bands chosen on held-out val     no             no
    cms_ap     per-argmax-class affine map on gaps to the top      no             no
    cms_op     per-argmax-class affine map on consecutive gaps     no (no order)  no
    image_ts   a temperature per pixel from image and logit stats  no             yes
    ========== =================================================== ============== ===========

Example::

    cal = build_calibrator("boundary_ts", num_classes=21)
    cal.fit(lambda: ((model(x), y) for x, y in val_loader), ignore_index=255)
    probs = cal(model(x)).softmax(dim=1)
    save_calibrator(cal, "runs/my_run/calibrators/boundary_ts.pt", fitted_for=record)

A saved calibrator records what it was fitted for (the record of its
:class:`~cals_seg.utils.fits.FitKey`, made by :func:`calibrator_key`: the network by content
digest, the classes, the split and the digest of its image ids, the calibrator and its
parameters with ignore_index, the precision and protocol of the forward pass, and the data it
was fitted after), and every file read back is validated (:func:`load_calibrator`); a fit is
reused only when its record equals the key of the use at hand
(:meth:`cals_seg.utils.fits.FitStore.reuse`).
"""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from cals_seg.calibrators._base import Batches, Calibrator
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.errors import MissingPathError, UserError
from cals_seg.utils.fits import (
    FitKey,
    file_digest,
    ids_digest,
    members_digest,
    plain_record,
    protocol_record,
)
from cals_seg.utils.io import atomic_write

# The built-in calibrators register themselves in this order (that of the docs' tables and the
# tools' choices); a new file in this folder registers itself after them (CALIBRATORS discovers
# it the first time its names are read).
# isort: off
from cals_seg.calibrators.ts import TemperatureScaler, TemperatureScaling
from cals_seg.calibrators.vector import VectorScaling
from cals_seg.calibrators.dirichlet import DirichletCalibration
from cals_seg.calibrators.lts import LocalTemperatureScaling
from cals_seg.calibrators.selective import SelectiveScaling
from cals_seg.calibrators.boundary_ts import BoundaryTemperatureScaling
from cals_seg.calibrators.order_keeping import ArgmaxKeepingScaling, OrderKeepingScaling
from cals_seg.calibrators.boundary_ts_fine import FineBoundaryTemperatureScaling
from cals_seg.calibrators.image_ts import ImageTemperatureScaling
# isort: on


def build_calibrator(name: str, num_classes: int, **params: Any) -> Calibrator:
    """A new (identity) calibrator by name, e.g. ``build_calibrator("dirichlet", 21, lam=0.01)``.

    Raises:
        ValueError: unknown name or parameter (the valid ones are listed), or a bad value.
    """
    cls = CALIBRATORS.lookup(name)
    valid = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self",
                                                                                "num_classes")]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise UserError(
            f"Unknown parameter(s) {unknown} for calibrator {name!r}; valid ones are {valid}."
        )
    return cls(num_classes, **params)


# Fitted state that must be positive (a temperature of 0 or below is no calibration).
_POSITIVE_STATE = ("temperature", "temperatures")


class CalibratorFileError(UserError):
    """A saved calibrator that cannot be used: its message is one line naming the file, what
    is wrong (``reason``) and the fix."""

    def __init__(self, path: Path, reason: str, hint: str) -> None:
        super().__init__(f"{path} {reason}; {hint}")
        self.path, self.reason, self.hint = path, reason, hint


def refit_command(run_path: str | Path | None, name: str) -> str:
    """The command that refits calibrator ``name`` of the run at ``run_path``."""
    run = run_path if run_path is not None else "RUN"
    return f"tools/eval_seg.py {run} --calibrators {name} --refit-calibrators"


def network_digest(run: Any) -> str:
    """The content digest of ``run``'s network: of its checkpoint file, or for an ensemble
    (``run.extra["ensemble"]["members"]``: the members' checkpoints) of the set of members
    (:func:`cals_seg.utils.fits.members_digest`: a byte-identical copy is the same network)."""
    members = (getattr(run, "extra", None) or {}).get("ensemble", {}).get("members")
    if members:
        return members_digest(members)
    return file_digest(run.checkpoint)


def resolved_params(name: str, num_classes: int | None,
                    params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every constructor parameter of calibrator ``name`` with ``params`` applied (the
    defaults filled in), as plain values: a fit made with the defaults equals one that named
    them.

    Raises:
        UserError: an unknown calibrator or parameter, or a bad value.
    """
    try:
        return plain_record(build_calibrator(name, num_classes, **dict(params or {})).params)
    except UserError:
        raise
    except (TypeError, ValueError) as err:
        raise UserError(f"calibrator {name}: {' '.join(str(err).split())}") from None


def calibrator_key(
    run: Any,
    name: str,
    params: Mapping[str, Any] | None = None,
    split_ids: Sequence[Any] | None = None,
    *,
    split: str = "val",
    data: str = "clean",
    precision: str | None = None,
    protocol: Any = None,
) -> FitKey:
    """What a fit of calibrator ``name`` on ``run`` is for: the key that
    :func:`save_calibrator` records and :meth:`~cals_seg.utils.fits.FitStore.reuse` compares.

    The network (content digest of the checkpoint; an ensemble: of the members), the classes
    (count and names), the split and the digest of the fit images' ids in order, the
    calibrator's every constructor parameter and ``ignore_index``, the precision and protocol
    of the forward pass, and ``after`` the data it saw (``clean`` or the drift mixture's key).

    A caller that has no data (``predict_seg``, ``export``) leaves ``params`` and ``split_ids``
    None: they are then unknown fields of the key, not compared.

    Args:
        run: a loaded :class:`cals_seg.runs.run.Run` (``checkpoint``, ``config``,
            ``class_names``, ``precision``, ``protocol``, ``extra``).
        name, params: the calibrator and the parameters given for it.
        split_ids: the ids of the images the fit sees (``task.val_set.ids``).
        split: the split those images come from.
        data: ``"clean"``, or the key of the corruption mixture the fit sees.
        precision, protocol: of the forward pass, when not the run's own.

    Raises:
        UserError: an unknown calibrator or parameter (``params`` are resolved).
    """
    cfg = run.config.data
    names = getattr(run, "class_names", None)
    unknown = (() if params is not None else ("params",)) + \
        (() if split_ids is not None else ("split", "ids"))
    return FitKey(
        "calibrator", name, network_digest(run),
        {"num_classes": cfg.num_classes, "names": list(names) if names else None},
        split=split if split_ids is not None else None,
        ids=ids_digest(split_ids) if split_ids is not None else None,
        params={**(resolved_params(name, cfg.num_classes, params) if params is not None
                   else {}), "ignore_index": cfg.ignore_index},
        precision=precision if precision is not None else run.precision,
        protocol=protocol_record(protocol if protocol is not None
                                 else getattr(run, "protocol", None)),
        after=data, unknown=unknown)


def save_calibrator(calibrator: Calibrator, path: str | Path,
                    fitted_for: FitKey | Mapping[str, Any] | None = None) -> Path:
    """Write ``{"name", "num_classes", "params", "fit_info", "state", "fitted_for"}`` (tensors
    and plain types only, readable with ``torch.load(weights_only=True)``) to ``path``,
    atomically (a crash leaves the old file or the new one).

    Args:
        fitted_for: what the fit is for (:func:`calibrator_key`, or its record); None writes
            a file that is never reused.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().clone() for k, v in calibrator.state_dict().items()}
    payload = {"name": calibrator.name, "num_classes": calibrator.num_classes,
               "params": dict(calibrator.params), "fit_info": _plain(calibrator.fit_info),
               "state": state,
               "fitted_for": _record_of(fitted_for)}
    atomic_write(path, lambda tmp: torch.save(payload, tmp))
    return path


def _record_of(fitted_for: FitKey | Mapping[str, Any] | None) -> dict[str, Any] | None:
    if isinstance(fitted_for, FitKey):
        if fitted_for.unknown:
            raise ValueError(f"a key with unknown fields {list(fitted_for.unknown)} describes "
                             "a use, not a fit: it cannot be saved")
        return fitted_for.record()
    return plain_record(fitted_for) if fitted_for is not None else None


def load_calibrator(path: str | Path, map_location: str | torch.device = "cpu",
                    num_classes: int | None = None, hint: str | None = None) -> Calibrator:
    """The calibrator saved by :func:`save_calibrator` at ``path``, validated like a config.

    Checked before it is used: the file reads as tensors and plain types; it holds ``name``
    (a registered calibrator), ``num_classes`` (``num_classes``, the run's, when given),
    ``params`` (valid for that calibrator) and ``state`` (exactly the tensors such a
    calibrator holds, with their shapes and dtypes, finite; temperatures positive; a chosen
    candidate among the candidates); ``fit_info`` and ``fitted_for`` are mappings when present.
    The record is left in ``calibrator.fitted_for`` (None for an older file without one).

    Args:
        hint: the fix named in the messages (default: the ``eval_seg`` command that refits).

    Raises:
        MissingPathError: no such file.
        CalibratorFileError: anything else, in one line naming the file, what is wrong and the
            fix (never a shape traceback at the first use).
    """
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"{path}: no such calibrator file.")
    hint = hint or f"refit it: {refit_command(_run_of(path), path.stem)}"

    def refuse(reason: str) -> CalibratorFileError:
        return CalibratorFileError(path, reason, hint)

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (KeyError, TypeError, RuntimeError, ValueError, EOFError, OSError, AttributeError,
            IndexError, pickle.UnpicklingError) as err:  # truncated, unreadable, not a file of ours
        reason = " ".join(str(err).split())[:160] or type(err).__name__
        raise refuse(f"is not a saved calibrator (it cannot be read: {reason})") from None
    if not isinstance(saved, Mapping):
        raise refuse(f"is not a saved calibrator (it holds a {type(saved).__name__})")
    missing = [k for k in ("name", "num_classes", "params", "state") if k not in saved]
    if missing:
        raise refuse(f"is not a saved calibrator (no {', '.join(missing)})")
    name, k, params = saved["name"], saved["num_classes"], saved["params"]
    if not isinstance(name, str) or name not in CALIBRATORS:
        raise refuse(f"names calibrator {name!r}, not one of {sorted(CALIBRATORS)}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 2):
        raise refuse(f"holds num_classes={k!r}, not an integer >= 2")
    if num_classes is not None and k is not None and k != num_classes:
        raise refuse(f"was fitted for {k} classes, but the run has {num_classes}")
    if not isinstance(params, Mapping) or not all(isinstance(p, str) for p in params):
        raise refuse(f"holds params {params!r}, not a mapping of names to values")
    try:
        cal = build_calibrator(name, k, **params)
    except (TypeError, ValueError) as err:  # an unknown parameter, a bad value
        raise refuse(f"holds invalid params ({' '.join(str(err).split())[:160]})") from None
    _check_state(saved["state"], cal, params, refuse)
    for key in ("fit_info", "fitted_for"):
        if saved.get(key) is not None and not isinstance(saved[key], Mapping):
            raise refuse(f"holds {key} {saved[key]!r}, not a mapping")
    cal.load_state_dict(saved["state"])
    cal.fit_info = dict(saved.get("fit_info") or {})
    cal.fitted_for = dict(saved["fitted_for"]) if saved.get("fitted_for") else None
    return cal.to(map_location).eval()


def load_run_calibrator(run: Any, name: str, folder: str | Path | None = None) -> Calibrator:
    """Calibrator ``name`` saved for ``run`` (``<run>/calibrators/<name>.pt``, or ``folder``),
    for a use without data (``predict_seg``, ``export``): read by :func:`load_calibrator`
    (validated, the run's class count) and used only when its record matches the run on
    every field such a use knows (:func:`calibrator_key` without params and image ids: the
    network's digest, the classes, the calibrator, the precision and protocol of the forward
    pass, clean data).

    Args:
        run: a loaded :class:`cals_seg.runs.run.Run` (its ``precision`` and ``protocol`` are the
            ones the calibrator will see).

    Raises:
        MissingPathError: no saved fit (the message gives the command that fits it).
        UserError: a file that cannot be used, or a fit made for something else: one line
            naming the file, the recorded key that differs and the command that refits it.
    """
    folder = Path(folder) if folder is not None else Path(run.path) / "calibrators"
    path = folder / f"{name}.pt"
    command = refit_command(run.path, name)
    if not path.is_file():
        raise MissingPathError(f"{path} does not exist: fit it first with "
                               f"{command.replace(' --refit-calibrators', '')}.")
    cal = load_calibrator(path, run.device, num_classes=run.config.data.num_classes,
                          hint=f"refit it: {command}")
    problem = calibrator_key(run, name).problem(cal.fitted_for)
    if problem is not None:
        key, reason = problem
        also = ""
        if key == "precision" and cal.fitted_for and "precision" in cal.fitted_for:
            also = (f" (or use the fit's precision: --amp {cal.fitted_for['precision']}; to "
                    f"refit at this one add --set train.amp={run.precision})")
        elif key == "protocol":
            also = " (or use the evaluation protocol the fit was made with)"
        what = "" if key == "record" else f" [{key}]"
        raise UserError(f"{path} {reason}{what}; refit it: {command}{also}.")
    return cal


def _check_state(state: Any, cal: Calibrator, params: Mapping[str, Any], refuse: Any) -> None:
    """Raise ``refuse(reason)`` unless ``state`` holds exactly ``cal``'s tensors, with their
    shapes and dtypes, finite, temperatures positive and a chosen candidate in range."""
    expected = cal.state_dict()
    if not isinstance(state, Mapping) or not all(
            isinstance(v, torch.Tensor) for v in state.values()):
        raise refuse("holds a state that is not a mapping of tensors")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise refuse(f"lacks the state {missing[:3]} of the calibrator {cal.name!r}")
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise refuse(f"holds state {unknown[:3]} that a {cal.name} calibrator does not have")
    for key, ref in expected.items():
        value = state[key]
        if tuple(value.shape) != tuple(ref.shape) or value.dtype != ref.dtype:
            raise refuse(f"holds state {key} of {str(value.dtype)[6:]} {tuple(value.shape)}; a "
                         f"{cal.name} calibrator for {cal.num_classes} classes holds "
                         f"{str(ref.dtype)[6:]} {tuple(ref.shape)}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise refuse(f"holds NaN or infinite values in state {key}")
        if key.split(".")[-1] in _POSITIVE_STATE and not bool((value > 0).all()):
            raise refuse(f"holds a temperature <= 0 in state {key}")
        if key == "choice":
            count = len(params.get("candidates") or ())
            if not 0 <= int(value) < count:
                raise refuse(f"holds choice={int(value)}, not one of its {count} candidates")


def _run_of(path: Path) -> Path | str:
    """The run folder of a calibrator file (``<run>/calibrators/<name>.pt``), for messages."""
    return path.parent.parent if path.parent.name == "calibrators" else "RUN"


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return obj


__all__ = [
    "CALIBRATORS",
    "Batches",
    "ArgmaxKeepingScaling",
    "BoundaryTemperatureScaling",
    "Calibrator",
    "CalibratorFileError",
    "DirichletCalibration",
    "FineBoundaryTemperatureScaling",
    "ImageTemperatureScaling",
    "LocalTemperatureScaling",
    "OrderKeepingScaling",
    "SelectiveScaling",
    "TemperatureScaler",
    "TemperatureScaling",
    "VectorScaling",
    "build_calibrator",
    "calibrator_key",
    "load_calibrator",
    "load_run_calibrator",
    "network_digest",
    "refit_command",
    "save_calibrator",
]
