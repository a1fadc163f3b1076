"""The meter base class: the argument prologue, declared states, streaming and the DDP sum.

A meter declares each of its states once, as torchmetrics' ``Metric.add_state`` does (a name, a
default tensor, a reduction over processes), and writes two pure functions: the sums of one
batch (:meth:`Meter.batch_stats`) and the metrics from the summed states
(:meth:`Meter.compute_states`). The base class does the rest, once for every meter: the argument
checks, ``reset``, ``update`` (add the batch's sums), ``synced_states`` (copies summed over
ranks) and ``compute``. The torchmetrics wrappers (:mod:`cals_seg.integrations.torchmetrics`)
read the same declarations and call the same two functions, so both give the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from cals_seg.metrics.functional import check_inputs_arg, sum_over_ranks
from cals_seg.utils.validation import check_ignore_index, check_int, check_tensors

REDUCTIONS = ("sum",)  # every state is a sum: counts (int64) and sums (float64)


@dataclass(frozen=True)
class MeterState:
    """One declared state: its name, its value after ``reset`` and how ranks combine it
    (``"sum"``, torchmetrics' ``dist_reduce_fx``)."""

    name: str
    default: Tensor
    reduction: str = "sum"


class Meter(nn.Module):
    """Base of the streaming meters (``reset / update / compute``, exact over DDP).

    The constructor checks the arguments every meter shares and keeps them as attributes:
    ``num_classes`` (an integer ``>= 2``), ``ignore_index`` (an integer), ``inputs``
    (``"logits"`` or ``"probs"``) and, when given, ``n_bins`` (a positive integer). Subclasses
    then declare their states with :meth:`add_state` and implement :meth:`batch_stats` and
    :meth:`compute_states`.

    States are registered buffers (saved by ``state_dict``, moved by ``.to``) whose size does
    not depend on the number of pixels. ``compute`` sums copies of them over the ranks (one
    ``all_reduce`` per dtype) and must be called on every rank; the buffers are left as they
    are, so ``compute`` can be called repeatedly and ``update`` continued afterwards.

    Raises:
        ValueError (:class:`~cals_seg.errors.UserError`): a bad shared argument, named.
    """

    def __init__(
        self,
        num_classes: int,
        ignore_index: int = -100,
        inputs: str = "logits",
        n_bins: int | None = None,
    ) -> None:
        super().__init__()
        check_int("num_classes", num_classes, 2)
        check_inputs_arg(inputs)
        if n_bins is not None:
            check_int("n_bins", n_bins, 1)
        check_ignore_index(ignore_index)
        self.num_classes, self.ignore_index, self.inputs = num_classes, ignore_index, inputs
        if n_bins is not None:
            self.n_bins = n_bins
        self._states: dict[str, MeterState] = {}

    def add_state(self, name: str, default: Tensor, reduction: str = "sum") -> None:
        """Declare a state: a buffer ``name`` holding a copy of ``default``, summed over ranks.

        Raises:
            ValueError: an unknown ``reduction`` or a name declared twice.
        """
        if reduction not in REDUCTIONS:
            raise ValueError(f"Expected `reduction` in {list(REDUCTIONS)}, but got {reduction!r}.")
        if name in self._states:
            raise ValueError(f"State {name!r} is declared twice.")
        self._states[name] = MeterState(name, default.detach().clone(), reduction)
        self.register_buffer(name, default.detach().clone())

    @property
    def states(self) -> tuple[MeterState, ...]:
        """The declared states, in declaration order."""
        return tuple(self._states.values())

    def reset(self) -> None:
        """Every state back to its default."""
        for state in self._states.values():
            getattr(self, state.name).copy_(state.default)

    def batch_stats(self, logits: Tensor, target: Tensor) -> dict[str, Tensor]:
        """The sums of one batch, ``{state name: tensor of the state's shape}`` (checks the
        input; raises ``ValueError`` on a bad one). Pure: reads the arguments only."""
        raise NotImplementedError

    def compute_states(self, states: dict[str, Tensor]) -> dict[str, Any]:
        """The metrics from states summed over everything seen (a JSON-serialisable dict).
        Pure: reads the arguments only."""
        raise NotImplementedError

    @torch.no_grad()
    def update(self, logits: Tensor, target: Tensor) -> None:
        """Add one batch (shapes: the subclass's docstring); raises ``ValueError`` on bad
        input, before any state changes."""
        check_tensors(logits, target, "meter.update")  # e.g. a model's output dict, named
        for name, value in self.batch_stats(logits, target).items():
            getattr(self, name).add_(value)

    def synced_states(self) -> dict[str, Tensor]:
        """Copies of the states summed over all DDP ranks (plain copies without DDP)."""
        names = list(self._states)
        return dict(zip(names, sum_over_ranks([getattr(self, n) for n in names]), strict=True))

    @torch.no_grad()
    def compute(self) -> dict[str, Any]:
        """The metrics over everything seen on every rank (call it on every rank under DDP)."""
        return self.compute_states(self.synced_states())
