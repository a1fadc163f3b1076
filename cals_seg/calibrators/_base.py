"""The calibrator contract and the fitting machinery the methods share.

A calibrator maps logits ``(N, K, *S)`` (and, for some methods, the image) to calibrated logits
of the same shape. It is fitted on the validation split by :meth:`Calibrator.fit`, which streams
over a zero-argument callable returning a fresh iterator of ``(logits, target)`` or
``(logits, target, image)`` batches, as
:func:`cals_seg.calibrators.temperature.fit_temperature` does:
the memory is one batch plus the calibrator's state; a method that needs several passes (grid
refinement, L-BFGS iterations, epochs) calls it again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from cals_seg.calibrators.temperature import _valid_rows
from cals_seg.utils.distributed import all_reduce_sum_
from cals_seg.utils.validation import check_int, check_positive_float

Batch = tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor | None]
Batches = Callable[[], Iterable[Batch]]

# Positions per chunk when a fit builds an autograd graph over one batch: the float64 work
# tensors of a chunk hold about CHUNK_POSITIONS * K elements.
CHUNK_POSITIONS = 2**18


def iterate(batches: Batches) -> Iterator[tuple[Tensor, Tensor, Tensor | None]]:
    """``(logits, target, image or None)`` for every batch of one call of ``batches``."""
    for item in batches():
        if len(item) == 2:
            yield item[0], item[1], None
        elif len(item) == 3:
            yield item[0], item[1], item[2]
        else:
            raise ValueError(
                "Expected `batches()` to yield (logits, target) or (logits, target, image), "
                f"but got a tuple of {len(item)}."
            )


class Calibrator(nn.Module):
    """Base class: a post-hoc map from logits to calibrated logits, fitted on validation.

    Subclasses set ``name``, ``changes_argmax`` (False when the calibrated argmax equals the
    input's, e.g. a positive temperature per pixel) and ``needs_image``, keep their fitted state
    in parameters and buffers (so ``state_dict`` saves it), record their constructor arguments
    in ``self.params`` (plain types, for :func:`cals_seg.calibrators.save_calibrator`), and
    implement :meth:`fit` and :meth:`forward`. A new calibrator is the identity until fitted.

    Args:
        num_classes: K >= 2; None only for a map that works for any K (a single temperature).

    Shape:
        - logits: ``(N, K, *S)``; image: ``(N, C, *S)`` or None; output: ``(N, K, *S)``.
    """

    name: ClassVar[str] = ""
    changes_argmax: ClassVar[bool] = True
    needs_image: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "fit" in cls.__dict__:  # every fit says when it leaves the calibrator at the identity
            cls.fit = _flag_identity(cls.__dict__["fit"])

    def __init__(self, num_classes: int | None, **params: Any) -> None:
        super().__init__()
        if num_classes is not None:
            check_int("num_classes", num_classes, 2)
        self.num_classes = num_classes
        self.params: dict[str, Any] = dict(params)
        self.fit_info: dict[str, Any] = {}

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Fit on the validation batches; returns (and keeps in ``fit_info``) a summary."""
        raise NotImplementedError

    def check_input(self, logits: Tensor, image: Tensor | None = None) -> None:
        """Raise ``ValueError`` unless ``logits`` is ``(N, K, *S)`` with this K (and ``image``
        is given when the method needs it, with the spatial shape of ``logits``)."""
        if not isinstance(logits, Tensor) or logits.dim() < 2 or not logits.is_floating_point():
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"Expected floating `logits` of shape (N, K, *S), but got {shape}.")
        if self.num_classes is not None and logits.shape[1] != self.num_classes:
            raise ValueError(
                f"Expected logits with {self.num_classes} classes (dim 1), but got "
                f"{logits.shape[1]} (shape {tuple(logits.shape)})."
            )
        if self.needs_image:
            if image is None:
                raise ValueError(f"The `{self.name}` calibrator needs the image: pass `image`.")
            if image.shape[0] != logits.shape[0] or image.shape[2:] != logits.shape[2:]:
                raise ValueError(
                    f"Expected an image (N, C, *S) matching logits {tuple(logits.shape)}, but "
                    f"got {tuple(image.shape)}."
                )

    def export_module(self, fmt: str = "pt2") -> nn.Module:
        """This fitted calibrator as a module that ``torch.export`` (``fmt="pt2"``) or ONNX
        (``"onnx"``) holds for every image size, ``(logits, image or None) -> calibrated
        logits`` in float32, computing what :meth:`forward` computes
        (:mod:`cals_seg.calibrators._export`): the calibrator itself where its ``forward`` is
        already such a program, else a module with the fitted state fixed as constants (no
        branch on data, no loop over a dynamic size)."""
        return self

    def extra_repr(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"num_classes={self.num_classes}" + (f", {args}" if args else "")


# Largest change of a probability, on the first validation batch, below which a fitted
# calibrator is reported as the identity.
IDENTITY_ATOL = 1e-6


def probe_identity(calibrator: Calibrator, batches: Batches) -> bool:
    """True when ``calibrator`` leaves the probabilities of the first validation batch as they
    are (largest change <= ``IDENTITY_ATOL``): a fit that did not move it (a flat or
    degenerate objective, a temperature of 1, an untrained net kept by early stopping)."""
    training = calibrator.training
    calibrator.eval()  # the probe must not move a state (batch-norm statistics, say)
    try:
        for logits, _, image in iterate(batches):
            with torch.no_grad():
                out = calibrator(logits, image)
            before = logits.detach().float().softmax(dim=1)
            return bool((out.detach().float().softmax(dim=1) - before).abs().max()
                        <= IDENTITY_ATOL)
        return True
    finally:
        calibrator.train(training)


def _flag_identity(fit: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Wrap a ``fit``: afterwards ``fit_info["identity"]`` says whether the fitted calibrator is
    the identity on the first validation batch, with a warning when it is (netcal issues 48 and
    61: a fit that silently returns the identity)."""
    import functools
    import warnings

    @functools.wraps(fit)
    def wrapped(self: Calibrator, batches: Batches, *args: Any, **kwargs: Any) -> dict[str, Any]:
        depth = getattr(self, "_fit_depth", 0)
        self._fit_depth = depth + 1
        try:
            info = fit(self, batches, *args, **kwargs)
        finally:
            self._fit_depth = depth
        if depth == 0:
            identity = probe_identity(self, batches)
            if isinstance(info, dict):
                info["identity"] = identity
            if isinstance(self.fit_info, dict) and self.fit_info is not info:
                self.fit_info["identity"] = identity
            if identity:
                warnings.warn(f"{self.name or type(self).__name__}: the fit left the calibrator "
                              "at the identity (its probabilities equal the network's on the "
                              "first validation batch).", stacklevel=2)
        return info

    return wrapped


def valid_rows(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """``(P, K)`` logits and ``(P,)`` labels of the valid positions of one batch (checked)."""
    return _valid_rows(logits, target, ignore_index)


def lbfgs_fit(
    params: list[Tensor],
    batch_nll: Callable[[Tensor, Tensor], Tensor],
    regulariser: Callable[[], Tensor] | None,
    batches: Batches,
    ignore_index: int,
    max_iter: int,
) -> dict[str, Any]:
    """Minimise ``mean NLL over all valid positions + regulariser`` with full-batch L-BFGS.

    Every objective evaluation is one pass over ``batches`` (the mean NLL and its gradient are
    accumulated chunk by chunk in float64, all-reduced under DDP), so the fit is the exact
    full-batch optimum, not a stochastic one, with the memory of one chunk's graph.

    Args:
        params: float64 leaf tensors with ``requires_grad``.
        batch_nll: ``(rows (P, K) float64, labels (P,)) -> summed NLL`` (a scalar).
        regulariser: ``() -> scalar`` added to the mean NLL, or None.
        batches: the validation batches.
        ignore_index: target value of void positions.
        max_iter: L-BFGS iterations (strong-Wolfe line search).

    Returns:
        ``{"objective", "nll", "passes", "positions"}``.
    """
    # Stops when an iteration changes the objective (or a parameter) by less than 1e-9, or the
    # largest gradient entry is below 1e-7: far below the 1e-4 that the NLL is reported at.
    optimizer = torch.optim.LBFGS(params, lr=1.0, max_iter=max_iter, tolerance_grad=1e-7,
                                  tolerance_change=1e-9, history_size=20,
                                  line_search_fn="strong_wolfe")
    state: dict[str, Any] = {"passes": 0}

    def closure() -> Tensor:
        optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64, device=params[0].device)
        count = torch.zeros((), dtype=torch.int64, device=params[0].device)
        for logits, target, _ in iterate(batches):
            rows, labels = valid_rows(logits, target, ignore_index)
            for start in range(0, rows.shape[0], CHUNK_POSITIONS):
                chunk = rows[start:start + CHUNK_POSITIONS].to(params[0].device, torch.float64)
                nll = batch_nll(chunk, labels[start:start + CHUNK_POSITIONS].to(chunk.device))
                nll.backward()
                total += nll.detach()
            count += labels.numel()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        all_reduce_sum_([total, count, *grads])
        n = int(count)
        if n == 0:
            raise ValueError(
                f"Expected at least one valid position (target != ignore_index={ignore_index}) "
                "in the validation batches, but got none."
            )
        if state.get("positions", n) != n:
            raise ValueError(
                "Expected `batches()` to yield the same data on every call (a fresh iterable "
                f"each time), but one pass saw {state['positions']} and another {n} positions."
            )
        for p, g in zip(params, grads, strict=True):
            p.grad = g / n
        objective = total / n
        state.update(passes=state["passes"] + 1, positions=n, nll=float(objective))
        if regulariser is not None:
            reg = regulariser()
            reg.backward()
            objective = objective + reg.detach()
        if not math.isfinite(float(objective)):
            raise ValueError("The validation NLL is not finite: the logits hold NaN or inf.")
        return objective

    with torch.enable_grad():  # the caller may be under no_grad (an evaluation)
        optimizer.step(closure)
        objective = float(closure())  # the objective at the final parameters
    return {"objective": objective, "nll": state["nll"], "passes": state["passes"],
            "positions": state["positions"]}


def holdout_mask(n: int, first_index: int, every: int) -> Tensor:
    """Which of the ``n`` images of a batch are held out: image ``j`` of the stream (counted
    from 0 over the whole pass, ``first_index`` is the batch's first) when ``j % every ==
    every - 1`` (images 5, 10, 15, ... for ``every = 5``)."""
    j = torch.arange(first_index, first_index + n)
    return j % every == every - 1


LossFn = Callable[[nn.Module, Tensor, Tensor, "Tensor | None", int], "tuple[Tensor, int] | None"]


# Not split (over 80 lines): most of it is the docstring; the code is 66 lines of one algorithm.
def fit_with_holdout(
    net: nn.Module,
    loss: LossFn,
    batches: Batches,
    ignore_index: int,
    epochs: int,
    patience: int,
    lr: float,
    holdout_every: int,
    train_step: Callable[..., None] | None = None,
) -> dict[str, Any]:
    """Train ``net`` with Adam on part of the validation batches, early-stopped on the rest.

    Image ``j`` of each pass (counted from 0 in the order ``batches()`` yields them) is held out
    when ``j % holdout_every == holdout_every - 1``; the other images train ``net`` (one Adam
    step per batch on their mean loss, or ``train_step(net, optimizer, logits, target, image,
    ignore_index)`` when given, e.g. several steps on minibatches of pixels). Epoch ``e`` is
    one pass: it trains on the fit images and, in the same pass, scores the held-out images
    with a frozen copy of ``net`` as it was after epoch ``e - 1`` (the untrained ``net`` for
    ``e = 0``); a last pass scores the final epoch. ``net`` ends with the state of the best
    held-out score (possibly the untrained one), and training stops after ``patience`` epochs
    without improvement.

    Args:
        net: the trainable module (its parameters are optimised).
        loss: ``(net, logits, target, image, ignore_index) -> (summed loss, weight)`` over the
            images given, or None when they hold no valid position.
        batches: the validation batches.
        ignore_index: target value of void positions.
        epochs: maximum number of training passes.
        patience: epochs without held-out improvement before stopping.
        lr: Adam learning rate.
        holdout_every: one image in ``holdout_every`` is held out (>= 2).

    Returns:
        ``{"heldout": "every Nth image ...", "heldout_images", "fit_images", "epochs_run",
        "best_epoch", "heldout_loss": [...]}`` (``best_epoch`` 0 is the untrained net).
    """
    import copy

    check_int("epochs", epochs)
    check_int("patience", patience)
    check_int("holdout_every", holdout_every, 2)
    check_positive_float("lr", lr)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    scores: list[float] = []
    best_state, best_score, best_epoch = copy.deepcopy(net.state_dict()), math.inf, 0
    counts = {"fit": 0, "heldout": 0}
    for epoch in range(epochs + 1):
        frozen = copy.deepcopy(net).eval()
        net.train()
        total, weight, seen = 0.0, 0, 0
        for logits, target, image in iterate(batches):
            held = holdout_mask(logits.shape[0], seen, holdout_every).to(logits.device)
            seen += logits.shape[0]
            if epoch == 0:
                counts["heldout"] += int(held.sum())
                counts["fit"] += int((~held).sum())
            if bool(held.any()):
                with torch.no_grad():
                    out = loss(frozen, logits[held], target[held],
                               None if image is None else image[held], ignore_index)
                if out is not None:
                    total += float(out[0])
                    weight += out[1]
            if epoch < epochs and bool((~held).any()):
                fit = ~held
                with torch.enable_grad():
                    if train_step is not None:
                        train_step(net, optimizer, logits[fit], target[fit],
                                   None if image is None else image[fit], ignore_index)
                        continue
                    out = loss(net, logits[fit], target[fit],
                               None if image is None else image[fit], ignore_index)
                    if out is not None:
                        optimizer.zero_grad()
                        (out[0] / max(out[1], 1)).backward()
                        optimizer.step()
        if epoch == 0 and (counts["heldout"] == 0 or counts["fit"] == 0):
            raise ValueError(
                f"Expected at least {holdout_every} validation images (one in {holdout_every} "
                f"is held out for early stopping), but got {seen}; lower `holdout_every`."
            )
        if weight == 0:
            raise ValueError("The held-out validation images have no valid position.")
        score = total / weight
        if not math.isfinite(score):
            raise ValueError("The held-out loss is not finite: the logits hold NaN or inf.")
        scores.append(score)
        if score < best_score:
            best_state, best_score, best_epoch = copy.deepcopy(frozen.state_dict()), score, epoch
        elif epoch - best_epoch >= patience:
            break
    net.load_state_dict(best_state)
    net.eval()
    return {
        "heldout": f"every {holdout_every}th validation image in loader order "
                   f"(images {holdout_every}, {2 * holdout_every}, ... counting from 1)",
        "heldout_images": counts["heldout"],
        "fit_images": counts["fit"],
        "epochs_run": len(scores) - 1,
        "best_epoch": best_epoch,
        "heldout_loss": scores,
    }
