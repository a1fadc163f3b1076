"""What the command-line tools share: arguments, the training command, the errors shown as one
line, and launching under ``torchrun``. Library code does not import this module."""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from cals_seg.config.checks import check_config
from cals_seg.config.schema import load_config
from cals_seg.errors import USER_ERRORS, MissingPathError, UserError  # noqa: F401 (USER_ERRORS: for the commands)

if TYPE_CHECKING:
    from cals_seg.config.schema import Config

# This module is imported before argparse runs (``--help`` must answer at once): it imports
# nothing heavy at the top; torch, the data and the models are imported inside the commands.
# The tools catch one type, UserError (USER_ERRORS is that type as a tuple): anything else keeps
# its traceback.


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
    """A warning as the tools show it: one line ``warning: <message>`` on stderr (the category
    named unless it is a plain UserWarning), without the file, line and source Python prints."""
    text = " ".join(str(message).split())
    kind = "" if category is UserWarning else f" ({category.__name__})"
    try:
        print(f"warning{kind}: {text}", file=file if file is not None else sys.stderr)
    except OSError:  # stderr closed: nothing to show it on
        pass


# The tools import this module first: their warnings are one line each (library code, which does
# not import it, keeps Python's own format).
warnings.showwarning = show_warning

# A --set item: a dotted key, "=", the value (a config path never looks like this).
_SET_ITEM = re.compile(r"^[A-Za-z_][\w.-]*=")


def split_set_items(argv: Sequence[str]) -> list[str]:
    """``--set a=1 b=2 CONFIG`` -> ``--set=a=1 --set=b=2 CONFIG``: the items of ``--set`` are its
    ``KEY=VALUE`` words, so a positional after them (CONFIG) stays a positional."""
    out: list[str] = []
    taking = False
    for i, word in enumerate(argv):
        if word == "--":
            return out + list(argv[i:])
        if taking and _SET_ITEM.match(word):
            out.append(f"--set={word}")
            continue
        if word == "--set" and i + 1 < len(argv) and _SET_ITEM.match(argv[i + 1]):
            taking = True
            continue
        taking = False
        out.append(word)
    return out


TRUST_HELP = ("allow the run folder's model.factory to import code outside the known model "
              "builders (torchvision, timm, smp, transformers); only for run folders you trust")


def add_trust_argument(parser: argparse.ArgumentParser) -> None:
    """``--trust-code``: consent to import a ``model.factory`` that the run folder names
    (:mod:`cals_seg.models.consent`); without it such a factory is refused before any import."""
    parser.add_argument("--trust-code", action="store_true", help=TRUST_HELP)


def consent_of(args: argparse.Namespace) -> Any:
    """The consent block of a command that reads run folders: ``--trust-code`` allows their
    factories; without it the decision is left to :func:`cals_seg.runs.run.load_run` (a known
    builder, or consent remembered for the folder, else refused)."""
    from cals_seg.models.consent import code_consent

    return code_consent(True if getattr(args, "trust_code", False) else None)


def run_folder_command(args: argparse.Namespace, body: Callable[[argparse.Namespace], int]
                       ) -> int:
    """``body(args)`` of a command that evaluates run folders: within their consent block
    (:func:`consent_of`), and NaN / inf logits of their network as one line naming the runs."""
    from cals_seg.evaluation.inference import NonFiniteLogitsError

    with consent_of(args):  # --trust-code: the run folders' factories may be imported
        try:
            return body(args)
        except NonFiniteLogitsError as err:  # NaN / inf logits: one line naming the run
            runs = args.run if isinstance(args.run, str) else ", ".join(map(str, args.run))
            return report(UserError(f"{runs}: {err}"))
        except (UserError, RuntimeError) as err:  # e.g. a bad mask met during the test pass
            user = user_error(err)
            if user is None:
                raise
            return report(user)


def enable_set_contrib(items: Sequence[str]) -> list[str]:
    """Opt in to the experiments of ``cals_seg/contrib/`` that ``--set contrib=[NAME, ...]``
    names (the user's own command line), before any name of theirs is checked; the run's own
    ``contrib`` key is read with its config, later.

    Raises:
        UserError: a value that is not a list of contrib module names (the valid ones listed).
    """
    import yaml

    from cals_seg.utils.registry import enable_contrib

    names: list[str] = []
    for item in items:
        key, _, value = item.partition("=")
        if key.strip() != "contrib":
            continue
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        if not isinstance(parsed, list):
            raise UserError(f"--set {item!r}: contrib: expected a list of module names, e.g. "
                            "--set contrib=[boundary_conf_ts].")
        names += enable_contrib(parsed, where=f"--set {item!r}: contrib")
    return names


def registered_or_refused(registry: Any, names: Sequence[str | None], flag: str) -> None:
    """Refuse, in one line, a name of ``names`` that ``registry`` does not hold: a name kept
    beside the core says how to opt in on this command line (``--set contrib=[MODULE]``)."""
    for name in names:
        if name is None or name in registry:
            continue
        hint = registry.beside_hint(name)
        if hint is not None:
            module = registry.beside[name]
            raise UserError(f"{flag} {name}: {hint}; here: --set contrib=[{module}].")
        raise UserError(f"{flag} {name}: unknown {registry.what}; valid names are "
                        f"{sorted(registry)}.")


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE ...``: repeated groups add up, in order (a later value wins); only
    ``KEY=VALUE`` words belong to it, so ``--set train.epochs=1 CONFIG`` keeps CONFIG."""
    parser.add_argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override config values, e.g. --set train.epochs=5 loss.params.margin=6 (may be "
        "repeated; applied in order)",
    )
    parse = parser.parse_known_args

    def parse_known_args(args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        return parse(split_set_items(sys.argv[1:] if args is None else args), namespace)

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def add_method_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--method",
        default=None,
        help="the method (loss) of a setup file, e.g. ce or cals_alm (default: the file's "
        "`method`; configs/<setup>_<method>.yaml names it too)",
    )


PROTOCOL_KEYS = ("mode", "resize", "pad", "window", "stride")


def add_protocol_arguments(parser: argparse.ArgumentParser) -> None:
    """``--mode --resize --pad --window --stride``: the run's ``eval.*`` protocol, overridden
    (see :mod:`cals_seg.evaluation.inference`); the metrics and outputs stay at the image's
    resolution."""
    group = parser.add_argument_group(
        "network input (default: the run's eval section; the logits are always upsampled to "
        "the image's own size)")
    group.add_argument("--mode", choices=["whole", "slide"], default=None,
                       help="whole image, or tiles of --window every --stride pixels")
    group.add_argument("--resize", default=None, metavar="S",
                       help="longest side of the network input, aspect kept (null: none)")
    group.add_argument("--pad", default=None, metavar="P",
                       help="pad the network input to at least P x P (null: none)")
    group.add_argument("--window", default=None, metavar="W", help="tile side (slide mode)")
    group.add_argument("--stride", default=None, metavar="S", help="tile step (slide mode)")


def protocol_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` items of :func:`add_protocol_arguments`' options that were given."""
    return [f"eval.{key}={getattr(args, key)}" for key in PROTOCOL_KEYS
            if getattr(args, key, None) is not None]


def training_parser(doc: str | None) -> argparse.ArgumentParser:
    """``CONFIG [--method M] [--set KEY=VALUE ...] [--resume RUN_DIR]``."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="?", default=None,
                        help="YAML config or setup file (not needed with --resume)")
    add_method_argument(parser)
    add_set_argument(parser)
    parser.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its checkpoint_last.pt, with the run's own "
        "config.yaml (--set changes it)",
    )
    add_trust_argument(parser)
    return parser


def run_config(args: argparse.Namespace) -> Config:
    """The config of a training command: the given file, or, with ``--resume``, the run's own
    resolved ``config.yaml``; ``--set`` overrides on top."""
    if args.resume:
        from cals_seg.runs.run import Run

        if args.config is not None:  # the older form CONFIG --resume RUN_DIR: still validated
            load_config(args.config, args.set, args.method)
        run = Run(args.resume)
        run.check_resumable()
        # the run's own resolved config (checked whole against the checkpoint's own copy, so
        # that a config cut short is said to be damaged, not "other settings"): --set changes it
        saved = None
        if run.last.is_file():
            saved = run.read_checkpoint("last").get("config")
        cfg = run.read_config(args.set, saved=saved if isinstance(saved, dict) else None)
        if cfg.model.arch == "external" and isinstance(cfg.model.factory, str):
            from cals_seg.models.consent import check_consent

            # a run folder is data: its factory needs --trust-code or remembered consent
            check_consent(cfg.model.factory, run.config_file,
                          bool(getattr(args, "trust_code", False)), run.path)
        return cfg
    if args.config is None:
        raise MissingPathError("give a CONFIG (a YAML config or setup file), or --resume "
                               "RUN_DIR to continue a run.")
    return load_config(args.config, args.set, args.method)



def check_inputs_exist(inputs: Sequence[str]) -> None:
    """Refuse the first of the prediction inputs that does not exist (counting the others),
    before anything is created.

    Raises:
        MissingPathError: one line naming the path.
    """
    missing = [item for item in inputs if not os.path.lexists(item)]
    if missing:
        more = f" (nor {len(missing) - 1} more inputs)" if len(missing) > 1 else ""
        raise MissingPathError(f"{missing[0]} does not exist{more}; check the path. Nothing "
                               "was written.")

def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line. An error raised in a DataLoader worker comes back
    with the worker's traceback inside its message (``Caught DataError in DataLoader worker
    process 0. Original Traceback ...``): the user sees the original message only."""
    text = str(err)
    if "Original Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        name, sep, message = last.partition(": ")
        text = message if sep and name.rsplit(".", 1)[-1].isidentifier() else last
    return " ".join(text.split())


def report(err: Exception) -> int:
    """Print a user error as one line; the exit code of a failed command."""
    print(f"error: {one_line(err)}", file=sys.stderr)
    return 2


def user_error(err: BaseException) -> UserError | None:
    """``err`` as the :class:`UserError` it is, or was in a DataLoader worker; None for any other
    error (a bug: it keeps its traceback).

    A worker's error comes back rebuilt from its text (``Caught DataError in DataLoader worker
    process 0. Original Traceback ...``): as its own type when that type takes one message, else
    as a ``RuntimeError`` (a :class:`~cals_seg.calibrators.CalibratorFileError` takes three
    arguments): the type named there is looked up among the UserError kinds."""
    if isinstance(err, UserError):
        return err
    text = str(err)
    match = re.match(r"Caught (\w+) in DataLoader worker", text)
    if isinstance(err, RuntimeError) and match and "Original Traceback" in text:
        kinds, seen = [UserError], set()
        while kinds:
            kind = kinds.pop()
            if kind.__name__ == match.group(1):
                return UserError(one_line(err))
            seen.add(kind)
            kinds += [k for k in kind.__subclasses__() if k not in seen]
    return None


def interrupted(resume: str | os.PathLike | None = None) -> int:
    """Ctrl-C as one line (exit status 130): how to resume the run, or that nothing was left
    half-written (every file is written atomically)."""
    how = (f"continue with --resume {resume}" if resume is not None else
           "files are written atomically, so nothing is half-written; run the command again")
    print(f"interrupted (Ctrl-C): {how}.", file=sys.stderr)
    return 130


def _excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    if issubclass(kind, KeyboardInterrupt):  # a tool stopped with Ctrl-C: no traceback
        interrupted()
        return
    _default_excepthook(kind, value, tb)


_default_excepthook = sys.excepthook
sys.excepthook = _excepthook  # this module is imported by the commands only


def train_command(
    doc: str | None, family: str, summary: Callable[[dict[str, Any]], str] | None = None
) -> Callable[[list[str] | None], int]:
    """The ``main`` of a training tool: config -> seed -> task -> :func:`fit` -> summary."""

    def main(argv: list[str] | None = None) -> int:
        args = training_parser(doc).parse_args(argv)
        cfg = None
        try:
            cfg = run_config(args)
            check_config(cfg, reads_data=True, writes_run=True)  # all keys, before any work
            # torch, the models and the data only now: a config refused above is said at once
            from cals_seg.tasks import build_task
            from cals_seg.training.engine import seed_everything
            from cals_seg.training.trainer import fit

            seed_everything(cfg.train.seed)  # the model's initialisation depends on it
            task = build_task(cfg, family)
            test = fit(cfg, task, resume=args.resume)
        except (UserError, RuntimeError) as err:
            user = user_error(err)
            if user is None:
                raise
            return report(after_training(user, args.resume or (cfg.run_dir if cfg else None),
                                         cfg.train.epochs if cfg is not None else None))
        except KeyboardInterrupt:
            return interrupted(args.resume or (cfg.run_dir if cfg is not None else None))
        from cals_seg.utils.distributed import is_main_process

        if not is_main_process():
            return 0
        metric = task.score_metric
        for key, label in (("pre_ts", "test"), ("post_ts", "test post-TS")):
            m = test.get(key)
            if m is None:
                continue
            extra = f" (T = {test['temperature']:.3f})" if key == "post_ts" else ""
            print(f"{label} (best epoch {test['epoch'] + 1}): {metric} {m[metric]:.4f}  "
                  f"ECE {100 * m['ece']:.2f}%  AECE {100 * m['aece']:.2f}%  "
                  f"NLL {m['nll']:.4f}{extra}")
        if summary is not None:
            print(summary(test))
        print(f"run directory: {args.resume or cfg.run_dir}")
        advice = (test.get("under_confident") or {}).get("advice")
        if advice:  # the last line: a margin penalty cannot help this network
            print(advice)
        return 0

    return main


def after_training(err: UserError, run_dir: str | os.PathLike | None,
                   epochs: int | None = None) -> UserError:
    """``err`` (a data error) with the way to finish the run once the data is fixed when it was
    met after a checkpoint was written: ``--resume`` runs only the test when every epoch is
    trained (a bad mask of the test split, found after the training), else continues."""
    from cals_seg.errors import DataError

    if run_dir is None or not isinstance(err, DataError):
        return err
    from cals_seg.runs.run import Run

    run = Run(run_dir)
    if not run.last.is_file() or run.finished():
        return err
    try:
        done = max((h["epoch"] + 1 for h in run.read_history()[0]), default=0)
    except UserError:
        done = 0
    how = ("finishes the test without training again" if epochs is not None and done >= epochs
           else "continues the training from its last checkpoint")
    return type(err)(f"{one_line(err).rstrip('.')}. The trained epochs are kept in "
                     f"{run.last}: once the data is fixed, tools/train_seg.py --resume {run_dir} "
                     f"{how}.")


def launch(main: Callable[[], int]) -> NoReturn:
    """Run a tool's ``main``: join the process group under torchrun, leave it at the end.
    A plain launch (``WORLD_SIZE`` unset or 1) loads nothing first, so ``--help`` is instant."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(main())
    from cals_seg.utils.distributed import cleanup, init_from_env

    init_from_env()
    try:
        code = main()
    finally:
        cleanup()
    sys.exit(code)
