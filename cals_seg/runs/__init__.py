"""A trained run: :class:`~cals_seg.runs.run.Run` (its folder, files and checkpoints, loading
it on a device, the one test pass; :mod:`.run`), the logit gaps behind the margin
(:mod:`.gaps`) and export (:mod:`.export`)."""
