"""The calibrator contract and the fitting machinery the methods share.

A calibrator maps logits ``(N, K, *S)`` (and, for some methods, the image) to calibrated logits
of the same shape. It is fitted on the validation split by :meth:`Calibrator.fit`, which streams
over a zero-argument callable returning a fresh iterator of ``(logits, target)`` or
``(logits, target, image)`` batches, as :func:`cals_seg.calibrators.ts.fit_temperature` does:
the memory is one batch plus the calibrator's state; a method that needs several passes (grid
refinement, L-BFGS iterations, epochs) calls it again.

The chores every fit shares are written here once: the valid positions of a batch
(:func:`valid_rows`), the guards of a multi-pass fit (:func:`check_positions`,
:func:`check_same_data`, :func:`check_finite_nll`), the held-out images (:func:`holdout_mask`,
:func:`with_holdout`, :func:`holdout_split`, :func:`score_candidates`,
:func:`fit_with_holdout`), and the full-batch L-BFGS loop (:func:`lbfgs_fit`,
:func:`lbfgs_stages`, :func:`accumulate_nll`). A calibrator registers itself in
:data:`cals_seg.calibrators.registry.CALIBRATORS` where its class is defined.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

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
    """Flatten one batch to the ``(P, K)`` logits and ``(P,)`` labels of its valid positions
    (``target != ignore_index``), checked.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``; returns ``(P, K)`` and ``(P,)`` with ``P``
        the number of positions whose target is not ``ignore_index``.

    Raises:
        ValueError: mismatched shapes, integer logits, or a valid target outside ``[0, K)``.
    """
    if logits.dim() < 2:
        raise ValueError(
            f"Expected `logits` of shape (N, K, *S), but got shape {tuple(logits.shape)}."
        )
    expected = (logits.shape[0], *logits.shape[2:])
    if tuple(target.shape) != expected:
        raise ValueError(
            f"Expected `target` of shape {expected} to match `logits` {tuple(logits.shape)}, "
            f"but got {tuple(target.shape)}."
        )
    if not logits.is_floating_point():
        raise ValueError(f"Expected floating-point `logits`, but got {logits.dtype}.")
    k = logits.shape[1]
    rows = logits.detach().movedim(1, -1).reshape(-1, k)
    labels = target.detach().reshape(-1).to(device=rows.device, dtype=torch.long)
    valid = labels != ignore_index
    rows, labels = rows[valid], labels[valid]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= k):
        raise ValueError(
            f"Expected valid `target` values in [0, {k}), but got values in "
            f"[{int(labels.min())}, {int(labels.max())}] (ignore_index={ignore_index})."
        )
    return rows, labels


def summed_nll(z: Tensor, labels: Tensor) -> Tensor:
    """``sum_i logsumexp_k z_ik - z_{i, y_i}``: the summed NLL of ``softmax(z)``.

    Shape:
        z: ``(P, K)``; labels: ``(P,)`` int64; returns a scalar in the dtype of ``z``.
    """
    return (torch.logsumexp(z, dim=1) - z.gather(1, labels[:, None]).squeeze(1)).sum()


# ------------------------------------------------------------------ the guards of a fit
def check_positions(count: int, ignore_index: int) -> None:
    """Raise ``ValueError`` when a pass over the validation batches saw no valid position."""
    if count == 0:
        raise ValueError(
            f"Expected at least one valid position (target != ignore_index={ignore_index}) "
            "in the validation batches, but got none."
        )


def check_same_data(first: Any, count: Any, what: str = "positions") -> Any:
    """``count`` (the ``what`` a pass saw: an int, a tuple or a tensor of counts) when it
    equals ``first`` (the first pass's; None for the first pass itself); else ``ValueError``:
    ``batches()`` must return a fresh iterable over the same data on every call."""
    if first is None:
        return count
    same = (torch.equal(first, count) if isinstance(count, Tensor) else first == count)
    if not same:
        seen = (f", but one pass saw {first} and another {count} {what}"
                if isinstance(count, int) else "")
        raise ValueError("Expected `batches()` to yield the same data on every call (a fresh "
                         f"iterable each time){seen}.")
    return first


def check_finite_nll(value: Tensor | float) -> None:
    """Raise ``ValueError`` unless the validation NLL ``value`` (a number or a tensor of
    them) is finite everywhere: NaN or infinite logits."""
    finite = (bool(torch.isfinite(value).all()) if isinstance(value, Tensor)
              else math.isfinite(value))
    if not finite:
        raise ValueError("The validation NLL is not finite: the logits hold NaN or inf.")


# ------------------------------------------------------------------ the L-BFGS loop
def lbfgs(params: list[Tensor], max_iter: int) -> torch.optim.LBFGS:
    """The full-batch L-BFGS of every fit: strong-Wolfe line search, stopping when an
    iteration changes the objective (or a parameter) by less than 1e-9 or the largest gradient
    entry is below 1e-7 (far below the 1e-4 that the NLL is reported at)."""
    return torch.optim.LBFGS(params, lr=1.0, max_iter=max_iter, tolerance_grad=1e-7,
                             tolerance_change=1e-9, history_size=20,
                             line_search_fn="strong_wolfe")


def lbfgs_stages(params: list[Tensor], closure: Callable[[float], Tensor],
                 lams: Sequence[float], max_iter: int, best: Callable[[], float],
                 early_stop: bool) -> int:
    """Minimise ``closure(lam)`` (a pass that sets the gradients and returns the objective)
    for each ``lam`` of ``lams`` in turn, each stage an :func:`lbfgs` of ``max_iter``
    iterations started where the last ended; with ``early_stop``, stop after a stage (past
    the first) that did not lower ``best()`` (the best held-out score so far): a weaker pull
    would not help either. Returns the number of stages run."""
    stages = 0
    for lam in lams:
        before = best()
        optimizer = lbfgs(params, max_iter)
        optimizer.step(lambda lam=lam: closure(lam))
        stages += 1
        if early_stop and stages > 1 and not best() < before:
            break
    return stages


def accumulate_nll(out: Tensor, rows: Tensor, labels: Tensor,
                   nll: Callable[[Tensor, Tensor], Tensor], device: torch.device,
                   backward: bool = True) -> None:
    """Add ``nll(chunk, labels)`` of every chunk of ``CHUNK_POSITIONS`` rows to ``out`` in
    place (float64 rows on ``device``), after ``backward()`` of each when ``backward`` (else
    without a graph): the memory of one chunk's graph for a sum over all positions.

    Shape:
        out: ``()`` float64; rows: ``(P, K)``; labels: ``(P,)``.
    """
    for start in range(0, rows.shape[0], CHUNK_POSITIONS):
        chunk = rows[start:start + CHUNK_POSITIONS].to(device, torch.float64)
        lab = labels[start:start + CHUNK_POSITIONS].to(device)
        if backward:
            value = nll(chunk, lab)
            value.backward()
        else:
            with torch.no_grad():
                value = nll(chunk, lab)
        out += value.detach()


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
    optimizer = lbfgs(params, max_iter)
    device = params[0].device
    state: dict[str, Any] = {"passes": 0, "positions": None}

    def closure() -> Tensor:
        optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.int64, device=device)
        for logits, target, _ in iterate(batches):
            rows, labels = valid_rows(logits, target, ignore_index)
            accumulate_nll(total, rows, labels, batch_nll, device)
            count += labels.numel()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        all_reduce_sum_([total, count, *grads])
        n = int(count)
        check_positions(n, ignore_index)
        state["positions"] = check_same_data(state["positions"], n)
        for p, g in zip(params, grads, strict=True):
            p.grad = g / n
        objective = total / n
        state.update(passes=state["passes"] + 1, nll=float(objective))
        if regulariser is not None:
            reg = regulariser()
            reg.backward()
            objective = objective + reg.detach()
        check_finite_nll(float(objective))
        return objective

    with torch.enable_grad():  # the caller may be under no_grad (an evaluation)
        optimizer.step(closure)
        objective = float(closure())  # the objective at the final parameters
    return {"objective": objective, "nll": state["nll"], "passes": state["passes"],
            "positions": state["positions"]}


# ------------------------------------------------------------------ the held-out images
def holdout_mask(n: int, first_index: int, every: int) -> Tensor:
    """Which of the ``n`` images of a batch are held out: image ``j`` of the stream (counted
    from 0 over the whole pass, ``first_index`` is the batch's first) when ``j % every ==
    every - 1`` (images 5, 10, 15, ... for ``every = 5``)."""
    j = torch.arange(first_index, first_index + n)
    return j % every == every - 1


def with_holdout(batches: Batches, every: int
                 ) -> Iterator[tuple[Tensor, Tensor, Tensor | None, Tensor]]:
    """``(logits, target, image or None, held)`` for every batch of one call of ``batches``:
    ``held`` ``(N,)`` bool on the logits' device flags the held-out images
    (:func:`holdout_mask`, counted over the pass; ``every = 0``: none)."""
    seen = 0
    for logits, target, image in iterate(batches):
        n = logits.shape[0]
        held = (holdout_mask(n, seen, every) if every
                else torch.zeros(n, dtype=torch.bool)).to(logits.device)
        seen += n
        yield logits, target, image, held


def holdout_split(batches: Batches, every: int, part: str) -> Batches:
    """The ``(logits, target)`` batches of the fit images (``part="fit"``), the held-out ones
    (``"held"``) or all of them (``"all"``) on every call of ``batches`` (batches without
    such an image left out)."""

    def gen() -> Iterator[tuple[Tensor, Tensor]]:
        for logits, target, _, held in with_holdout(batches, every):
            keep = {"fit": ~held, "held": held, "all": torch.ones_like(held)}[part]
            if bool(keep.any()):
                yield logits[keep], target[keep]

    return gen


def score_candidates(batches: Batches, every: int, ignore_index: int,
                     calibrated: Sequence[Callable[[Tensor], Tensor]]) -> tuple[list[float], int]:
    """Score fitted candidates on the held-out images (one pass, no graph, all-reduced):
    ``heldout[i] = (1 / |V|) sum_{p in V} NLL(softmax(calibrated[i](l))(p), y_p)`` over the
    valid held-out positions ``V``, and the index of the best (ties: the earlier one).

    Raises:
        ValueError: no valid position among the held-out images.
    """
    total = torch.zeros(len(calibrated), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.int64)
    with torch.no_grad():
        for logits, target in holdout_split(batches, every, "held")():
            _, labels = valid_rows(logits, target, ignore_index)
            count += labels.numel()
            for i, calibrate in enumerate(calibrated):
                rows, labels = valid_rows(calibrate(logits), target, ignore_index)
                total[i] += summed_nll(rows.to(torch.float64), labels)
    all_reduce_sum_([total, count])
    if int(count) == 0:
        raise ValueError(f"Expected valid pixels in the held-out validation images (one in "
                         f"{every}), but got none; lower `holdout_every`.")
    heldout = (total / int(count)).tolist()
    return heldout, min(range(len(heldout)), key=lambda i: (heldout[i], i))


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
        for logits, target, image, held in with_holdout(batches, holdout_every):
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
