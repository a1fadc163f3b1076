"""Tasks: what a config's ``data`` and ``model`` sections build, and which meters report on it.

A :class:`Task` is the three splits, the model and the meters of one task family. Each family has
one module here and registers its dataset builders by ``data.name`` in
:data:`cals_seg.data.registry.DATASETS` (re-exported here)::

    @register_dataset("synthetic_text", family="classification", kind="text")
    def synthetic_text(cfg: Config) -> ClassificationTask: ...

A new dataset is one new file in this folder (the registry imports every module here the first
time its names are read). :func:`build_task` looks the name up (a typo lists the valid names).
A task's meters are those of :data:`cals_seg.metrics.METERS` registered for its family. The
trainer only ever sees a ``Task``; it never reads ``data`` or ``model`` itself.
"""

from __future__ import annotations

from cals_seg.tasks.base import (  # re-exported: the names are base's __all__
    DATASETS as DATASETS,
)
from cals_seg.tasks.base import (
    TASK_TYPES as TASK_TYPES,
)
from cals_seg.tasks.base import (
    ClassificationTask as ClassificationTask,
)
from cals_seg.tasks.base import (
    DatasetEntry as DatasetEntry,
)
from cals_seg.tasks.base import (
    SegmentationTask as SegmentationTask,
)
from cals_seg.tasks.base import (
    Task as Task,
)
from cals_seg.tasks.base import (
    build_task as build_task,
)
from cals_seg.tasks.base import (
    dataset_names as dataset_names,
)
from cals_seg.tasks.base import (
    register_dataset as register_dataset,
)
from cals_seg.tasks.base import (
    score_metric as score_metric,
)
from cals_seg.tasks.base import (
    task_family as task_family,
)

# The built-in datasets register themselves in this order (that of a misspelt data.name's list);
# a new file in this folder registers itself after them (DATASETS discovers it).
from cals_seg.tasks import base, classification, segmentation, text  # noqa: E402, F401  # isort: skip

__all__ = list(base.__all__)
