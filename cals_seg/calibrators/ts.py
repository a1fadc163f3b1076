"""``ts``: one temperature for every logit (Guo et al., ICML 2017).

``forward(l) = l / T`` with ``T > 0`` fitted by
:func:`cals_seg.calibrators.temperature.fit_temperature`
(grid refinement of the validation NLL, three passes, bounded memory). The argmax is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cals_seg.calibrators._base import Batches, Calibrator, iterate
from cals_seg.calibrators.temperature import fit_temperature


class TemperatureScaling(Calibrator):
    """One temperature ``T`` (buffer ``temperature``, 1.0 until fitted).

    Args:
        num_classes: K >= 2.

    Shape:
        - logits: ``(N, K, *S)`` -> same shape.
    """

    name = "ts"
    changes_argmax = False

    temperature: Tensor

    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        self.register_buffer("temperature", torch.tensor(1.0))

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Fit ``T`` on the validation NLL (three passes over ``batches``)."""
        t = fit_temperature(lambda: ((l, y) for l, y, _ in iterate(batches)), ignore_index)
        self.temperature.fill_(t)
        self.fit_info = {"temperature": t, "passes": 3}
        return self.fit_info

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self.check_input(logits, image)
        return logits / self.temperature.to(logits.dtype)
