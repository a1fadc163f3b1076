"""Choose the margin m of CALS-ALM (and MbLS, CALS-HR) on your own data, before a long run.

``python tools/margin.py --help`` tells how to use it. The command lives in
``cals_seg/commands/margin.py``; installed, it is also ``cals-margin``.
"""

try:
    from cals_seg.commands.margin import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
