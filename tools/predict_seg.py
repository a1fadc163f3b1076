"""Calibrated segmentation of new, unlabelled images with a trained run.

``python tools/predict_seg.py --help`` tells how to use it. The command lives in
``cals_seg/commands/predict_seg.py``; installed, it is also ``cals-predict-seg``.
"""

try:
    from cals_seg.commands.predict_seg import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
