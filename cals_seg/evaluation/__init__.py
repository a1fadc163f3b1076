"""Evaluation: the inference protocol and calibrated outputs (:mod:`.inference`), streaming a
model over a split into meters (:mod:`.stream`), predictions on new images (:mod:`.predict`),
the calibration maps of a run (:mod:`.reports`) and per-pixel prediction sets with a conformal
guarantee (:mod:`.conformal`)."""
