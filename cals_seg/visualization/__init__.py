"""Figures of runs and studies: reliability diagrams, training curves, calibration maps and region
plots (:mod:`.plotting`, matplotlib loaded only here)."""
