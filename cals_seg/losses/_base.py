"""Machinery shared by every loss: input checks, float32 computation, the valid-position mask.

A reader who wants a loss formula can skip this file: it only enforces the common contract
(logits ``(N, K, *S)``, targets ``(N, *S)``, means over valid positions only, float32 whatever
autocast context surrounds the call).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import ClassVar

import torch
from torch import Tensor, nn

from cals_seg.utils.validation import check_tensors

_HALF = (torch.float16, torch.bfloat16)
_INT32 = (-(2**31), 2**31 - 1)


def autocast_off(device: torch.device) -> AbstractContextManager:
    """A context that switches autocast off on ``device`` (a no-op where it has none).

    Autocast would run the criterion's reductions in the autocast dtype; the losses, ``observe``
    and the analytic backward compute in float32 instead, whatever context surrounds them.
    """
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except (RuntimeError, ValueError):  # a device type without autocast support
        return nullcontext()


def as_float32(logits: Tensor) -> Tensor:
    """float16 / bfloat16 logits upcast to float32 (differentiable: the gradient comes back in
    the logits' dtype); float32 and float64 unchanged."""
    return logits.float() if logits.dtype in _HALF else logits


class SegLoss(nn.Module):
    """Base class: a criterion on logits ``(N, K, *S)`` and targets ``(N, *S)``.

    Subclasses implement :meth:`_forward` and may store detached loss terms in ``self.terms``
    (a dict of 0-dim tensors, e.g. ``{"ce": ..., "penalty": ...}``) for logging; no ``.item()``
    is called inside the loss, so logging costs no device synchronisation unless it is read.

    Label check: a call with a target outside ``[0, K)`` that is not ``ignore_index`` raises,
    at that call, as ``F.cross_entropy`` does. By default (``deferred_checks = True``) the call
    still converts no tensor to a Python value and compiles to one graph: the test is
    ``torch._assert_async`` (:func:`assert_labels`). On the CPU that assertion is checked at
    once (there is no device to wait for) and the call raises ``ValueError`` listing the
    values; on an accelerator it is a device-side assertion, so the step is not held up by a
    synchronisation and the error comes at the device's next synchronisation, as
    ``F.cross_entropy``'s own device-side assertion does. Under ``torch.compile`` the
    assertion is part of the graph (``RuntimeError`` with the same message, without the
    values). Bad targets are also treated as ``ignore_index`` (so no kernel indexes with
    them), their count is left in ``self.bad_labels`` (0-dim int64 tensor, this call's) and
    added to a device-side count read by :meth:`check`, ``observe`` and
    ``update_multipliers`` (adaptive losses) and by
    :func:`cals_seg.training.engine.train_one_epoch` every ``CHECK_EVERY`` steps.
    ``deferred_checks = False`` (``train.debug_checks``) checks each call on the host instead
    and lists the values on every device (a synchronisation per call, and a graph break under
    ``torch.compile``).

    Args:
        num_classes: K.
        ignore_index: target value of void positions; excluded from every mean.

    Class attributes:
        extra_inputs: names of per-pixel maps the loss takes as keyword arguments of
            ``forward`` besides ``(logits, target)`` (e.g. ``("band",)``); the training data
            provides them (:mod:`cals_seg.data.extra_inputs`). Empty for most losses.
    """

    extra_inputs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, num_classes: int, ignore_index: int = -100) -> None:
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(
                f"Expected `num_classes` to be an integer >= 2, but got {num_classes!r}."
            )
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.terms: dict[str, Tensor] = {}
        self.deferred_checks = True
        self.bad_labels: Tensor | None = None
        # the sum of bad_labels since the last check() (a CPU 0-dim tensor adds to any device)
        self._unchecked_bad_labels = torch.zeros((), dtype=torch.int64)

    def check(self) -> None:
        """Read the device-side count of bad targets of the calls since the last check (one
        host read) and raise if there were any; the count starts again from zero.

        Raises:
            ValueError: targets outside ``[0, K)`` other than ``ignore_index`` were seen.
        """
        pending = self._unchecked_bad_labels
        self._unchecked_bad_labels = torch.zeros_like(pending)
        count = int(pending)
        if count:
            raise ValueError(
                f"{bad_labels_message(count, self.num_classes, self.ignore_index)} (found by the "
                "criterion's deferred label check; set `criterion.deferred_checks = False` to "
                "stop at the first such batch and list the values)"
            )

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        """Scalar loss.

        Shape:
            logits: ``(N, K, *S)`` floating point, any number of spatial dims (zero included);
                float16 / bfloat16 are computed in float32 (the gradient has their dtype).
            target: ``(N, *S)`` integer class indices in ``[0, K)`` or ``ignore_index``.

        Autocast is switched off inside: under ``torch.autocast`` the value and gradient are
        the float32 ones.

        Raises:
            ValueError: a non-tensor input (a model's output dict: pass ``model(x)["out"]``), bad
                shapes or dtypes; targets out of range (on an accelerator with the
                default ``deferred_checks``: a device-side assertion, reported at the device's
                next synchronisation; under ``torch.compile``: ``RuntimeError``).
        """
        check_tensors(logits, target, "criterion")  # e.g. a model's output dict, named
        with autocast_off(logits.device):
            return self._forward(*self._prepare(as_float32(logits), target,
                                                deferred=self.deferred_checks))

    def _prepare(self, logits: Tensor, target: Tensor,
                 deferred: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Checked ``(logits, target, valid)`` as :meth:`_forward` and ``_observe`` take them:
        flattened to ``(N, K, S)``, ``(N, S)``, ``(N, S)`` by default; a loss that needs the
        spatial layout (:mod:`cals_seg.losses._spatial`) keeps it. ``deferred``: the label
        check of ``deferred_checks`` (see the class docstring)."""
        return self._check_flatten(logits, target, deferred)

    def _check_flatten(self, logits: Tensor, target: Tensor,
                       deferred: bool) -> tuple[Tensor, Tensor, Tensor]:
        """:func:`check_and_flatten`, or with ``deferred`` :func:`flatten_deferred` (the count
        of bad targets left in ``self.bad_labels``)."""
        if deferred:
            logits3, target2, valid, bad = flatten_deferred(
                logits, target, self.num_classes, self.ignore_index
            )
            assert_labels(bad, target, self.num_classes, self.ignore_index)  # at the call
            self.bad_labels = bad
            self._unchecked_bad_labels = bad + self._unchecked_bad_labels
            return logits3, target2, valid
        return check_and_flatten(logits, target, self.num_classes, self.ignore_index)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        """Loss on flattened inputs: logits ``(N, K, S)``, target ``(N, S)``, valid ``(N, S)``."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, ignore_index={self.ignore_index}"


def check_and_flatten(
    logits: Tensor, target: Tensor, num_classes: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Validate the loss contract and flatten the spatial dims.

    Returns:
        ``logits (N, K, S)``, ``target (N, S)`` (void positions keep ``ignore_index``, as
        ``F.cross_entropy`` expects), and the boolean ``valid (N, S)`` mask. ``S = 1`` for
        ``(N, K)`` input.

    Raises:
        ValueError: non-floating logits, wrong K, logits/target shape mismatch, non-integer
            target, or target values outside ``[0, K)`` other than ``ignore_index``.
    """
    logits3, target2, valid, bad = _flatten(logits, target, num_classes, ignore_index)
    if bool(bad.any()):
        raise ValueError(bad_labels_message(torch.unique(target2[bad])[:10].tolist(),
                                            num_classes, ignore_index))
    return logits3, target2, valid


def bad_labels_message(values: list[int] | int | str, num_classes: int,
                       ignore_index: int) -> str:
    """The one-line error for targets outside ``[0, K)``: ``values`` lists them (the eager
    check), counts them (a deferred check, which no longer has the values), or is a word
    (``"some"``: the device-side assertion, which has neither)."""
    what = (f"values {values}" if isinstance(values, list)
            else f"{values} value(s)" if isinstance(values, int) else f"{values} values")
    return (f"`target` holds {what} outside [0, {num_classes}) that are not "
            f"ignore_index={ignore_index}; fix the labels or set ignore_index.")


def assert_labels(bad: Tensor, target: Tensor, num_classes: int, ignore_index: int) -> None:
    """Raise at the call when ``bad`` (the 0-dim count of targets outside ``[0, K)`` that are
    not ``ignore_index``) is not zero, without converting a tensor to a Python value.

    ``torch._assert_async(bad == 0, message)``: on the CPU it is checked at once, and the
    ``RuntimeError`` becomes the eager ``ValueError`` listing the values (read from ``target``
    only then); on an accelerator it is a device-side assertion (no synchronisation: the
    error surfaces at the device's next one, as ``F.cross_entropy``'s does); under
    ``torch.compile`` it is a node of the graph and raises ``RuntimeError`` with the message.

    Shape:
        ``bad`` 0-dim integer; ``target`` ``(N, *S)``.
    """
    message = bad_labels_message("some", num_classes, ignore_index)
    if torch.compiler.is_compiling() or bad.device.type != "cpu":
        torch._assert_async(bad == 0, message)
        return
    try:
        torch._assert_async(bad == 0, message)
    except RuntimeError:
        flat = target.reshape(-1).long()
        wrong = (flat != ignore_index) & ((flat < 0) | (flat >= num_classes))
        values = torch.unique(flat[wrong])[:10].tolist()
        raise ValueError(bad_labels_message(values, num_classes, ignore_index)) from None


def flatten_deferred(
    logits: Tensor, target: Tensor, num_classes: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`check_and_flatten` without a host synchronisation: the shape and dtype checks
    (host metadata) raise as there, but targets outside ``[0, K)`` are made ``ignore_index``
    (so no kernel indexes with them) and counted instead of raising.

    Returns:
        ``logits (N, K, S)``, ``target (N, S)``, ``valid (N, S)`` and the 0-dim int64 count of
        out-of-range targets.
    """
    logits3, target2, valid, bad = _flatten(logits, target, num_classes, ignore_index)
    if _INT32[0] <= ignore_index <= _INT32[1]:
        # The same values through int32 (``bad`` is taken in int64, so no large label can wrap
        # into range): inductor's C++ code then reads the cleaned targets as a plain load in
        # the cross-entropy's loops; the int64 ``masked_fill`` was recomputed inside them and
        # made the compiled cross-entropy 1.45x slower (8 x 21 x 256 x 256 logits, 1 thread).
        target2 = target2.int().masked_fill(bad, ignore_index).long()
    else:
        target2 = target2.masked_fill(bad, ignore_index)
    return logits3, target2, valid & ~bad, bad.sum()


def _flatten(
    logits: Tensor, target: Tensor, num_classes: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if not torch.is_tensor(logits) or not logits.is_floating_point():
        dtype = logits.dtype if torch.is_tensor(logits) else type(logits).__name__
        raise ValueError(f"Expected `logits` to be a floating point tensor, but got {dtype}.")
    if logits.dim() < 2:
        raise ValueError(
            f"Expected `logits` of shape (N, K, *S), but got shape {tuple(logits.shape)}."
        )
    if logits.shape[1] != num_classes:
        raise ValueError(
            f"Expected `logits` with {num_classes} classes in dim 1, but got shape "
            f"{tuple(logits.shape)}."
        )
    expected = logits.shape[:1] + logits.shape[2:]
    if target.shape != expected:
        raise ValueError(
            f"Expected `target` of shape {tuple(expected)} to match logits {tuple(logits.shape)} "
            f"(N, K, *S) -> (N, *S), but got {tuple(target.shape)}."
        )
    if target.is_floating_point() or target.dtype == torch.bool or target.is_complex():
        raise ValueError(
            f"Expected `target` to hold integer class indices, but got {target.dtype}."
        )
    n = logits.shape[0]
    logits3 = logits.reshape(n, num_classes, -1)
    target2 = target.reshape(n, -1).long()
    valid = target2 != ignore_index
    bad = valid & ((target2 < 0) | (target2 >= num_classes))
    return logits3, target2, valid, bad


def masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    """Mean of ``values (N, S)`` over ``valid`` positions; 0 (with zero gradient) if none."""
    total = values.masked_fill(~valid, 0.0).sum()
    return total / valid.sum().clamp(min=1)
