"""Per-pixel inputs that a loss asks the training data for, besides the mask.

The seam, in three pieces (docs/spatial_losses.md, "Extra per-pixel inputs"):

1. A loss lists the names in its class attribute ``extra_inputs`` (e.g. ``("band",)``) and
   returns, from ``extra_input_fns()``, one picklable function per name that maps the augmented
   mask ``(H, W)`` (and the ``inside`` map of the image proper, ``False`` on padding) to the
   map ``(H, W)``, e.g. ``BandMap`` of the contrib module ``cals_bands``.
2. :func:`request_extra_inputs` hands those functions to the training split's
   :class:`~cals_seg.data.transforms.SegmentationTransform`, which runs them on the CPU, in the
   data-loading workers, on the mask after augmentation, and adds each map to the item under its
   name (a dataset returns the transform's extra keys with its item).
3. The training step passes them on: ``criterion(logits, target, band=batch["band"])``.

Nothing else changes: a loss without ``extra_inputs`` never sees the seam, and it gets no
extra maps from the evaluation data (an adaptive loss derives what it needs from the validation
target). The evaluation splits use the same seam for the region meters' ground-truth analysis
(their ``group_fn()`` maps, see :mod:`cals_seg.evaluation.stream`).
"""

from __future__ import annotations

from torch import nn
from torch.utils.data import Dataset


def request_extra_inputs(dataset: Dataset, criterion: nn.Module) -> None:
    """Make ``dataset`` (the training split) add the maps ``criterion.extra_inputs`` names to
    each item; nothing when it names none.

    Raises:
        ValueError: the dataset's ``transform`` is not a ``SegmentationTransform`` (only
            segmentation training data can provide per-pixel maps).
    """
    names = tuple(getattr(criterion, "extra_inputs", ()))
    if not names:
        return
    from cals_seg.data.transforms import (
        SegmentationTransform,  # albumentations: imported when needed
    )

    transform = getattr(dataset, "transform", None)
    if not isinstance(transform, SegmentationTransform):
        raise ValueError(
            f"loss.name: {type(criterion).__name__} needs the per-pixel input(s) {list(names)} "
            f"from the training data, but the training dataset {type(dataset).__name__} has no "
            "SegmentationTransform to compute them; use it with a segmentation dataset."
        )
    fns = criterion.extra_input_fns()
    missing = sorted(set(names) - set(fns))
    if missing:
        raise TypeError(f"{type(criterion).__name__}.extra_input_fns() lacks {missing}.")
    transform.add_extra_inputs(fns)
