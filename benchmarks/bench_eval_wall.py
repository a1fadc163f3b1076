"""The evaluation's wall time against the network's forward time alone, on the same splits.

An evaluation (:class:`cals_seg.evaluation.evaluator.Evaluator`) with ``ts``, ``boundary_ts``
and conformal sets (``alpha=0.2``) fits on the validation split and measures the test split;
its floor is the network's forward pass over those images, once each. This script makes a
random-weight DeepLabV3 run of the embedded synthetic setup at ``--size`` (default 256 x 256),
then times, alternating, in one process:

- ``forward``: the network over the validation and test images (the evaluation protocol, no
  meters, no cache);
- ``evaluation``: the whole evaluation (every fit refitted, every meter, the sets), the logit
  cache on (each image through the network once).

It prints the CPU, the medians and the ratio evaluation / forward (the goal: at most 1.3x).

    python benchmarks/bench_eval_wall.py [--size 256] [--val 24] [--test 48] [--repeats 3]
        [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_run(tmp: Path, size: int, val: int, test: int, encoder: str) -> Path:
    """A random-weight run of the synthetic setup: its config and a best checkpoint."""
    from cals_seg.config.schema import config_to_dict, load_config, save_config
    from cals_seg.runs.run import Run
    from cals_seg.tasks import build_task
    from cals_seg.utils.io import save_checkpoint

    num_train = val * 5  # data.val_fraction 0.2 of the training split is validation
    cfg = load_config(ROOT / "configs" / "synthetic_deeplabv3_short.yaml", [
        f"data.root={tmp / 'data'}", f"output_dir={tmp / 'runs'}", "name=bench",
        f"data.synthetic={{num_train: {num_train}, num_test: {test}, image_size: {size}}}",
        f"model.encoder_name={encoder}", "model.encoder_weights=null", "train.amp=none",
        "train.progress=false", "eval.num_maps=0", "eval.batch_size=8"], "ce")
    task = build_task(cfg)
    run = Run(cfg.run_dir)
    run.path.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run.config_file)
    state = {k: t.detach().cpu() for k, t in task.model.state_dict().items()}
    save_checkpoint({"model": state, "num_classes": cfg.data.num_classes, "epoch": 0,
                     "config": config_to_dict(cfg), "class_names": task.class_names}, run.best)
    return run.path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--val", type=int, default=24)
    parser.add_argument("--test", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--encoder", default="resnet18")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    from cals_seg.evaluation.conformal_fit import parse_conformal
    from cals_seg.evaluation.evaluator import EvalPlan, Evaluator
    from cals_seg.evaluation.stream import evaluation_loader
    from cals_seg.runs.run import load_run

    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {args.threads} threads; "
          f"{args.size} x {args.size}, {args.val} validation + {args.test} test images; "
          f"{args.repeats} repeats, alternating")
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_run(Path(tmp), args.size, args.val, args.test, args.encoder)
        run = load_run(folder, with_data=True)
        plan = replace(EvalPlan.from_config(run.config, split="test"),
                       calibrators=("ts", "boundary_ts"), refit=True,
                       conformal=parse_conformal(["alpha=0.2"]), fits=Path(tmp) / "fits",
                       fits_why="the benchmark", num_maps=0, maps_dir=None)
        infer = run.inference
        loaders = [evaluation_loader(s, plan.batch_size) for s in (run.task.val_set,
                                                                    run.task.test_set)]

        def forward() -> None:
            with torch.no_grad():
                for loader in loaders:
                    for _ in infer.predict(loader):
                        pass

        def evaluation() -> dict:
            return Evaluator(run, plan, say=lambda line: None).run().metrics

        times: dict[str, list[float]] = {"forward": [], "evaluation": []}
        metrics = evaluation()  # warm-up (and the numbers' sanity)
        forward()
        for _ in range(args.repeats):
            for name, fn in (("forward", forward), ("evaluation", evaluation)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name:>10}: median {statistics.median(values):.2f} s (min {min(values):.2f})")
    ratio = statistics.median(e / f for e, f in zip(times["evaluation"], times["forward"],
                                                    strict=True))
    print(f"evaluation / forward (median of pairs): {ratio:.2f}x; images through the network "
          f"in one evaluation: {metrics.get('network_passes')}")


if __name__ == "__main__":
    main()
