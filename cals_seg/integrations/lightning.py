"""A Lightning callback that runs the validation protocol of an adaptive loss (CALS-ALM, CALS-HR).

The protocol of :class:`~cals_seg.losses.AdaptiveLoss` is: after each training epoch, stream the
statistics of every validation batch into ``criterion.observe(logits, target)``, then call
``criterion.update_multipliers(epoch)`` once. :class:`AdaptiveLossCallback` does both from
Lightning's hooks; the ``LightningModule`` only returns its logits and targets from
``validation_step``::

    from cals_seg import build_loss
    from cals_seg.integrations.lightning import AdaptiveLossCallback

    class Segmenter(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = smp.DeepLabV3(classes=21)
            self.criterion = build_loss("cals_alm", 21, ignore_index=255, margin=10.0)

        def training_step(self, batch, i):
            x, y = batch
            return self.criterion(self.model(x), y)

        def validation_step(self, batch, i):
            x, y = batch
            return {"logits": self.model(x), "target": y}   # what the callback observes

    L.Trainer(callbacks=[AdaptiveLossCallback()]).fit(Segmenter(), train_loader, val_loader)

What the callback guarantees:

- only real validation epochs count: the sanity-check batches Lightning runs before training
  are not observed, and only the first validation dataloader is;
- the update happens at the end of each validation epoch (``on_validation_epoch_end``), with
  the epoch number Lightning is in, so the multipliers equal those of the plain loop
  (``examples/train_smp_loop.py``) on the same data and seed; under DDP the statistics are
  summed over the processes by the loss itself;
- the criterion's state (multipliers, penalty parameters, margin) is saved in every Lightning
  checkpoint (in the callback's state) and restored on ``Trainer.fit(ckpt_path=...)``; a
  criterion that is an attribute of the module is in the module's ``state_dict`` as well;
- the update's numbers are logged with ``pl_module.log``: ``lambda_mean``, ``margin`` and one
  ``lambda/<k>`` per class (``log=False`` turns this off); :attr:`history` keeps every update.

Works with ``lightning`` (``import lightning.pytorch``) or the older ``pytorch_lightning``
package, whichever is installed (``pip install "cals_seg[lightning]"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on the installed package
    try:
        import pytorch_lightning as pl
    except ImportError:
        raise ImportError(
            "cals_seg.integrations.lightning needs Lightning; install it with: "
            'pip install "cals_seg[lightning]" (or: pip install lightning).'
        ) from None

from cals_seg.losses import AdaptiveLoss
from cals_seg.losses.margin_rules import margin_rule_of


class AdaptiveLossCallback(pl.Callback):
    """Feed ``criterion.observe`` in validation and call ``update_multipliers`` after it.

    Args:
        criterion: the adaptive loss; default: the module's attribute named ``attr``.
        attr: the attribute of the ``LightningModule`` holding the criterion.
        logits_key / target_key: the keys of the ``validation_step`` output dict; a tuple or
            list output is read as ``(logits, target)``.
        log: log the update's numbers with ``pl_module.log``.

    Shape:
        ``validation_step`` returns logits ``(N, K, *S)`` and target ``(N, *S)``.
    """

    def __init__(self, criterion: AdaptiveLoss | None = None, attr: str = "criterion",
                 logits_key: str = "logits", target_key: str = "target",
                 log: bool = True) -> None:
        super().__init__()
        self._criterion = criterion
        self.attr, self.logits_key, self.target_key, self.log = attr, logits_key, target_key, log
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ the criterion
    def criterion(self, pl_module: Any) -> AdaptiveLoss:
        """The adaptive loss this callback drives (checked once it is known)."""
        crit = self._criterion if self._criterion is not None else getattr(pl_module, self.attr,
                                                                           None)
        if not isinstance(crit, AdaptiveLoss):
            where = "the criterion passed" if self._criterion is not None else (
                f"{type(pl_module).__name__}.{self.attr}")
            raise TypeError(
                f"AdaptiveLossCallback: {where} is {type(crit).__name__}, not an adaptive loss "
                "(cals_alm, cals_hr or another AdaptiveLoss); pass criterion=... or attr=... ."
            )
        return crit

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._module = pl_module
        self.criterion(pl_module).to(pl_module.device)
        self._apply_pending()

    def _apply_pending(self) -> None:
        """Load a criterion state restored before the module was known."""
        if self._pending is not None and self._known() is not None:
            self._known().load_state_dict(self._pending)
            self._pending = None

    def _known(self) -> AdaptiveLoss | None:
        crit = self._criterion
        if crit is None and self._module is not None:
            crit = getattr(self._module, self.attr, None)
        return crit if isinstance(crit, AdaptiveLoss) else None

    _module: Any = None
    _pending: dict[str, Tensor] | None = None

    # ------------------------------------------------------------------ validation hooks
    def _logits_target(self, outputs: Any) -> tuple[Tensor, Tensor]:
        if isinstance(outputs, Mapping):
            missing = [k for k in (self.logits_key, self.target_key) if k not in outputs]
            if missing:
                raise KeyError(
                    f"AdaptiveLossCallback: validation_step returned keys {sorted(outputs)}, "
                    f"without {missing}; return {{{self.logits_key!r}: logits, "
                    f"{self.target_key!r}: target}}."
                )
            return outputs[self.logits_key], outputs[self.target_key]
        if isinstance(outputs, tuple | list) and len(outputs) == 2:
            return outputs[0], outputs[1]
        raise TypeError(
            "AdaptiveLossCallback: validation_step must return {'logits': logits, 'target': "
            f"target}} (or a (logits, target) pair), but returned {type(outputs).__name__}."
        )

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking or dataloader_idx != 0:
            return
        logits, target = self._logits_target(outputs)
        crit = self.criterion(pl_module)
        crit.observe(logits.detach(), target)
        rule = margin_rule_of(crit)  # margin: auto
        if rule is not None:
            rule.observe(logits.detach(), target)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        crit = self.criterion(pl_module)
        logs = crit.update_multipliers(trainer.current_epoch)
        rule = margin_rule_of(crit)
        if rule is not None:
            logs.update(rule.step(crit, trainer.current_epoch))
        self.history.append({"epoch": trainer.current_epoch, **logs})
        if self.log:
            pl_module.log_dict(_scalars(logs), on_epoch=True, sync_dist=False)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"history": list(self.history)}
        crit = self._known()
        if crit is not None:
            state["criterion"] = {k: v.detach().cpu() for k, v in crit.state_dict().items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self._pending = state_dict.get("criterion")
        self._apply_pending()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._module = pl_module
        self._apply_pending()


def _scalars(logs: Mapping[str, Any]) -> dict[str, float]:
    """The update's numbers as flat floats: per-class lists as ``<key>/<k>`` and their mean
    as ``<key>_mean``."""
    out: dict[str, float] = {}
    for key, value in logs.items():
        if isinstance(value, list | tuple):
            numbers = [float(v) for v in value if v is not None]
            for k, v in enumerate(value):
                if v is not None:
                    out[f"{key}/{k}"] = float(v)
            if numbers:
                out[f"{key}_mean"] = sum(numbers) / len(numbers)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


__all__ = ["AdaptiveLossCallback"]
