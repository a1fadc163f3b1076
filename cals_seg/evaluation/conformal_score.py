"""Per-pixel conformal scores, chosen by name: the registry :data:`SCORES`, the default score
LAC, and the threshold grid cells every score is compared on.

A score is a number in ``[0, 1]`` per class, small when the class is plausible; a pixel's set
is every class whose score is at most the fitted threshold (:mod:`cals_seg.evaluation.conformal`,
docs/conformal.md). Each score is a :class:`ConformalScore` registered where it is defined::

    @SCORES.register("lac")
    class LAC(ConformalScore): ...

LAC, the default, is defined here; every other score is one file of
:mod:`cals_seg.evaluation.conformal_scores` (read the first time the names are), so adding a
score is one new file there: ``--conformal score=NAME``, the saved fits, ``export`` and the
docs' table of scores read this registry.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cals_seg.errors import UserError
from cals_seg.utils.registry import Registry

GRID = 2**12


class ConformalScore:
    """What one conformal score is: how the scores of every class are computed from the
    probabilities, and what an exported program can hold of it.

    Attributes:
        name: its registered name (``--conformal score=NAME``).
        onnx_refusal: why ONNX cannot hold the score (a clause of the refusal, e.g. "the APS
            randomisation reads the bits of the probabilities, which ONNX cannot"); None when
            it can.
    """

    name: str = ""
    onnx_refusal: str | None = None

    @staticmethod
    def scores(probs: Tensor, seed: int = 0) -> Tensor:
        """Scores of every class, in ``[0, 1]``, small when the class is plausible; a fixed
        function of ``probs`` and ``seed`` (the same for calibration and test images).

        Shape:
            - probs: ``(N, K, P)`` float32; returns ``(N, K, P)`` float32.
        """
        raise NotImplementedError


SCORES: Registry[type[ConformalScore]] = Registry(
    "conformal score", discover="cals_seg.evaluation.conformal_scores")


def lac_scores(probs: Tensor) -> Tensor:
    """LAC score ``s_k = 1 - p_k`` (Sadinle et al. 2019).

    Shape:
        - probs: ``(N, K, P)``; returns the same shape and dtype, in ``[0, 1]``.
    """
    return (1.0 - probs).clamp_(0.0, 1.0)


@SCORES.register("lac")
class LAC(ConformalScore):
    """LAC (least ambiguous set-valued classifier): ``s_k = 1 - p_k``; the smallest sets on
    average. Exported to ONNX and pt2 alike."""

    name = "lac"

    @staticmethod
    def scores(probs: Tensor, seed: int = 0) -> Tensor:
        return lac_scores(probs)


def class_scores(probs: Tensor, score: str = "lac", seed: int = 0) -> Tensor:
    """Scores of every class by the registered score ``score`` (seeded by ``seed``).

    Shape:
        - probs: ``(N, K, P)`` float32; returns ``(N, K, P)`` float32.

    Raises:
        ValueError: ``score`` is not registered (the registered names listed).
    """
    if score not in SCORES:
        raise ValueError(f"Expected `score` to be one of {list(SCORES)}, but got {score!r}.")
    return SCORES[score].scores(probs, seed)


def score_cells(scores: Tensor, grid: int = GRID) -> Tensor:
    """Grid cell ``ceil(s * grid)`` of each score (exact: ``grid`` is a power of two), so that
    ``s <= g / grid`` iff the cell is ``<= g``. Returns int64 in ``[0, grid]``."""
    return torch.ceil(scores.to(torch.float64) * grid).to(torch.int64).clamp_(0, grid)


def refuse_onnx(score: str) -> None:
    """Refuse an ONNX export of the sets of ``score`` when ONNX cannot hold it.

    Raises:
        UserError: one line naming the score, why, and the choices that work (``--format
            pt2``, or a score ONNX holds).
    """
    why = SCORES[score].onnx_refusal
    if why is None:
        return
    others = " or ".join(f"score={name}" for name, s in SCORES.items() if s.onnx_refusal is None)
    raise UserError(f"--format onnx --conformal score={score}: {why}; use --format pt2"
                    + (f", or {others}." if others else "."))


__all__ = ["GRID", "LAC", "SCORES", "ConformalScore", "class_scores", "lac_scores",
           "refuse_onnx", "score_cells"]
