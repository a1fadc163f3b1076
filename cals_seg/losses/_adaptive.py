"""The contract of an adaptive loss: a criterion re-estimated on the validation split.

An adaptive loss (CALS-ALM, CALS-HR, and any loss a user adds with the same protocol) keeps two
kinds of tensors, and declares both, as torchmetrics' ``Metric.add_state`` declares a metric's
sums:

- **statistics** (:meth:`AdaptiveLoss.add_statistic`): sums streamed by :meth:`observe` over the
  validation split. They are not saved, they are summed over processes under torch.distributed
  before the update, and zeroed after it, so N processes give the update of one.
- **state** (:meth:`AdaptiveLoss.add_state`): what the update produces and the training loss
  reads (multipliers, penalty parameters, a margin). Saved in ``state_dict`` (checkpoints and
  resume), moved by ``.to(device)``, and identical on every process after each update (the
  trainer compares :meth:`AdaptiveLoss.state_fingerprint` across processes).

A subclass implements two methods: ``_observe(logits, target, valid) -> {statistic: increment}``
and ``_update(epoch, statistics, n) -> {log key: value}``, and lists the history keys its update
may return in ``log_keys``. Everything else (input checks, float32 whatever autocast says, no
gradient, the count of valid positions, the all-reduce, the reset) is done here, once.

The declarations are checked when an instance is built, on one process: a subclass that leaves
out a method, declares no statistic or no state, keeps a tensor as a plain attribute (which would
be neither saved nor synchronised), or logs under a key the trainer reserves is refused with a
message, instead of failing later, for example only under torchrun.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, ClassVar

import torch
from torch import Tensor

from cals_seg.losses._base import SegLoss, as_float32, autocast_off
from cals_seg.utils.distributed import all_reduce_sum_

# Keys of a history line that the trainer writes itself; a loss may not log under them.
RESERVED_LOG_KEYS = frozenset({"epoch", "lr", "precision", "best", "time"})
RESERVED_LOG_PREFIXES = ("train_", "val_")
_REQUIRED_METHODS = ("_observe", "_update")


class _BuiltChecked(type):
    """Metaclass: run :meth:`AdaptiveLoss._check_declarations` once ``__init__`` has finished.
    The class keeps the signature of its ``__init__`` (``inspect.signature(cls)``)."""

    def __init__(cls, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self
        if cls.settings_types and params and params[-1].kind is inspect.Parameter.VAR_KEYWORD:
            params = params[:-1] + [
                inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                  annotation=f.type)
                for f in cls.settings_fields()
            ]
        cls.__signature__ = inspect.Signature(params, return_annotation=None)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        missing = [m for m in _REQUIRED_METHODS if getattr(cls, m) is getattr(AdaptiveLoss, m)]
        if missing:
            raise TypeError(
                f"{cls.__name__} is an AdaptiveLoss but does not implement {missing}: "
                "_observe(logits, target, valid) returns the increments of its declared "
                "statistics, _update(epoch, statistics, n) applies its rule."
            )
        obj = super().__call__(*args, **kwargs)
        obj._check_declarations()
        return obj


class AdaptiveLoss(SegLoss, metaclass=_BuiltChecked):
    """Base class of losses whose state is re-estimated on validation after every epoch::

        for epoch in range(epochs):
            train_one_epoch(model, criterion, ...)
            with torch.no_grad():
                for x, y in val_loader:
                    criterion.observe(model(x), y)        # declared statistics, valid positions
            logs = criterion.update_multipliers(epoch)    # all-reduce, rule, reset

    Args:
        num_classes: K.
        ignore_index: target value of void positions (never observed).

    Class attributes:
        log_keys: the keys :meth:`update_multipliers` may return (history entries: a float, or
            a list of K floats).
        check_attributes: tensor attributes that are per-call input-check counts (transient,
            never saved: not state); a subclass with checks of its own adds its counts.
    """

    log_keys: ClassVar[tuple[str, ...]] = ()
    check_attributes: ClassVar[tuple[str, ...]] = ("bad_labels", "_unchecked_bad_labels")
    # Dataclasses of settings whose fields are keyword arguments of ``__init__`` (taken by its
    # ``**settings``, split by :meth:`settings`); ``inspect.signature(cls)`` lists them.
    settings_types: ClassVar[tuple[type, ...]] = ()

    @classmethod
    def settings_fields(cls) -> list[dataclasses.Field]:
        """The fields of :attr:`settings_types`, in order."""
        return [f for t in cls.settings_types for f in dataclasses.fields(t)]

    @classmethod
    def settings(cls, keywords: dict[str, Any]) -> list[Any]:
        """One instance of each of :attr:`settings_types` from ``keywords`` (the defaults for
        the fields not given; each checks its values).

        Raises:
            TypeError: a keyword that is no field, as for any unexpected keyword argument.
        """
        unknown = sorted(set(keywords) - {f.name for f in cls.settings_fields()})
        if unknown:
            raise TypeError(f"{cls.__name__}() got unexpected keyword argument(s) {unknown}.")
        return [t(**{f.name: keywords[f.name] for f in dataclasses.fields(t) if f.name in keywords})
                for t in cls.settings_types]

    def __init__(self, num_classes: int, ignore_index: int = -100) -> None:
        super().__init__(num_classes, ignore_index)
        self._statistic_names: list[str] = []
        self._state_names: list[str] = []
        # The number of observed valid positions: a statistic like the others.
        self.add_statistic("_count", (), dtype=torch.int64)

    # ------------------------------------------------------------------ declarations
    def add_statistic(self, name: str, shape: tuple[int, ...] | int,
                      dtype: torch.dtype = torch.float64) -> None:
        """Declare a validation sum: a zero buffer of ``shape``, not saved, all-reduced (sum)
        before the update and zeroed after it."""
        self.register_buffer(name, torch.zeros(shape, dtype=dtype), persistent=False)
        self._statistic_names.append(name)

    def add_state(self, name: str, value: Tensor) -> None:
        """Declare a state tensor: a buffer saved in ``state_dict``, identical on every process
        after each update (checked by the trainer under torch.distributed)."""
        self.register_buffer(name, value)
        self._state_names.append(name)

    def statistics(self) -> dict[str, Tensor]:
        """The declared statistics (the buffers themselves), ``_count`` included."""
        return {n: getattr(self, n) for n in self._statistic_names}

    def state_tensors(self) -> dict[str, Tensor]:
        """The declared state (the buffers themselves)."""
        return {n: getattr(self, n) for n in self._state_names}

    def state_fingerprint(self) -> Tensor:
        """Every declared state tensor flattened into one float64 vector ``(sum of numels,)``:
        equal on every process iff the state is."""
        return torch.cat([t.detach().reshape(-1).to(torch.float64)
                          for t in self.state_tensors().values()])

    def _check_declarations(self) -> None:
        name = type(self).__name__
        loose = sorted(k for k, v in vars(self).items()
                       if torch.is_tensor(v) and k not in self.check_attributes)
        if loose:
            raise TypeError(
                f"{name} keeps tensor attribute(s) {loose} outside its declared state: they "
                "would not be saved, moved or synchronised; declare them with add_state(...) "
                "or add_statistic(...)."
            )
        if len(self._statistic_names) < 2:
            raise TypeError(f"{name} declares no statistic: call self.add_statistic(...) in "
                            "__init__ for each sum that observe() accumulates.")
        if not self._state_names:
            raise TypeError(f"{name} declares no state: call self.add_state(...) in __init__ for "
                            "the multipliers its update produces.")
        bad = sorted(k for k in self.log_keys
                     if k in RESERVED_LOG_KEYS or k.startswith(RESERVED_LOG_PREFIXES))
        if bad:
            raise TypeError(f"{name}.log_keys {bad} collide with the trainer's history keys "
                            f"{sorted(RESERVED_LOG_KEYS)} and prefixes {RESERVED_LOG_PREFIXES}.")

    # ------------------------------------------------------------------ the protocol
    @torch.no_grad()
    def observe(self, logits: Tensor, target: Tensor) -> None:
        """Accumulate the validation statistics of one batch (no gradient, valid positions only).

        Computes in float32 (sums in float64) whatever autocast context surrounds the call; a
        batch that is rejected adds nothing.

        Shape:
            logits: ``(N, K, *S)``; target: ``(N, *S)``.

        Raises:
            ValueError: bad shapes or labels (as the forward pass with ``deferred_checks =
                False``), or NaN / inf logits; or bad targets of earlier calls (:meth:`check`).
        """
        self.check()  # bad targets of earlier (deferred) calls are reported first
        with autocast_off(logits.device):
            logits3, target2, valid = self._prepare(as_float32(logits), target)
            increments = self._observe(logits3, target2, valid)
            unknown = sorted(set(increments) - set(self._statistic_names))
            if unknown:
                raise TypeError(f"{type(self).__name__}._observe returned undeclared "
                                f"statistic(s) {unknown}.")
            for key, value in increments.items():
                getattr(self, key).add_(value)
            self._count += valid.sum()

    @torch.no_grad()
    def update_multipliers(self, epoch: int) -> dict[str, Any]:
        """Sum the statistics over processes, apply the rule after epoch ``epoch`` (0-based),
        zero the statistics, and return the history entries (keys among ``log_keys``).

        Raises:
            ValueError: bad targets of earlier deferred calls (:meth:`check`).
            RuntimeError: nothing was observed since the last update.
        """
        self.check()
        stats = {k: v.clone() for k, v in self.statistics().items()}
        all_reduce_sum_(list(stats.values()))
        for value in self.statistics().values():
            value.zero_()
        n = int(stats.pop("_count").item())
        if n == 0:
            raise RuntimeError(
                "update_multipliers() found no observed validation positions: call "
                "criterion.observe(logits, target) on the validation batches first."
            )
        logs = self._update(epoch, stats, n)
        unknown = sorted(set(logs) - set(self.log_keys))
        if unknown:
            raise TypeError(f"{type(self).__name__}._update returned {unknown}, which are not in "
                            f"its log_keys {list(self.log_keys)}.")
        return logs

    def _observe(self, logits: Tensor, target: Tensor, valid: Tensor) -> dict[str, Tensor]:
        """Increments of the declared statistics for one batch of flattened inputs: logits
        ``(N, K, S)`` float32/64, target ``(N, S)`` int64, valid ``(N, S)`` bool."""
        raise NotImplementedError

    def _update(self, epoch: int, statistics: dict[str, Tensor], n: int) -> dict[str, Any]:
        """The rule: update the declared state from ``statistics`` (summed over processes,
        ``_count`` removed) and ``n`` valid positions; return the history entries."""
        raise NotImplementedError
