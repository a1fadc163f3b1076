"""Export a trained segmentation or image classification run as ONNX or a torch.export .pt2.

``python tools/export.py --help`` tells how to use it. The command lives in
``cals_seg/commands/export.py``; installed, it is also ``cals-export``.
"""

try:
    from cals_seg.commands.export import cli
except ModuleNotFoundError as err:  # the toolkit is not installed in this Python
    raise SystemExit(f"error: {err}; install it first: pip install -e . (make does)") from None

if __name__ == "__main__":
    cli()
