"""Calibrated classes, confidences and prediction sets for new images or texts, with a trained
classification run.

    python tools/predict_cls.py runs/<name> photos/ extra.jpg --out predictions/
        [--calibrator NAME | --temperature T] [--conformal ALPHA [mode=risk|class]
        [score=lac|aps|raps] [seed=S]] [--top 5] [--device auto|cpu|cuda] [--amp ...]
        [--strict] [--set key=value ...]
    python tools/predict_cls.py runs/<text run> posts/ --out predictions/ [--posts | --lines]

RUN is a run folder of tools/train_cls.py (or a checkpoint inside one). Its confidences are
softmax(logits / T) with the temperature fitted on the validation split (temperature.json;
--temperature 1 switches it off), or, with --calibrator NAME, the post-hoc calibrator fitted by
``tools/eval_cls.py RUN --calibrators NAME`` (saved in <run>/calibrators/NAME.pt and used only
when fitted for this network, its classes and precision).

Inputs:

- image runs: image files or folders (searched recursively); each image is read as RGB and made
  the network's input as in the evaluation: shorter side resized to data.eval_size (default
  data.image_size), centre crop of data.image_size, normalisation.
- text runs: text files or folders (every file inside, recursively, in name order; UTF-8, other
  bytes read as Latin-1). By default a file is one document, taken as written. --posts: each
  file is a news post with headers (the 20news layout the run was trained on) and is cleaned
  with the run's data.text_strip as the training posts were (headers, quotes, signature).
  --lines: each non-empty line of a file is one document. Words are tokenised and looked up in
  the vocabulary of the run's training split (which is read: a text run needs its data), the
  first data.max_len kept.

Writes DIR/predictions.jsonl, one JSON line per image or document: "input" (and "line" with
--lines), "class" and "class_index" (the argmax of the calibrated probabilities),
"confidence" (its probability), "top" (the --top most probable classes with their
probabilities), the calibration ("temperature" or "calibrator"), "precision", for texts
"tokens" and "unknown" (the share of the words not in the vocabulary: a high share means a text
unlike the training ones), and with --conformal ALPHA "set" (the classes of the prediction set,
most probable first), "set_size" and "conformal" (alpha, mode, score, threshold, guarantee).
The sets come from the network's logits and the conformal fit saved in <run>/calibrators/ by
eval_cls --conformal (fitted now on the held-out validation inputs when missing or made for
something else); their guarantee: the true class is in the set of at least 1 - ALPHA of new
inputs like the validation ones (docs/conformal.md).

An input that cannot be read, or a document without a word, gets a JSON line with "error" and
a one-line error on stderr naming the file and the fix; the others are written (exit status 1),
or, with --strict, the command stops there (exit status 2). DIR may not be or lie inside an
input folder, and an existing predictions.jsonl is replaced only when predict_cls wrote it.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from cals_seg.commands._cli import (
    USER_ERRORS,
    add_set_argument,
    add_trust_argument,
    check_inputs_exist,
    report,
    run_folder_command,
)
from cals_seg.commands.eval_seg import calibrator_name
from cals_seg.config.rules import check_folder
from cals_seg.errors import MissingPathError, UserError
from cals_seg.utils.paths import OutputFolder, os_error

PREDICTIONS = "predictions.jsonl"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", metavar="RUN_DIR_OR_CHECKPOINT")
    parser.add_argument("inputs", nargs="+", metavar="INPUTS",
                        help="image files or folders (image runs); text files or folders "
                        "(text runs)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="instead of the run's fitted temperature (1: no calibration)")
    parser.add_argument("--calibrator", default=None, metavar="NAME", type=calibrator_name,
                        help="a post-hoc calibrator saved in <run>/calibrators/ by eval_cls "
                        "(instead of T)")
    parser.add_argument("--conformal", nargs="+", default=None, metavar="ALPHA",
                        help="prediction sets with miscoverage ALPHA (then optional "
                        "mode=risk|class, score=lac|aps|raps, seed=S)")
    parser.add_argument("--top", type=int, default=5, metavar="K",
                        help="most probable classes listed per input (default 5)")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--posts", action="store_true", help="text runs: each file is a news "
                     "post, cleaned with the run's data.text_strip")
    how.add_argument("--lines", action="store_true",
                     help="text runs: each non-empty line is one document")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:1 (default: the "
                        "run's train.device)")
    parser.add_argument("--amp", default=None, choices=["auto", "none", "bf16", "fp16"],
                        help="precision of the forward pass (default: the run's train.amp, "
                        "where auto is float32 on a CPU)")
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first unreadable input (default: name it, go on)")
    add_set_argument(parser)
    add_trust_argument(parser)
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top: expected a number of classes >= 1, got {args.top}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_folder_command(args, _main)


def is_text_run(run: Any) -> bool:
    """Whether ``run``'s data are texts (its ``data.name`` registered with kind ``text``)."""
    from cals_seg.tasks import DATASETS

    return DATASETS[run.config.data.name].kind == "text"


def open_run(args: argparse.Namespace) -> tuple[Any, float, Any]:
    """``(run, temperature, calibrator or None)``: the classification run (its data read only
    for a text run, whose vocabulary comes from it), and how its confidences are calibrated."""
    from cals_seg.commands.eval_cls import check_flat, checked_run_path
    from cals_seg.runs.run import load_run
    from cals_seg.tasks import DATASETS

    path, which, cfg = checked_run_path(args, "predict_cls")
    text = DATASETS[cfg.data.name].kind == "text"
    run = load_run(path, which, overrides=args.set, family="classification", with_data=text,
                   device=args.device, amp=args.amp)
    if args.posts or args.lines:
        if not text:
            flag = "--posts" if args.posts else "--lines"
            raise UserError(f"{flag}: {run.path} is an image run; {flag} reads texts (give "
                            "image files or folders).")
    if run.precision != "none":
        from cals_seg.utils.precision import BF16_DEVIATION

        warnings.warn(f"precision {run.precision}: {BF16_DEVIATION}; --amp none for float32.",
                      stacklevel=1)
    if args.calibrator is not None:
        check_flat([args.calibrator], "--calibrator")
        return run, 1.0, run_calibrator(run, args.calibrator)
    return run, run.temperature_for(args.temperature), None


def run_calibrator(run: Any, name: str) -> Any:
    """The run's saved calibrator ``name``, validated and made for this use
    (:func:`cals_seg.calibrators.load_run_calibrator`); its messages name eval_cls, the tool
    that fits a classification run's calibrators."""
    from cals_seg.calibrators import load_run_calibrator

    try:
        return load_run_calibrator(run, name).eval()
    except UserError as err:
        text = str(err).replace("tools/eval_seg.py", "tools/eval_cls.py")
        raise (MissingPathError if isinstance(err, MissingPathError) else UserError)(text) \
            from None


# ----------------------------------------------------------------------------- inputs
def text_files(inputs: list[str]) -> list[Path]:
    """The files of ``inputs`` (a folder: every file inside, recursively, in name order; hidden
    ones skipped)."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and not any(
                part.startswith(".") for part in f.relative_to(p).parts))
        else:
            files.append(p)
    return files


def read_text(path: Path) -> str:
    """The text of ``path``: UTF-8, else Latin-1 (which reads any bytes, as the 20news reader).

    Raises:
        UserError: the file cannot be read, named with the reason.
    """
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UserError(f"{path}: cannot be read ({err.strerror or type(err).__name__}); check "
                        "the path and its permissions.") from None
    if b"\0" in raw[:4096]:
        raise UserError(f"{path}: is not a text file (it holds binary bytes); give text files "
                        "(one document per file, or --lines).")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def documents(files: list[Path], args: argparse.Namespace, strip: Any
              ) -> list[tuple[Path, int | None, str | None, str | None]]:
    """``(file, line or None, text or None, error or None)`` per document of ``files``: one per
    file, or per non-empty line with ``--lines``; ``--posts`` cleans each with ``strip``."""
    from cals_seg.data.text import clean_post

    out: list[tuple[Path, int | None, str | None, str | None]] = []
    for path in files:
        try:
            text = read_text(path)
        except UserError as err:
            out.append((path, None, None, str(err)))
            continue
        if args.lines:
            out += [(path, i, line, None) for i, line in enumerate(text.splitlines(), 1)
                    if line.strip()]
        else:
            out.append((path, None, clean_post(text, strip) if args.posts else text, None))
    return out


# ----------------------------------------------------------------------------- predictions
def calibrated_probs(logits: Any, temperature: float, calibrator: Any) -> Any:
    """``softmax(calibrator(logits))``, or ``softmax(logits / T)``, in float32.

    Shape:
        logits ``(N, K)`` -> ``(N, K)``.
    """
    import torch

    with torch.no_grad():
        out = calibrator(logits, None) if calibrator is not None else logits / temperature
        return torch.softmax(out.float(), dim=1)


def record_of(probs: Any, names: list[str], top: int) -> dict[str, Any]:
    """The prediction numbers of one input's probabilities ``(K,)``."""
    values, index = probs.topk(min(top, probs.numel()))
    best = int(index[0])
    return {"class": names[best], "class_index": best, "confidence": float(values[0]),
            "top": [[names[int(i)], float(v)] for v, i in zip(values, index, strict=True)]}


def set_record(sets: Any, probs: Any, names: list[str], cs: Any) -> dict[str, Any]:
    """The set numbers of one input: its classes (most probable first), size, and the fit."""
    members = [int(i) for i in probs.argsort(descending=True, stable=True) if bool(sets[i])]
    return {"set": [names[i] for i in members], "set_size": len(members),
            "conformal": {"alpha": cs.alpha, "mode": cs.mode, "score": cs.score, "seed": cs.seed,
                          "threshold": cs.thresholds(), **cs.guarantee()}}


def predict_batch(run: Any, inputs: Any, temperature: float, calibrator: Any,
                  conformal: Any) -> tuple[Any, Any, Any]:
    """``(logits, calibrated probabilities, sets or None)`` of a batch of network inputs: the
    network in the run's precision, the calibration, the sets of the network's logits."""
    import torch

    from cals_seg.utils.precision import autocast_context

    with torch.no_grad(), autocast_context(run.device, run.precision):
        logits = run.model(inputs.to(run.device)).float()
    probs = calibrated_probs(logits, temperature, calibrator)
    sets = conformal.to(logits.device).sets(logits) if conformal is not None else None
    return logits, probs, sets


def image_inputs(run: Any) -> Any:
    """The transform of a new image (RGB uint8 ``(H, W, 3)``) into the network's input
    ``(3, S, S)``: the evaluation's (data.eval_size, centre crop of data.image_size,
    normalisation)."""
    from cals_seg.data.classification import classification_eval_transform

    d = run.config.data
    return classification_eval_transform(d.image_size, getattr(d, "eval_size", None))


def _main(args: argparse.Namespace) -> int:
    try:
        check_inputs_exist(args.inputs)  # a mistyped path: said before anything is created
        check_folder("--out", args.out, must_exist=False, writable=True)
        out_folder = OutputFolder(args.out, "predict_cls", inputs=args.inputs)
        spec = None
        if args.conformal is not None:
            from cals_seg.commands._conformal import parse_conformal
            from cals_seg.commands.eval_cls import check_conformal

            spec = parse_conformal(args.conformal)
            check_conformal(spec)
        run, temperature, calibrator = open_run(args)
        conformal = None
        if spec is not None:
            from cals_seg.commands._conformal import load_or_fit_conformal

            conformal = load_or_fit_conformal(run, spec, "classification")
        text = is_text_run(run)
        try:
            items = text_inputs(run, args) if text else image_files(args)
        except OSError as err:
            raise os_error(err, None, "list the inputs") from None
        out_folder.check_free([PREDICTIONS])
        out_folder.claim([PREDICTIONS])
    except USER_ERRORS as err:
        return report(err)
    common = {"calibrator": args.calibrator,
              "temperature": None if calibrator is not None else temperature,
              "precision": run.precision}
    failed: list[str] = []
    done = 0
    out = Path(args.out)
    names = list(run.class_names)
    with (out / PREDICTIONS).open("w") as log:
        for record, error in predictions(run, items, text, temperature, calibrator, conformal,
                                         args.top):
            if error is not None:
                print(f"error: {error}; " + ("stopping (--strict)." if args.strict
                                             else "skipped, going on."), file=sys.stderr)
                log.write(json.dumps(record) + "\n")
                if args.strict:
                    return 2
                failed.append(record["input"])
                continue
            log.write(json.dumps({**record, **common}) + "\n")
            done += 1
    how = f"calibrator {args.calibrator}" if args.calibrator else f"T = {temperature:.3f}"
    what = "document(s)" if text else "image(s)"
    print(f"wrote {done} prediction(s) of {what} to {out / PREDICTIONS} ({how}, "
          f"{run.device.type}, precision {run.precision}; {len(names)} classes)")
    if failed:
        print(f"error: {len(failed)} input(s) could not be used: "
              f"{', '.join(dict.fromkeys(failed))}", file=sys.stderr)
        return 1
    return 0


def image_files(args: argparse.Namespace) -> list[Path]:
    """The image files of the inputs (folders searched recursively).

    Raises:
        UserError: none found (the suffixes listed).
    """
    from cals_seg.evaluation.predict import IMAGE_SUFFIXES, collect_inputs

    files = collect_inputs(args.inputs)
    if not files:
        raise UserError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {args.inputs}; this is an "
                        "image run: give image files or folders.")
    return files


def text_inputs(run: Any, args: argparse.Namespace) -> list[tuple]:
    """The documents of the inputs (:func:`documents`).

    Raises:
        UserError: no file, or no document in the files.
    """
    files = text_files(args.inputs)
    if not files:
        raise UserError(f"no files in {args.inputs}; this is a text run: give text files or "
                        "folders (one document per file, or --lines).")
    docs = documents(files, args, run.config.data.text_strip)
    if not docs:
        raise UserError(f"no document in {args.inputs} (every line is empty); give text "
                        "files.")
    return docs


def predictions(run: Any, items: list, text: bool, temperature: float, calibrator: Any,
                conformal: Any, top: int) -> Any:
    """``(JSON record, error or None)`` per input, in order; the network runs on batches of
    ``eval.batch_size`` readable inputs."""
    import torch

    names = list(run.class_names)
    size = max(1, int(run.config.eval.batch_size))
    encode = text_encoder(run) if text else None
    transform = None if text else image_inputs(run)
    for start in range(0, len(items), size):
        chunk = items[start:start + size]
        ready, records = [], []
        for item in chunk:
            record, x, error = (_text_item(item, encode) if text else
                                _image_item(item, transform))
            records.append((record, error))
            if x is not None:
                ready.append((len(records) - 1, x))
        if ready:
            batch = torch.stack([x for _, x in ready])
            _, probs, sets = predict_batch(run, batch, temperature, calibrator, conformal)
            for j, (i, _) in enumerate(ready):
                record = {**records[i][0], **record_of(probs[j].cpu(), names, top)}
                if sets is not None:
                    record.update(set_record(sets[j].cpu(), probs[j].cpu(), names, conformal))
                records[i] = (record, None)
        yield from records


def _image_item(path: Path, transform: Any) -> tuple[dict, Any, str | None]:
    """``(record, network input or None, error or None)`` of one image file."""
    from cals_seg.evaluation.predict import UnreadableImageError, read_image

    try:
        image = read_image(path)
    except UnreadableImageError as err:
        return {"input": str(path), "error": str(err)}, None, str(err)
    return ({"input": str(path), "height": int(image.shape[0]), "width": int(image.shape[1])},
            transform(image), None)


def text_encoder(run: Any) -> Any:
    """``text -> (token ids (max_len,), tokens, unknown share)`` with the run's vocabulary."""
    from cals_seg.data.text import tokenize

    vocab, max_len = run.task.train_set.vocab, int(run.config.data.max_len)

    def encode(text: str) -> tuple[Any, int, float]:
        tokens = tokenize(text)[:max_len]
        unknown = sum(1 for t in tokens if t not in vocab.stoi)
        return vocab.encode(tokens, max_len), len(tokens), unknown / max(len(tokens), 1)

    return encode


def _text_item(item: tuple, encode: Any) -> tuple[dict, Any, str | None]:
    """``(record, network input or None, error or None)`` of one document."""
    path, line, text, error = item
    record: dict[str, Any] = {"input": str(path)}
    if line is not None:
        record["line"] = line
    if error is not None:
        return {**record, "error": error}, None, error
    ids, tokens, unknown = encode(text)
    if tokens == 0:
        where = f"{path}" + (f", line {line}" if line is not None else "")
        error = (f"{where}: holds no word (letters or digits) to classify; give a text with "
                 "words" + ("" if line is not None else
                            " (--posts drops a post's headers, up to its first blank line)"))
        return {**record, "error": error}, None, error
    return {**record, "tokens": tokens, "unknown": unknown}, ids, None


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
