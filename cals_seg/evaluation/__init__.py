"""Evaluation: the inference protocol and calibrated outputs (:mod:`.inference`), streaming a
model over a split into meters (:mod:`.stream`), predictions on new images (:mod:`.predict`) and
the calibration maps of a run (:mod:`.reports`)."""
