"""Bridges to the stacks users already run, each an optional import of its own:

- :mod:`cals_seg.integrations.torchmetrics`: the streaming meters as ``torchmetrics.Metric`` s
  (ECE, adaptive ECE, class-wise ECE, mean IoU, and the full metric dicts);
- :mod:`cals_seg.integrations.lightning`: a Lightning callback that runs the multiplier update
  of an adaptive loss (observe on validation, update at the end of each validation epoch) and
  keeps the criterion's state in Lightning checkpoints.

Nothing is imported here, so ``import cals_seg`` never needs these packages.
"""
