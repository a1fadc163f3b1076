"""Train a segmentation network with a calibration loss, then test its best checkpoint.

``python tools/train_seg.py --help`` tells how to use it. The command lives in
``cals_seg/commands/train_seg.py``; installed, it is also ``cals-train-seg``.
"""

try:
    from cals_seg.commands.train_seg import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
