"""Make a run folder from a network trained elsewhere, so that every tool reads it.

    python tools/import_model.py CONFIG --out runs/<name> [--method M] [--set key=value ...]

CONFIG holds the data section the toolkit already reads and a model section naming the network
(docs/external_models.md)::

    model:
      arch: external
      factory: torchvision:deeplabv3_resnet50      # or smp:unet, transformers:segformer,
                                                   # or package.module:function of your own
      weights: my_model.pt                         # torch.save(model.state_dict(), ...)
      key_map: {"module.": ""}                     # optional: rename key prefixes
      mean: [0.485, 0.456, 0.406]                  # the network's input statistics
      std: [0.229, 0.224, 0.225]

The command checks the config and the data, builds the network, loads the weights (read with
``torch.load(weights_only=True)``: a file that would run code is refused), runs one validation
image through it and refuses an output that is not ``(N, K, h, w)`` logits, fits the
temperature on the validation split (``eval.temperature_scaling``), and writes to RUN:
config.yaml (the resolved config, its name and output_dir those of RUN), checkpoint_best.pt (the
network's weights, as a trained run's), an empty history.jsonl and temperature.json. Then:

    python tools/eval_seg.py RUN --calibrators ts boundary_ts
    python tools/predict_seg.py RUN photos/ --out predictions/
    python tools/export.py RUN --format pt2 --out model.pt2

Exit status: 0, or 2 on a refused config, data, weights file or output shape (one line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cals_seg.commands._cli import USER_ERRORS, add_method_argument, add_set_argument, report
from cals_seg.config.checks import check_config
from cals_seg.config.schema import config_to_dict, load_config, save_config
from cals_seg.errors import ConfigError, RunExistsError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", metavar="CONFIG", help="YAML config with model.arch: external")
    parser.add_argument("--out", required=True, metavar="RUN", help="the run folder to write")
    add_method_argument(parser)
    add_set_argument(parser)
    return parser.parse_args(argv)


def import_model(config: str | Path, out: str | Path, overrides: list[str] | tuple[str, ...] = (),
                 method: str | None = None) -> dict[str, Any]:
    """Write the run folder ``out`` of the external network ``config`` describes (see the module
    docstring).

    Returns:
        ``{"run", "output_shape", "input_shape", "temperature", "weights"}``: what was written
        and checked.

    Raises:
        UserError: a refused config (``model.arch`` must be ``external``), data, weights file
            (missing, unsafe, not matching), an output of the wrong shape, or an ``out`` that
            already holds a run; one line each, naming the key or file.
    """
    import torch
    import torch.nn.functional as F

    from cals_seg.calibrators.ts import fit_temperature
    from cals_seg.evaluation.stream import predict, unpack_batch
    from cals_seg.models.consent import remember
    from cals_seg.models.external import load_weights_file
    from cals_seg.runs.run import Run
    from cals_seg.tasks import build_task
    from cals_seg.training.engine import make_loader
    from cals_seg.utils.io import save_checkpoint
    from cals_seg.utils.precision import resolve_amp, resolve_device

    out = Path(out)
    cfg = load_config(config, list(overrides), method)
    if cfg.model.arch != "external":
        raise ConfigError(
            f"model.arch: expected 'external' (a network trained elsewhere, named by "
            f"model.factory), got {cfg.model.arch!r}; train a toolkit model with "
            "tools/train_seg.py instead (docs/external_models.md).")
    cfg.name, cfg.output_dir = out.name, str(out.parent)  # the run's config names its folder
    # Paths as absolute: the run is evaluated from any folder, not only where it was imported.
    cfg.data.root = str(Path(cfg.data.root).absolute())
    if cfg.model.weights is not None:
        cfg.model.weights = str(Path(cfg.model.weights).absolute())
    check_config(cfg, reads_data=True, writes_run=True)
    run = Run(out)
    if run.holds_run():
        raise RunExistsError(f"--out {out} already holds a run ({', '.join(run.holds_run())}); "
                             "choose another folder, or remove it first.")
    task = build_task(cfg, "segmentation")
    model = task.model
    if cfg.model.weights is not None:
        load_weights_file(model.net, cfg.model.weights, cfg.model.weights_key, cfg.model.key_map)
    device = resolve_device(cfg.train.device)
    precision = resolve_amp(cfg.train.amp, device, warn=False)
    model.to(device).eval()

    # One validation image, padded as the evaluation pads it: the output must be logits.
    image = unpack_batch(task.val_set[0])[0][None].to(device)
    m = model.input_multiple
    height, width = image.shape[-2:]
    padded = F.pad(image, (0, -width % m, 0, -height % m))
    output_shape = (len(padded), task.num_classes, *model.check_output(padded))

    temperature = None
    if cfg.eval.temperature_scaling:
        loader = make_loader(task.val_set, cfg.eval.batch_size, False, cfg.data.num_workers)
        temperature = fit_temperature(
            lambda: predict(model, loader, device, precision, protocol=task.protocol),
            ignore_index=task.ignore_index)

    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run.config_file)
    remember(out, cfg.model.factory)  # the user named this config: their consent, kept off the run
    state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    save_checkpoint({
        "model": state, "num_classes": task.num_classes, "epoch": None,
        "config": config_to_dict(cfg),
        "imported": {"factory": cfg.model.factory, "weights": cfg.model.weights,
                     "torch": str(torch.__version__)},
    }, run.best)
    run.history_file.write_text("")  # trained by other code: no epochs here
    if temperature is not None:
        run.write_temperature(temperature)
    return {"run": str(out), "input_shape": tuple(padded.shape), "output_shape": output_shape,
            "temperature": temperature, "weights": cfg.model.weights}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    try:
        done = import_model(args.config, args.out, args.set, args.method)
    except USER_ERRORS as err:
        return report(err)
    t = done["temperature"]
    print(f"{done['run']}: {done['weights'] or 'the factory weights'}; "
          f"{done['input_shape']} -> logits {done['output_shape']} "
          f"(upsampled to the input's size); "
          + (f"T = {t:.3f} fitted on validation" if t is not None else "no temperature"))
    print(f"next: tools/eval_seg.py {done['run']} --calibrators ts boundary_ts")
    return 0


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
