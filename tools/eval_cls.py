"""Evaluate a trained classification or text run: metrics before/after calibration, sets.

``python tools/eval_cls.py --help`` tells how to use it. The command lives in
``cals_seg/commands/eval_cls.py``; installed, it is also ``cals-eval-cls``.
"""

try:
    from cals_seg.commands.eval_cls import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
