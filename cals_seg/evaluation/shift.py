"""Calibration under image corruptions: the same evaluation on a corrupted copy of the split.

The corruption is a data transform (:mod:`cals_seg.data.corruptions`): the split's images are
corrupted before its own transform, its masks are not touched, and the evaluation itself is the
clean one (``evaluate_once(dataset) -> metrics dict``, the caller's), so every entry of
``metrics.json["shift"]["NAME:SEVERITY"]`` is the same dictionary as the clean one::

    shifted = shift_evaluation(lambda ds: calibrated_test(..., loader(ds), ...), test_set,
                               parse_shifts(["fog:3", "all:5"], seed=0))
    print(shift_table(shifted))

A run's whole shift evaluation (``eval_seg --shift``) is :func:`shift_results`: every
corruption at the clean evaluation's temperature and calibrators, with the fraction of images
the entropy flag of :mod:`cals_seg.evaluation.ood` marks on each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cals_seg.data.corruptions import Corruption, corrupted_dataset
from cals_seg.evaluation.engine import run_test_pass
from cals_seg.evaluation.ood import QUANTILE, MeanEntropy, entropy_limit, flagged_rate
from cals_seg.evaluation.stream import evaluate

# (metric key, column title, in percent) of the shift tables.
SHIFT_COLUMNS = (
    ("ece", "ECE", True),
    ("ece_band_weighted", "band-weighted ECE", True),
    ("ece_boundary", "boundary ECE", True),
    ("ece_interior", "interior ECE", True),
    ("nll", "NLL", False),
    ("miou", "mIoU", True),
)


def metric(metrics: Mapping[str, Any], key: str) -> float | None:
    """``metrics[key]``; ``ece_boundary`` / ``ece_interior`` are the first / last entry of
    ``ece_band`` (the band nearest to / farthest from the boundaries). ``None`` when absent."""
    if key in ("ece_boundary", "ece_interior") and key not in metrics:
        bands = metrics.get("ece_band") or []
        value = (bands[0] if key == "ece_boundary" else bands[-1]) if bands else None
    else:
        value = metrics.get(key)
    return None if value is None else float(value)


def shift_evaluation(evaluate_once: Callable[[Any], dict[str, Any]], dataset: Any,
                     corruptions: Sequence[Corruption]) -> dict[str, dict[str, Any]]:
    """``{NAME:SEVERITY: evaluate_once(corrupted copy of dataset)}`` in the order given."""
    return {c.key: evaluate_once(corrupted_dataset(dataset, c)) for c in corruptions}


def rows_of(result: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The rows one evaluation holds: ``uncalibrated`` (pre-TS), ``ts (the run's T)``
    (post-TS) and each calibrator, each a metric dictionary."""
    rows: dict[str, Mapping[str, Any]] = {"uncalibrated": result["pre_ts"]}
    if result.get("post_ts"):
        rows["ts (the run's T)"] = result["post_ts"]
    rows.update(result.get("calibrators") or {})
    return rows


def severity_means(shift: Mapping[str, Mapping[str, Any]]
                   ) -> dict[int, dict[str, dict[str, float]]]:
    """``{severity: {row: {metric: mean over the corruptions evaluated at that severity}}}``."""
    groups: dict[int, list[Mapping[str, Any]]] = {}
    for key, result in shift.items():
        groups.setdefault(int(key.rpartition(":")[2]), []).append(result)
    out: dict[int, dict[str, dict[str, float]]] = {}
    for severity, results in sorted(groups.items()):
        per_row: dict[str, dict[str, float]] = {}
        for row in rows_of(results[0]):
            values = [rows_of(r).get(row) for r in results]
            if any(v is None for v in values):
                continue
            per_row[row] = {k: sum(metric(v, k) for v in values) / len(values)
                            for k, _, _ in SHIFT_COLUMNS
                            if all(metric(v, k) is not None for v in values)}
        out[severity] = per_row
    return out


def _cells(metrics: Mapping[str, Any]) -> list[str]:
    cells = []
    for key, _, percent in SHIFT_COLUMNS:
        value = metric(metrics, key)
        cells.append("-" if value is None else
                     f"{100 * value:.2f}" if percent else f"{value:.4f}")
    return cells


def shift_table(shift: Mapping[str, Mapping[str, Any]],
                clean: Mapping[str, Any] | None = None) -> str:
    """Markdown: one line per corruption and row (calibrator), then the mean over corruptions
    per severity; ``clean`` (the clean evaluation) first when given. Values in % except NLL."""
    head = ["corruption", "calibrator", *[title for _, title, _ in SHIFT_COLUMNS]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    blocks: list[tuple[str, Mapping[str, Any]]] = []
    if clean is not None:
        blocks.append(("clean", rows_of(clean)))
    blocks += [(key, rows_of(result)) for key, result in shift.items()]
    blocks += [(f"mean at severity {s}", rows)
               for s, rows in severity_means(shift).items()]
    for name, rows in blocks:
        for row, metrics in rows.items():
            lines.append("| " + " | ".join([name, row, *_cells(metrics)]) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# A run's evaluation under the corruptions (eval_seg --shift).
# --------------------------------------------------------------------------------------------


def fixed_test(run: Any, loader: Any, temperature: float | None,
               calibrators: Mapping[str, Any], extra: Sequence[Any] = ()) -> dict[str, Any]:
    """The metrics of ``calibrated_test`` with the temperature and calibrators already fitted:
    ``{"temperature", "pre_ts", "post_ts" (None without T), "calibrators"}`` (no
    ``calibrators`` key without calibrators); ``extra`` image consumers see the same pass."""
    n_bins = run.config.eval.n_bins
    out = run_test_pass(run.inference, loader, lambda: run.task.meters(n_bins, test=True),
                        temperature, calibrators, run.config.train.progress, "shift", extra)
    out["temperature"] = temperature if temperature is not None else 1.0
    if not calibrators:
        out.pop("calibrators", None)
    return out


def entropy_temperature(result: Mapping[str, Any]) -> float:
    """The temperature the entropy flag reads the logits at: the clean evaluation's post-TS
    ``T`` when it has one (``result``: :func:`~cals_seg.evaluation.engine.calibrated_test`'s),
    else 1."""
    return (result["temperature"] if result.get("post_ts") else None) or 1.0


def shift_results(run: Any, corruptions: Sequence[Corruption], split_set: Any,
                  result: Mapping[str, Any], calibrators: Mapping[str, Any], *,
                  loader: Callable[[Any], Any], clean_entropies: Sequence[float] | None = None
                  ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``({NAME:SEVERITY: metrics}, flags)``: :func:`fixed_test` of every corruption on
    ``split_set`` at the clean evaluation's T (``result``) with the fitted ``calibrators``, and
    the entropy flag of :mod:`cals_seg.evaluation.ood`: ``{"quantile", "limit_nats"`` (on the
    validation images), ``"temperature", "clean_rate", "rates": {NAME:SEVERITY: fraction
    flagged}}``. ``loader`` makes a dataset's evaluation loader, in order.

    ``clean_entropies``: the mean entropies of ``split_set``'s images at
    :func:`entropy_temperature`, when the clean test pass already collected them (a
    :class:`~cals_seg.evaluation.ood.MeanEntropy` among its consumers); None: one more pass."""
    temperature = result["temperature"] if result.get("post_ts") else None
    t = entropy_temperature(result)

    def entropies(dataset: Any) -> list[float]:
        ref = MeanEntropy(t)
        evaluate(run.model, loader(dataset), run.device, [], run.precision,
                 protocol=run.task.protocol, image_consumers=[ref])
        return ref.all_values()

    limit = entropy_limit(entropies(run.task.val_set), QUANTILE)
    clean = entropies(split_set) if clean_entropies is None else list(clean_entropies)
    flags: dict[str, Any] = {"quantile": QUANTILE, "limit_nats": limit, "temperature": t,
                             "clean_rate": flagged_rate(clean, limit), "rates": {}}

    def once(dataset: Any) -> dict[str, Any]:
        ref = MeanEntropy(t)
        metrics = fixed_test(run, loader(dataset), temperature, calibrators, [ref])
        flags["rates"][dataset.corruption.key] = flagged_rate(ref.all_values(), limit)
        return metrics

    shifted = shift_evaluation(once, split_set, corruptions)
    return shifted, flags


def shift_report(result: Mapping[str, Any]) -> str | None:
    """The table of ``result["shift"]`` after the clean rows (:func:`shift_table`), with the
    fractions of images the entropy flag marks (``result["entropy_flag"]``) under it; None
    without a shift evaluation."""
    if not result.get("shift"):
        return None
    table = shift_table(result["shift"], clean=result)
    flags = result.get("entropy_flag")
    if flags:
        rates = ", ".join(f"{k} {100 * v:.0f}%" for k, v in flags["rates"].items())
        table += (f"\nImages whose mean predictive entropy is above the validation's "
                  f"{100 * flags['quantile']:.0f}th percentile ({flags['limit_nats']:.4f} nats): "
                  f"clean {100 * flags['clean_rate']:.0f}%, {rates}.\n")
    return table


__all__ = ["SHIFT_COLUMNS", "entropy_temperature", "fixed_test", "metric", "rows_of",
           "severity_means", "shift_evaluation", "shift_report", "shift_results", "shift_table"]
