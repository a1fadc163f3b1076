"""What the command-line tools share: arguments, the errors shown as one line, and launching
under ``torchrun``. Library code does not import this module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from .config import Config, ConfigError, load_config
from .distributed import cleanup, init_from_env
from .engine import NonFiniteLossError
from .models.segmentation import WeightsUnavailableError

# Errors caused by the user's input (config, data, checkpoint, network): printed as
# "error: <message>" with exit code 2 instead of a traceback.
USER_ERRORS = (
    ConfigError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NonFiniteLossError,
    WeightsUnavailableError,
)


def training_parser(doc: str | None) -> argparse.ArgumentParser:
    """``CONFIG [--set KEY=VALUE ...] [--resume RUN_DIR]``, shared by the training tools."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="YAML config file")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override config values, e.g. --set train.epochs=5 loss.name=ce",
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its checkpoint_last.pt",
    )
    return parser


def run_config(args: argparse.Namespace) -> Config:
    """The config of a training command: the given file, or, with ``--resume``, the run's own
    resolved ``config.yaml``; ``--set`` overrides on top."""
    if args.resume:
        load_config(args.config, args.set)  # still validate what was given
        return load_config(Path(args.resume) / "config.yaml", args.set)
    return load_config(args.config, args.set)


def report(err: Exception) -> int:
    """Print a user error as one line; the exit code of a failed command."""
    print(f"error: {err}", file=sys.stderr)
    return 2


def launch(main: Callable[[], int]) -> NoReturn:
    """Run a tool's ``main``: join the process group under torchrun, leave it at the end."""
    init_from_env()
    try:
        code = main()
    finally:
        cleanup()
    sys.exit(code)
