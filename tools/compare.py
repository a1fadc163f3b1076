"""Compare calibration methods: train (or reuse) one run per config and seed, then tabulate.

``python tools/compare.py --help`` tells how to use it. The command lives in
``cals_seg/commands/compare.py``; installed, it is also ``cals-compare``.
"""

try:
    from cals_seg.commands.compare import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
