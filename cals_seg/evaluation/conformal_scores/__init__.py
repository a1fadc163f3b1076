"""The conformal scores other than the default LAC, one file each, each registered in
:data:`cals_seg.evaluation.conformal_score.SCORES` where it is defined. Every file here is
imported the first time the names are read, so a new score is one new file (with its test and
its row in docs/conformal.md)."""
