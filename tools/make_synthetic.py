"""Generate the embedded default dataset (synthetic scenes in the VOC layout).

``python tools/make_synthetic.py --help`` tells how to use it. The command lives in
``cals_seg/commands/make_synthetic.py``; installed, it is also ``cals-make-synthetic``.
"""

try:
    from cals_seg.commands.make_synthetic import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
