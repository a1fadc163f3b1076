"""Several commands in one ``torchrun`` launch (tests/test_pipeline_distributed.py): each rank
runs ``cals_seg.commands.<tool>.main(argv)`` for every ``[tool, argv]`` of the JSON list given
as the only argument, in order. The first command that returns non-zero ends the launch with its
code.

As the tools' ``cli()`` (:func:`cals_seg.commands._cli.launch`): the process group joined once
before the commands (:func:`~cals_seg.utils.distributed.init_from_env`) and left after them
(:func:`~cals_seg.utils.distributed.cleanup`); between two commands every rank waits for the
others (a barrier, as the next launch's rendezvous would). The group is not left and joined again
between commands: a rank that joins a new default group while another still holds the old one
can meet the old one's addresses in the launcher's store and wait for ever.

One launch instead of one per command: the launcher and its workers start (and import torch and
the toolkit) once for the file instead of once per command."""

from __future__ import annotations

import importlib
import json
import sys


def main() -> int:
    from cals_seg.utils.distributed import barrier, cleanup, init_from_env

    init_from_env()
    try:
        for tool, argv in json.loads(sys.argv[1]):
            code = importlib.import_module(f"cals_seg.commands.{tool}").main(argv)
            if code:
                print(f"{tool} {' '.join(argv)}: exit code {code}", file=sys.stderr)
                return code
            barrier()
    finally:
        cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
