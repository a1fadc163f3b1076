"""Deep ensembles: the mean of the members' probabilities, evaluated like one network.

:class:`Ensemble` is a module whose "logits" are ``log(mean_m softmax(f_m(x)))``: any softmax of
them is the ensemble's mean probability, so the whole evaluation (metrics, temperature scaling,
calibrators, corruptions) runs on it unchanged. The members see the same network input (the
protocol's resized / padded image or tile); the protocol then averages tiles and upsamples these
log-probabilities as it does logits. For one member the log-probabilities differ from the logits
by a per-pixel constant, which the tile mean and the bilinear upsampling keep per-pixel
constant, so the ensemble of one run gives that run's probabilities.

Members must share the evaluation protocol and the data (:func:`check_members`): an ensemble of
runs evaluated on different inputs is refused.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from cals_seg.errors import UserError


class Ensemble(nn.Module):
    """``log(mean_m softmax(member_m(x)))`` of ``M`` networks.

    Shape:
        ``x (N, 3, h, w)`` -> ``(N, K, h, w)`` float32 log-probabilities.
    """

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__()
        if not members:
            raise UserError("--ensemble: give at least one run.")
        self.members = nn.ModuleList(members)

    def forward(self, x: Tensor) -> Tensor:
        total: Tensor | None = None
        for member in self.members:
            log_p = torch.log_softmax(member(x).float(), dim=1)
            total = log_p if total is None else torch.logaddexp(total, log_p)
        return total - math.log(len(self.members))


# The parts of a run that must agree for its probabilities to be averaged with another's.
DATA_KEYS = ("name", "root", "num_classes", "ignore_index", "val_fraction", "split_seed",
             "synthetic")


def protocol_of(config: Mapping[str, Any], protocol: Any) -> dict[str, Any]:
    """What an ensemble member's evaluation depends on: its ``data`` keys and its protocol."""
    data = config.get("data", {})
    return {"data." + k: data.get(k) for k in DATA_KEYS} | {"eval protocol": protocol}


def check_members(names: Sequence[str], protocols: Sequence[Mapping[str, Any]],
                  checkpoints: Sequence[str | os.PathLike] | None = None) -> None:
    """Refuse members whose :func:`protocol_of` differ (one line naming the first difference),
    and, given their ``checkpoints`` (files), one network given twice: the same file, or two
    byte-identical files (a copied run; :func:`~cals_seg.utils.fits.file_digest`), would weigh
    that network twice in the mean.

    Raises:
        UserError: two members evaluated on different data or with different protocols, or
            the same network given twice (both paths named).
    """
    from cals_seg.utils.fits import file_digest

    if checkpoints is not None:
        seen: dict[str, tuple[str, str]] = {}
        for name, checkpoint in zip(names, checkpoints, strict=True):
            path = str(Path(checkpoint).resolve())
            digest = file_digest(path)
            if digest in seen:
                other, other_path = seen[digest]
                how = (f"the same checkpoint file {path}" if other_path == path else
                       f"the same checkpoint by content: {other_path} and {path} are "
                       "byte-identical")
                raise UserError(f"--ensemble: {other} and {name} are the same network ({how}); "
                                "give each member once.")
            seen[digest] = (name, path)
    first = protocols[0]
    for name, other in zip(names[1:], protocols[1:], strict=True):
        for key, value in first.items():
            if other.get(key) != value:
                raise UserError(f"--ensemble: {name} has {key} = {other.get(key)!r} but "
                                f"{names[0]} has {value!r}; ensemble runs of the same protocol "
                                "(or align them with --set).")


__all__ = ["DATA_KEYS", "Ensemble", "check_members", "protocol_of"]
