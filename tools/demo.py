"""The main job on the embedded dataset: CE and CALS-ALM (the paper's setting), each raw and with
the post-hoc calibrator picked on validation, in one table.

``python tools/demo.py --help`` tells how to use it. The command lives in
``cals_seg/commands/demo.py``; installed, it is also ``cals-demo``.
"""

try:
    from cals_seg.commands.demo import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
