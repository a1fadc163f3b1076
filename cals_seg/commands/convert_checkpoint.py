"""Convert a checkpoint you trust into the plain form that every tool loads safely.

    python tools/convert_checkpoint.py runs/<name>/checkpoint_best.pt --trust [--out FILE]

Every tool reads checkpoints with ``torch.load(weights_only=True)``: tensors, numbers, strings,
lists and dicts only, so that a checkpoint someone shared cannot run code when it is loaded.
A file refused for holding other Python objects (written by other code, or altered) is converted
here: it is unpickled in full, which RUNS any code its pickle holds, so only do this with a file
you trust (``--trust`` says so), then its content is rewritten in plain types (to FILE, or in
place) and read back safely.

Exit status: 0, or 2 when the file cannot be converted (or --trust is missing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cals_seg.commands._cli import report
from cals_seg.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="the checkpoint to convert")
    parser.add_argument("--trust", action="store_true",
                        help="I trust this file: unpickling it may run code it holds")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the converted checkpoint (default: in place)")
    args = parser.parse_args(argv)

    if not args.trust:
        return report(UserError(
            f"converting {args.checkpoint} unpickles it in full, which runs any code it holds; "
            "pass --trust if you trust the file (you wrote it, or know who did)."))
    from cals_seg.utils.io import convert_checkpoint

    try:
        out = convert_checkpoint(args.checkpoint, args.out)
    except UserError as err:
        return report(err)
    print(f"wrote {out}: it now loads safely (weights_only=True)")
    return 0


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
