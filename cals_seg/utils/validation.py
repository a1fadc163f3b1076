"""Input checks shared by the losses, the meters, the calibrators and the data generators.

One copy of each check, so a user sees the same message whichever entry point rejects the input.
Argument checks raise :class:`~cals_seg.errors.UserError` (a ``ValueError``), with one message
formula: "Expected `x` to be ..., but got ...".
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import Tensor

from cals_seg.errors import UserError


def check_int(name: str, value: object, minimum: int = 1) -> None:
    """Raise :class:`~cals_seg.errors.UserError` unless ``value`` is a Python ``int`` (not a
    bool) ``>= minimum``; the message names the argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UserError(f"Expected `{name}` to be {what}, but got {value!r}.")


def check_ignore_index(value: object) -> None:
    """Raise :class:`~cals_seg.errors.UserError` unless ``ignore_index`` is a Python ``int``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"Expected `ignore_index` to be an integer, but got {value!r}.")


def check_positive_float(name: str, value: object) -> None:
    """Raise :class:`~cals_seg.errors.UserError` unless ``value`` is a finite number ``> 0``."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok and value > 0 and math.isfinite(value)):  # type: ignore[operator,arg-type]
        raise UserError(f"Expected `{name}` to be a positive finite number, but got {value!r}.")


def check_tensors(logits: object, target: object, call: str) -> None:
    """Raise :class:`~cals_seg.errors.UserError` unless ``logits`` and ``target`` are tensors,
    naming what was passed and the fix: a model's output dict (torchvision's
    ``{"out": logits, "aux": ...}``) or tuple is the usual mistake.

    Args:
        call: how the user called it, for the fix (``"criterion"``, ``"meter.update"``).
    """
    for name, value in (("logits", logits), ("target", target)):
        if isinstance(value, Tensor):
            continue
        what = f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")
        if isinstance(value, Mapping):
            keys = [str(k) for k in list(value)[:4]]
            key = "out" if "out" in keys else keys[0] if keys else "out"
            raise UserError(
                f"Expected `{name}` to be a tensor, but got {what} with keys {keys} (a model's "
                f"output dict, e.g. torchvision's {{'out': logits}}); pass the tensor: "
                f"{call}(model(x)[{key!r}], y).")
        if isinstance(value, tuple | list):
            raise UserError(
                f"Expected `{name}` to be a tensor, but got {what} of {len(value)} items (a "
                f"model's output tuple?); pass the tensor: {call}(model(x)[0], y).")
        raise UserError(f"Expected `{name}` to be a tensor, but got {what}.")


def check_finite(logits: Tensor, maxima: Tensor | None = None) -> None:
    """Raise ``ValueError`` if ``logits`` holds NaN or +-inf.

    Cheap path: NaN and +inf show in the per-position maximum (pass it when the caller already
    has it, else it is computed here), -inf in the per-position minimum, and any of them makes
    the sum of both non-finite; the full count is only taken when that sum is not finite (it can
    also overflow on huge but finite logits, which then pass).

    Shape:
        - logits: ``(N, K, P)``; maxima: ``(N, P)`` (or ``(N, 1, P)``).
    """
    if maxima is None:
        maxima = logits.amax(dim=1)
    total = logits.amin(dim=1).add_(maxima.reshape(logits.shape[0], logits.shape[2])).sum()
    if not bool(total.isfinite()):
        bad = int((~logits.isfinite()).sum())
        if bad:
            raise ValueError(
                f"Expected `logits` to be finite, but got {bad} non-finite values (NaN or inf)."
            )
