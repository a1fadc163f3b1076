"""Check a segmentation dataset before training: read every split once and report.

``python tools/check_data.py --help`` tells how to use it. The command lives in
``cals_seg/commands/check_data.py``; installed, it is also ``cals-check-data``.
"""

try:
    from cals_seg.commands.check_data import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
