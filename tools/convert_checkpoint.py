"""Convert a checkpoint you trust into the plain form that every tool loads safely.

``python tools/convert_checkpoint.py --help`` tells how to use it. The command lives in
``cals_seg/commands/convert_checkpoint.py``; installed, it is also ``cals-convert-checkpoint``.
"""

try:
    from cals_seg.commands.convert_checkpoint import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
