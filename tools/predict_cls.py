"""Calibrated classes, confidences and prediction sets for new images or texts.

``python tools/predict_cls.py --help`` tells how to use it. The command lives in
``cals_seg/commands/predict_cls.py``; installed, it is also ``cals-predict-cls``.
"""

try:
    from cals_seg.commands.predict_cls import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
