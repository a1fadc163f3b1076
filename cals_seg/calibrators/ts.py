"""``ts``: one temperature for every logit (Guo et al., ICML 2017), the toolkit's one temperature
scaling.

``forward(l) = l / T`` with ``T > 0`` fitted by
:func:`cals_seg.calibrators.temperature.fit_temperature`
(grid refinement of the validation NLL, three passes, bounded memory). The argmax is unchanged.
:class:`TemperatureScaler` is the same module built from a known ``T`` (``cals_seg``'s public
name: ``nn.Sequential(model, TemperatureScaler(T))`` is the calibrated model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cals_seg.calibrators._base import Batches, Calibrator, iterate
from cals_seg.calibrators.temperature import fit_temperature
from cals_seg.utils.validation import check_positive_float


class TemperatureScaling(Calibrator):
    """One temperature ``T`` (buffer ``temperature``, 1.0 until fitted).

    ``T`` is a buffer (saved in ``state_dict``, moved by ``.to``), not a parameter: :meth:`fit`
    sets it from the validation NLL, not the optimiser.

    Args:
        num_classes: K >= 2 (None: any K, as :class:`TemperatureScaler`).

    Shape:
        - logits: ``(N, K, *S)`` -> same shape.
    """

    name = "ts"
    changes_argmax = False

    temperature: Tensor

    def __init__(self, num_classes: int | None) -> None:
        super().__init__(num_classes)
        self.register_buffer("temperature", torch.tensor(1.0))

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Fit ``T`` on the validation NLL (three passes over ``batches``)."""
        t = fit_temperature(lambda: ((l, y) for l, y, _ in iterate(batches)), ignore_index)
        self.temperature.fill_(t)
        self.fit_info = {"temperature": t, "passes": 3}
        return self.fit_info

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        if self.num_classes is not None:  # a TemperatureScaler divides any tensor, as always
            self.check_input(logits, image)
        return logits / self.temperature.to(logits.dtype)

    def extra_repr(self) -> str:
        if self.num_classes is None:
            return f"temperature={float(self.temperature):.4f}"
        return super().extra_repr()


class TemperatureScaler(TemperatureScaling):
    """The ``ts`` calibrator with a given temperature, for any number of classes:
    ``forward(l) = l / T``; ``nn.Sequential(model, TemperatureScaler(T))`` is the calibrated
    model (argmax unchanged).

    Args:
        temperature: ``T > 0``, finite.

    Shape:
        logits: ``(N, K, *S)`` -> same shape.
    """

    def __init__(self, temperature: float = 1.0) -> None:
        check_positive_float("temperature", temperature)
        super().__init__(None)
        self.temperature.fill_(float(temperature))
