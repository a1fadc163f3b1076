"""``selective``: selective scaling (Wang, Gong and Wang, CVPR 2023, "On Calibrating Semantic
Segmentation Models: Analyses and An Algorithm").

A small per-pixel classifier flags likely mispredictions; their logits are divided by a large
temperature ``T_mis``, the others are left as they are::

    forward(l)(p) = l(p) / T_mis  if  sigmoid(f(log softmax(l(p)))) > threshold  else  l(p)

As the authors describe it, ``f`` reads the log-probabilities through a linear layer initialised
to the identity, then two hidden layers with batch normalisation and ReLU (widths ``2K`` and
``K``), and is trained with a cross-entropy on "the prediction is wrong" in which mispredicted
pixels count twice (the authors duplicate them once against the imbalance), by Adam on small
minibatches of pixels (``pixels_per_step``, several steps per validation batch), early-stopped
on a held-out part of the validation split (one image in ``holdout_every``, see
:func:`._base.fit_with_holdout`). The authors set ``T_mis`` by hand (about 2 for a moderately
accurate classifier, up to 1e10 for an accurate one); here it is the minimiser of the held-out
NLL over a log-spaced grid in ``[1, t_max]`` (one more pass), unless ``temperature`` is given.
``T_mis = 1`` until fitted, so the untrained calibrator is the identity. The temperature is
positive, so the argmax never changes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cals_seg.calibrators._base import (
    Batches,
    Calibrator,
    fit_with_holdout,
    valid_rows,
    with_holdout,
)
from cals_seg.calibrators._export import FlaggedTemperature, floored_log_probs
from cals_seg.calibrators._grid import grid_nll
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.errors import UserError
from cals_seg.utils.validation import check_int, check_positive_float

# Rows per forward pass of the classifier at inference (bounds its hidden activations).
_ROWS = 2**18


class MispredictionClassifier(nn.Module):
    """Per-pixel logit of "the top-label prediction is wrong", from the log-probabilities.

    Shape:
        - rows: ``(P, K)`` log-probabilities -> ``(P,)``.
    """

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        k = num_classes
        self.linear = nn.Linear(k, k)
        with torch.no_grad():
            self.linear.weight.copy_(torch.eye(k))
            self.linear.bias.zero_()
        self.body = nn.Sequential(
            nn.BatchNorm1d(k), nn.ReLU(),
            nn.Linear(k, 2 * k), nn.BatchNorm1d(2 * k), nn.ReLU(),
            nn.Linear(2 * k, k), nn.BatchNorm1d(k), nn.ReLU(),
            nn.Linear(k, 1),
        )

    def forward(self, rows: Tensor) -> Tensor:
        return self.body(self.linear(rows)).squeeze(1)


_log_probs = floored_log_probs


@CALIBRATORS.register("selective")
class SelectiveScaling(Calibrator):
    """Selective scaling: a misprediction classifier and the temperature of its flagged pixels.

    Args:
        num_classes: K >= 2.
        threshold: probability of misprediction above which a pixel is scaled.
        temperature: ``T_mis``; None fits it on the held-out images.
        t_max: the largest ``T_mis`` searched when it is fitted.
        mispredicted_weight: weight of a mispredicted pixel in the classifier's loss.
        pixels_per_step: pixels per Adam step (shuffled valid pixels of a batch's fit images).
        steps_per_batch: the most Adam steps per validation batch.
        epochs, patience, lr, holdout_every: of the fit (:func:`._base.fit_with_holdout`).
        seed: of the pixel sampling.

    Shape:
        - logits: ``(N, K, *S)`` -> same shape.
    """

    name = "selective"
    changes_argmax = False

    temperature: Tensor

    def __init__(self, num_classes: int, threshold: float = 0.5,
                 temperature: float | None = None, t_max: float = 1e4,
                 mispredicted_weight: float = 2.0, pixels_per_step: int = 1024,
                 steps_per_batch: int = 64, epochs: int = 10, patience: int = 3,
                 lr: float = 1e-3, holdout_every: int = 5, seed: int = 0) -> None:
        if not 0 < threshold < 1:
            raise UserError(f"Expected `threshold` in (0, 1), but got {threshold!r}.")
        if temperature is not None:
            check_positive_float("temperature", temperature)
        check_positive_float("t_max", t_max)
        if t_max <= 1:
            raise UserError(f"Expected `t_max` > 1, but got {t_max!r}.")
        check_positive_float("mispredicted_weight", mispredicted_weight)
        check_int("pixels_per_step", pixels_per_step, 2)
        check_int("steps_per_batch", steps_per_batch)
        super().__init__(num_classes, threshold=float(threshold), temperature=temperature,
                         t_max=float(t_max), mispredicted_weight=float(mispredicted_weight),
                         pixels_per_step=pixels_per_step, steps_per_batch=steps_per_batch,
                         epochs=epochs, patience=patience,
                         lr=lr, holdout_every=holdout_every, seed=seed)
        self.classifier = MispredictionClassifier(num_classes)
        self.classifier.eval()
        self.register_buffer("temperature", torch.tensor(1.0))

    @torch.no_grad()
    def flagged(self, logits: Tensor) -> Tensor:
        """Pixels the classifier flags as mispredicted, ``(N, *S)`` bool."""
        k = self.num_classes
        rows = logits.detach().movedim(1, -1).reshape(-1, k)
        out = torch.empty(rows.shape[0], dtype=torch.bool, device=rows.device)
        logit_threshold = math.log(self.params["threshold"] / (1 - self.params["threshold"]))
        for start in range(0, rows.shape[0], _ROWS):
            score = self.classifier(_log_probs(rows[start:start + _ROWS]))
            out[start:start + _ROWS] = score > logit_threshold
        return out.view(logits.shape[0], *logits.shape[2:])

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self.check_input(logits, image)
        t = self.temperature.to(logits.dtype)
        if float(t) == 1.0:
            return logits
        scale = torch.where(self.flagged(logits), 1.0 / t, torch.ones((), dtype=logits.dtype,
                                                                       device=logits.device))
        return logits * scale.unsqueeze(1)

    def export_module(self, fmt: str = "pt2") -> nn.Module:
        """The classifier, threshold and ``T_mis`` as a program for export
        (:class:`~cals_seg.calibrators._export.FlaggedTemperature`)."""
        threshold = self.params["threshold"]
        return FlaggedTemperature(self.classifier, math.log(threshold / (1 - threshold)),
                                  self.temperature)

    def _classifier_loss(self, net: nn.Module, logits: Tensor, target: Tensor,
                         ignore_index: int) -> tuple[Tensor, int] | None:
        """Weighted cross-entropy of "wrong" summed over the valid pixels, and their count."""
        rows, labels = valid_rows(logits, target, ignore_index)
        if labels.numel() == 0:
            return None
        return self._rows_loss(net, rows, labels)

    def _rows_loss(self, net: nn.Module, rows: Tensor, labels: Tensor) -> tuple[Tensor, int]:
        wrong = (rows.argmax(dim=1) != labels).float()
        weight = 1.0 + (self.params["mispredicted_weight"] - 1.0) * wrong
        loss = F.binary_cross_entropy_with_logits(net(_log_probs(rows)), wrong, weight=weight,
                                                  reduction="sum")
        return loss, int(rows.shape[0])

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Train the classifier (early-stopped on the held-out images), then fit ``T_mis`` by
        the held-out NLL unless it was given."""
        p = self.params
        generator = torch.Generator().manual_seed(p["seed"])

        def loss(net: nn.Module, logits: Tensor, target: Tensor, image: Tensor | None,
                 void: int) -> tuple[Tensor, int] | None:
            self.check_input(logits, image)
            return self._classifier_loss(net, logits, target, void)

        def train_step(net: nn.Module, optimizer: torch.optim.Optimizer, logits: Tensor,
                       target: Tensor, image: Tensor | None, void: int) -> None:
            # The authors train on small minibatches of pixels: one Adam step per
            # `pixels_per_step` shuffled valid pixels of the batch, at most `steps_per_batch`.
            self.check_input(logits, image)
            rows, labels = valid_rows(logits, target, void)
            order = torch.randperm(rows.shape[0], generator=generator).to(rows.device)
            size = p["pixels_per_step"]
            for step in range(min(p["steps_per_batch"], rows.shape[0] // size or 1)):
                pick = order[step * size:(step + 1) * size]
                if pick.numel() < 2:  # batch normalisation needs two rows
                    break
                total, n = self._rows_loss(net, rows[pick], labels[pick])
                optimizer.zero_grad()
                (total / n).backward()
                optimizer.step()

        info = fit_with_holdout(self.classifier, loss, batches, ignore_index, p["epochs"],
                                p["patience"], p["lr"], p["holdout_every"], train_step)
        if p["temperature"] is not None:
            self.temperature.fill_(p["temperature"])
        else:
            info.update(self._fit_temperature(batches, ignore_index))
        info["temperature"] = float(self.temperature)
        self.fit_info = info
        return info

    @torch.no_grad()
    def _fit_temperature(self, batches: Batches, ignore_index: int) -> dict[str, Any]:
        """``T_mis`` minimising the held-out NLL of the flagged pixels over a log grid."""
        log_t = torch.linspace(0.0, math.log(self.params["t_max"]), 61, dtype=torch.float64)
        total = torch.zeros_like(log_t)
        flagged = wrong = 0
        for logits, target, _, held in with_holdout(batches, self.params["holdout_every"]):
            if not bool(held.any()):
                continue
            lg, tg = logits[held], target[held]
            flag = self.flagged(lg).reshape(-1)
            valid = tg.reshape(-1).to(flag.device) != ignore_index
            rows, labels = valid_rows(lg, tg, ignore_index)
            sel = flag[valid]
            if bool(sel.any()):
                total += grid_nll(rows[sel], labels[sel], (-log_t).exp().to(rows.device)).cpu()
                flagged += int(sel.sum())
                wrong += int((rows[sel].argmax(dim=1) != labels[sel]).sum())
        best = float(log_t[int(total.argmin())].exp()) if flagged else 1.0
        self.temperature.fill_(best)
        return {"heldout_flagged_pixels": flagged, "heldout_flagged_wrong": wrong}
