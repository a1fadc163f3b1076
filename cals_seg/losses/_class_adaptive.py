"""What CALS-ALM and CALS-HR share: the margin, the per-class multipliers ``lambdas`` and the
validation sums of functions of the normalised gaps ``z_ik = d_ik / m - 1``."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cals_seg.losses._adaptive import AdaptiveLoss
from cals_seg.losses._functional import class_sums
from cals_seg.utils.validation import check_finite


class ClassAdaptiveLoss(AdaptiveLoss):
    """Base of CALS-ALM and CALS-HR: the margin ``m``, the per-class ``lambdas`` (float64 state)
    and :meth:`observe`'s per-class sums of the functions :meth:`_observed_functions` gives.

    The margin is a Python float (no device synchronisation) mirrored by a 0-dim buffer that
    the training loss reads under ``torch.compile``, so that :meth:`set_margin` between epochs
    does not recompile the graph. Neither is saved: a fixed margin is part of the config."""

    def __init__(self, num_classes: int, margin: float, lambda_init: float,
                 ignore_index: int) -> None:
        super().__init__(num_classes, ignore_index)
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not margin > 0:
            raise ValueError(f"Expected `margin` to be a number > 0, but got {margin!r}.")
        if lambda_init < 0:
            raise ValueError(f"Expected `lambda_init` >= 0, but got {lambda_init}.")
        self.margin = float(margin)
        self.register_buffer("_margin_t", torch.tensor(self.margin, dtype=torch.float64),
                             persistent=False)
        self.add_state("lambdas", torch.full((num_classes,), float(lambda_init),
                                             dtype=torch.float64))

    def set_margin(self, margin: float, *, convert: bool = True) -> None:
        """Put the margin ``m' = margin`` in force for the next epochs (a margin rule calls this
        after :meth:`update_multipliers`).

        With ``convert`` (default) what is measured in units of the margin is restated at
        ``m'`` (:meth:`_margin_changed`: CALS-ALM rescales ``lambda`` and ``zbar_prev``, CALS-HR
        has nothing to convert); ``convert=False`` only sets the margin (a state restored from
        a checkpoint saved at ``m'``).

        Raises:
            ValueError: ``margin`` not a finite number > 0.
        """
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not (
                0 < margin < math.inf):
            raise ValueError(f"Expected `margin` to be a finite number > 0, but got {margin!r}.")
        old, self.margin = self.margin, float(margin)
        self._margin_t.fill_(self.margin)
        if convert and self.margin != old:
            self._margin_changed(old, self.margin)

    def _margin_changed(self, old: float, new: float) -> None:
        """Convert what depends on the margin after ``m: old -> new`` (nothing by default)."""

    def _margin_for(self, like: Tensor) -> float | Tensor:
        """The margin for the training loss: the Python float, and under ``torch.compile`` the
        0-dim buffer (a float would be a constant of the graph: a new margin, a new graph)."""
        if torch.compiler.is_compiling():
            return self._margin_t.to(like.dtype)
        return self.margin

    def _per_class(self, values: Tensor, like: Tensor) -> Tensor:
        """``(K,)`` float64 buffer -> ``(1, K, 1)`` in the dtype of the logits."""
        return values.to(dtype=like.dtype).view(1, -1, 1)

    def _class_statistics(self) -> list[str]:
        """Names of the per-class sums :meth:`_observe` accumulates, in the order of
        :meth:`_observed_functions`."""
        raise NotImplementedError

    def _observed_functions(self, like: Tensor) -> list:
        """Elementwise functions of z whose per-class sums :meth:`_observe` accumulates, in the
        order of :meth:`_class_statistics`."""
        raise NotImplementedError

    def _observe(self, logits: Tensor, target: Tensor, valid: Tensor) -> dict[str, Tensor]:
        n, _, s = logits.shape
        maxima = torch.empty((n, 1, s), dtype=logits.dtype, device=logits.device)
        fns = self._observed_functions(logits)
        sums = class_sums(logits, valid, self.margin, fns, maxima=maxima)
        check_finite(logits, maxima)  # before anything is accumulated
        return dict(zip(self._class_statistics(), sums, strict=True))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, margin={self.margin:g}"
