"""Training: :func:`~cals_seg.training.trainer.fit` (one run from a config), the task-agnostic
epoch loop (:mod:`.engine`), live loggers (:mod:`.loggers`) and studies of many runs
(:mod:`.study`)."""
