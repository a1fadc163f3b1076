"""Make a run folder from a network trained elsewhere (torchvision, smp, Transformers, yours).

``python tools/import_model.py --help`` tells how to use it. The command lives in
``cals_seg/commands/import_model.py``; installed, it is also ``cals-import-model``.
"""

try:
    from cals_seg.commands.import_model import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
