"""Two rules on the config that the objects born from it also apply: the class names of
``data.class_names`` and the evaluation protocol of ``eval``. They live below the tasks, so that
a task can apply them where its data and its protocol are born without importing the whole
table of rules (``cals_seg.checks`` / ``cals_seg.rules``)."""

from __future__ import annotations

from .config import Config
from .errors import ConfigError


def check_class_names(cfg: Config) -> None:
    """Refuse a ``data.class_names`` that is not ``data.num_classes`` different names.

    Raises:
        ConfigError: naming the key and the fix.
    """
    names, k = cfg.data.class_names, cfg.data.num_classes
    if names is None:
        return
    if len(names) != k:
        raise ConfigError(
            f"data.class_names: {len(names)} names for data.num_classes={k} classes; give one "
            "name per class, in class-index order (or null for the dataset's own names)."
        )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice or not all(n.strip() for n in names):
        what = f"the names {twice} occur twice" if twice else "a name is empty"
        raise ConfigError(f"data.class_names: {what}; each class needs its own name.")


def check_eval_protocol(cfg: Config) -> None:
    """Refuse evaluation-protocol values (``eval.mode``, ``window``, ``stride``, ``resize``,
    ``pad``) that :class:`cals_seg.inference.EvalProtocol` cannot run: the rule is the
    protocol's own (it validates itself when it is built); here it is reported under the config
    keys, with a fix.

    Raises:
        ConfigError: naming the key and the fix.
    """
    from .inference import EvalProtocol

    e = cfg.eval
    stride = max(1, e.window * 2 // 3) if isinstance(e.window, int) else 341
    fixes = {
        "mode": "e.g. --set eval.mode=slide eval.window=512 eval.stride=341 (tiles), or "
                "eval.mode=whole with eval.resize=1024",
        "window": "e.g. --set eval.window=512",
        "stride": f"e.g. --set eval.stride={stride} (two thirds of the window)",
        "resize": "or null for none",
        "pad": "or null for none",
    }
    try:
        EvalProtocol(mode=e.mode, resize=e.resize, pad=e.pad, window=e.window, stride=e.stride)
    except ValueError as err:
        text = str(err)
        field = text.split("`")[1] if text.count("`") >= 2 else "mode"
        message = text.replace("`window`", "eval.window").replace(f"`{field}`", f"eval.{field}")
        raise ConfigError(f"{message.rstrip('.')}; {fixes.get(field, '')}.") from None
