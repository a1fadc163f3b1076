"""Train an image or text classifier with a calibration loss, then test its best checkpoint.

    python tools/train_cls.py configs/synthetic_cls_cals_alm.yaml [--set key=value ...]
    python tools/train_cls.py configs/synthetic_text_ce.yaml --set train.epochs=5
    python tools/train_cls.py CONFIG --resume runs/<name>

The same trainer as tools/train_seg.py (classification is the case without spatial dimensions),
so the run directory is the same: runs/<name>/{config.yaml, history.jsonl, checkpoint_last.pt,
checkpoint_best.pt, test_metrics.json, plots/*.png}. After training, the best checkpoint is
evaluated once more on the test set for the long-tail view: ``test_metrics.json`` gains
``class_counts`` (training samples per class) and, under ``pre_ts`` and ``post_ts``,
``per_class_acc`` and ``groups`` = {many (> 100 training samples), medium (20-100), few (< 20)},
each with accuracy, ECE, AECE, NLL ... over the test samples of its classes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cals_seg.cli import USER_ERRORS, launch, report, run_config, training_parser  # noqa: E402
from cals_seg.config import Config  # noqa: E402
from cals_seg.distributed import is_main_process  # noqa: E402
from cals_seg.engine import make_loader, seed_everything  # noqa: E402
from cals_seg.tasks_classification import (  # noqa: E402
    build_classification_task,
    evaluate_groups,
    group_report,
    load_best,
)
from cals_seg.trainer import Task, _json_safe, fit, resolve_device  # noqa: E402


def add_group_metrics(
    cfg: Config, task: Task, run_dir: Path, test: dict[str, Any]
) -> dict[str, Any]:
    """Re-evaluate the best checkpoint on the test set for per-class accuracy and the
    many / medium / few-shot groups (pre- and post-TS), and rewrite ``test_metrics.json``."""
    device = resolve_device(cfg.train.device)
    model = load_best(task.model, run_dir, device)
    loader = make_loader(
        task.test_set, cfg.eval.batch_size, train=False, num_workers=cfg.data.num_workers
    )
    temperatures = {"pre_ts": 1.0}
    if test.get("post_ts") is not None:
        temperatures["post_ts"] = float(test["temperature"])
    counts = task.train_set.class_counts()
    groups = evaluate_groups(
        model,
        loader,
        device,
        counts,
        task.ignore_index,
        cfg.eval.n_bins,
        temperatures,
        amp=cfg.train.amp,
        progress=cfg.train.progress and is_main_process(),
    )
    test["class_counts"] = counts
    test["class_names"] = task.class_names
    for key, block in groups.items():
        test[key].update(block)
    if is_main_process():
        path = run_dir / "test_metrics.json"
        path.write_text(json.dumps(_json_safe(test), indent=1))
    return test


def main(argv: list[str] | None = None) -> int:
    args = training_parser(__doc__).parse_args(argv)
    try:
        cfg = run_config(args)
        seed_everything(cfg.train.seed)
        task = build_classification_task(cfg)
        test = fit(cfg, task, resume=args.resume)
        run_dir = Path(args.resume) if args.resume else cfg.run_dir
        test = add_group_metrics(cfg, task, run_dir, test)
    except USER_ERRORS as err:
        return report(err)
    if not is_main_process():
        return 0
    for key, label in (("pre_ts", "test"), ("post_ts", "test post-TS")):
        m = test.get(key)
        if m is None:
            continue
        extra = f" (T = {test['temperature']:.3f})" if key == "post_ts" else ""
        print(
            f"{label} (best epoch {test['epoch'] + 1}): acc {m['acc']:.4f}  ECE {m['ece']:.4f}  "
            f"AECE {m['aece']:.4f}  CWCE {m['cwce']:.4f}  NLL {m['nll']:.4f}{extra}"
        )
    print(group_report(test))
    print(f"run directory: {run_dir}")
    return 0


if __name__ == "__main__":
    launch(main)
