"""The evaluation of a loaded run: one object, one typed plan in, one typed result out.

Every evaluation (``eval_seg``, ``eval_cls``, the trainer's final test, ``compare`` and the
study) is an :class:`Evaluator` running an :class:`EvalPlan`; :meth:`Evaluator.run` is the one
function that decides the order of the work, in phases:

1. **validation** -- the split's loader, whose logits the network computes once: every fit
   reads them from the logit cache (:mod:`cals_seg.evaluation.logit_cache`) the evaluator
   holds for its whole run;
2. **fits** -- the post-hoc calibrators (and those fitted under drift), each reused from the
   run's fit store when its :class:`~cals_seg.utils.fits.FitKey` is this use's, else fitted and
   saved where the plan says; the temperature; the conformal thresholds;
3. **test** -- ONE pass over the evaluated split feeding every view: the raw, the
   temperature-scaled and each calibrated logits' meters, the conformal sets, the entropy
   statistics of the shift flag;
4. **shift** -- one pass per corruption, with the same fits;

and writing the report is separate from all of them (:mod:`cals_seg.evaluation.reports`).

Segmentation and classification (images and text) run the same code: a classification batch is
``(N, K)`` logits against ``(N,)`` targets, the flattened case.

    plan = EvalPlan.from_config(run.config, split="test")
    result = Evaluator(run, plan).run()
    result.metrics["post_ts"]["ece"], result.metrics["calibrators"]["ts"]["ece"]
"""

from __future__ import annotations

import copy
import hashlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cals_seg.errors import UserError
from cals_seg.utils.fits import FitStore

# What the plan of an evaluation reads from a config's ``eval`` section.
PLAN_KEYS = ("calibrators", "calibrator_params", "conformal", "shift")


@dataclass(frozen=True)
class EvalPlan:
    """What one evaluation does.

    Attributes:
        split: the split evaluated (``train`` without augmentation, ``val``, ``test``).
        calibrators: post-hoc calibrators to fit on validation and evaluate, in order.
        calibrator_params: ``{name: {parameter: value}}``.
        conformal: the parsed conformal spec (``alpha``, ``mode`` list, ``score``,
            ``calibrator``, ``seed``, ``every``), or None.
        shift: the corruptions (:func:`cals_seg.data.corruptions.parse_shifts`), and
            ``shift_seed`` their seed.
        fit_shift: also fit each calibrator under the drift mixture (``NAME+drift``).
        refit: refit calibrators even when a saved fit is for this use.
        fits: where new fits are saved (None: the run's own store, ``<run>/calibrators``).
        fits_why: why they are not the run's own (None when they are), for the notice.
        temperature_scaling, n_bins: the post-TS view and the reliability bins.
        num_maps, maps_dir: set-size maps of the first images (segmentation).
        batch_size, workers, progress: the loaders and the progress bars.
        cache_bytes: the logit cache's budget (0: no cache).
        tool: the command the fit notices name (``predict_seg`` or ``predict_cls``).
    """

    split: str = "test"
    calibrators: tuple[str, ...] = ()
    calibrator_params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    conformal: Mapping[str, Any] | None = None
    shift: tuple[Any, ...] = ()
    shift_seed: int = 0
    fit_shift: bool = False
    refit: bool = False
    fits: Path | None = None
    fits_why: str | None = None
    temperature_scaling: bool = True
    n_bins: int = 15
    num_maps: int = 0
    maps_dir: Path | None = None
    batch_size: int = 1
    workers: int = 0
    progress: bool = False
    cache_bytes: int = 2 * 2**30
    tool: str = "predict_seg"

    @classmethod
    def from_config(cls, cfg: Any, **given: Any) -> EvalPlan:
        """The plan a config describes: its ``eval`` section (calibrators, their parameters,
        conformal sets, corruptions, bins, batch size), ``data.num_workers`` and
        ``train.progress``; ``given`` on top."""
        from cals_seg.data.corruptions import parse_shifts

        e = cfg.eval
        conformal = parse_conformal_spec(e.conformal) if e.conformal else None
        seed = int(e.shift_seed)
        plan = cls(calibrators=tuple(dict.fromkeys(e.calibrators or ())),
                   calibrator_params={k: dict(v) for k, v in (e.calibrator_params or {}).items()},
                   conformal=conformal,
                   shift=tuple(parse_shifts(list(e.shift), seed)) if e.shift else (),
                   shift_seed=seed, fit_shift=e.calibrator_fit_shift,
                   temperature_scaling=e.temperature_scaling,
                   n_bins=e.n_bins, num_maps=e.num_maps, batch_size=e.batch_size,
                   workers=cfg.data.num_workers, progress=cfg.train.progress)
        return replace(plan, **given)

    def record(self) -> dict[str, Any]:
        """What metrics.json records of the plan it ran (plain values)."""
        return {"split": self.split, "calibrators": list(self.calibrators),
                "calibrator_params": {k: dict(v) for k, v in self.calibrator_params.items()},
                "conformal": dict(self.conformal) if self.conformal else None,
                "shift": [str(getattr(s, "key", s)) for s in self.shift],
                "shift_seed": self.shift_seed, "fit_shift": self.fit_shift,
                "temperature_scaling": self.temperature_scaling, "n_bins": self.n_bins}


def parse_conformal_spec(value: Any, flag: str = "eval.conformal") -> dict[str, Any]:
    """``eval.conformal`` (a mapping, or ``KEY=VALUE`` words as ``--conformal`` takes them)
    parsed and checked as ``--conformal`` is (the messages name ``flag``)."""
    from cals_seg.evaluation.conformal_fit import parse_conformal

    if isinstance(value, Mapping):
        items = [f"{k}={','.join(map(str, v)) if isinstance(v, list | tuple) else v}"
                 for k, v in value.items() if v is not None]
    elif isinstance(value, str):
        items = value.split()
    else:
        items = [str(v) for v in value]
    return parse_conformal(items, flag)


def calibrator_keys(name: str) -> list[str]:
    """The parameters of registered calibrator ``name`` (its constructor's, as
    :func:`cals_seg.calibrators.build_calibrator` accepts them)."""
    import inspect

    from cals_seg.calibrators import CALIBRATORS

    cls = CALIBRATORS.lookup(name)
    return [p for p in inspect.signature(cls.__init__).parameters
            if p not in ("self", "num_classes")]


def check_calibrator_params(params: Mapping[str, Any], flag: str = "eval.calibrator_params"
                            ) -> None:
    """``{name: {parameter: value}}`` checked against the registry before any work: each
    calibrator registered, each parameter its constructor's, the values accepted by it.

    Raises:
        UserError: one line naming ``flag.NAME[.KEY]``, what is wrong and the valid choices.
    """
    from cals_seg.calibrators import CALIBRATORS, build_calibrator

    for name, given in params.items():
        if name not in CALIBRATORS:
            raise UserError(f"{flag}.{name}: unknown calibrator {name!r}; valid names are "
                            f"{sorted(CALIBRATORS)}.")
        if not isinstance(given, Mapping):
            raise UserError(f"{flag}.{name}: expected a mapping of parameters, got {given!r}; "
                            f"e.g. {{{name}: {{{(calibrator_keys(name) or ['key'])[0]}: ...}}}}.")
        valid = calibrator_keys(name)
        unknown = [k for k in given if k not in valid]
        if unknown:
            raise UserError(f"{flag}.{name}.{unknown[0]}: unknown parameter of calibrator "
                            f"{name}; valid keys are {valid}.")
        try:  # the values, before any network pass (K: a stand-in)
            build_calibrator(name, 2, **dict(given))
        except (TypeError, ValueError) as err:
            raise UserError(f"{flag}.{name}: {' '.join(str(err).split())}") from None


@dataclass
class EvalResult:
    """What an evaluation measured.

    Attributes:
        metrics: what ``metrics.json`` holds: ``pre_ts``, ``post_ts``, ``temperature``, and
            as planned ``calibrators``, ``calibrator_fits``, ``conformal``, ``shift``,
            ``entropy_flag``, ``calibrator_errors``, ``plan``, ...
        skipped: ``{calibrator: why it could not be fitted}``.
        notices: the lines said along the way (where each fit went).
    """

    metrics: dict[str, Any]
    skipped: dict[str, str] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)

    @property
    def pre_ts(self) -> dict[str, Any]:
        return self.metrics["pre_ts"]

    @property
    def post_ts(self) -> dict[str, Any] | None:
        return self.metrics.get("post_ts")

    @property
    def calibrators(self) -> dict[str, Any]:
        return self.metrics.get("calibrators") or {}

    @property
    def advice(self) -> str | None:
        """The under-confidence line for the user (fit a post-hoc calibrator, not a margin
        penalty), only when the network is under-confident and this evaluation fitted no
        calibrator; None otherwise."""
        regime = self.metrics.get("under_confident")
        return regime["advice"] if regime and not self.metrics.get("calibrator_fits") else None


class Evaluator:
    """Runs an :class:`EvalPlan` on a loaded run (:class:`cals_seg.runs.run.Run` with its task:
    ``task``, ``inference``, ``config``, ``fits``, ``checkpoint``, ``class_names``).

    Args:
        run: the loaded run.
        plan: what to do.
        say: where the one-line notices go (default: printed on the main process).
        on_clean: called with the clean metrics once the test pass is done, before the
            corrupted passes (e.g. to draw the clean figures meanwhile).
    """

    def __init__(self, run: Any, plan: EvalPlan, say: Callable[[str], None] | None = None,
                 on_clean: Callable[[dict[str, Any]], None] | None = None) -> None:
        from cals_seg.utils.distributed import is_main_process

        self.run_, self.plan = run, plan
        check_plan_for(run.family, plan.calibrators, plan.conformal, plan.shift)
        self.task, self.infer = run.task, run.inference
        self.main = is_main_process()
        self.say = say or (lambda line: print(line, flush=True) if self.main else None)
        self.store = FitStore(plan.fits) if plan.fits is not None else run.fits
        self.own = plan.fits is None or Path(plan.fits).resolve() == run.fits.folder.resolve()
        self.on_clean = on_clean

    # ------------------------------------------------------------------------ the order
    def run(self) -> EvalResult:
        """The evaluation, phase by phase (the module docstring): validation, fits, the test
        pass, the corruptions.

        Raises:
            UserError: a plan that cannot run; NaN or infinite logits (naming the run).
        """
        from cals_seg.evaluation.inference import NonFiniteLogitsError

        try:
            return self._run()
        except NonFiniteLogitsError as err:  # the network's fault: one line naming the run
            raise UserError(f"{self.run_.path}: {err}") from None

    def _run(self) -> EvalResult:
        from contextlib import nullcontext

        from cals_seg.evaluation.logit_cache import active_cache, logit_cache

        # the cache of the caller when it holds one for longer (eval_seg's maps read it too)
        held = nullcontext() if active_cache() is not None else logit_cache(self.plan.cache_bytes)
        with held:
            val, split = self.datasets()                                     # 1 validation
            val_loader = self.loader(val)
            calibrators, fits, skipped = self.fit_calibrators(val, val_loader)  # 2 fits
            temperature = self.temperature(val_loader, calibrators, fits)
            views = self.views(val, split, temperature)
            metrics = self.test(split, val_loader, calibrators, temperature, views)  # 3 test
            metrics.update(self.record(val_loader, fits, skipped))
            if self.on_clean is not None:
                self.on_clean(metrics)
            if self.plan.shift:                                              # 4 corruptions
                metrics["shift"], metrics["entropy_flag"] = self.shifted(
                    split, metrics, calibrators, views.get("entropy"))
            if views.get("sets") is not None:
                metrics["conformal"] = self.conformal_results(views["sets"].results())
            cache = active_cache()
            if cache is not None:  # images the network ran on, and those served from memory
                metrics["network_passes"] = dict(cache.stats)
        return EvalResult(metrics, skipped)

    # ------------------------------------------------------------------------ 1 validation
    def datasets(self) -> tuple[Any, Any]:
        """``(validation, the evaluated split)``; the training split without augmentation;
        classification samples carry ids that name them (:func:`with_ids`)."""
        task, split = self.task, self.plan.split
        val = task.val_set
        chosen = {"train": task.train_set, "val": task.val_set, "test": task.test_set}[split]
        if split == "train" and hasattr(chosen, "transform"):
            chosen = copy.copy(chosen)
            chosen.transform = task.val_set.transform
        if self.run_.family == "classification":
            root = self.run_.config.data.root
            val = with_ids(val, root)
            chosen = val if split == "val" else with_ids(chosen, root)
        return val, chosen

    def loader(self, dataset: Any) -> Any:
        """The evaluation loader of ``dataset`` (in order; sharded under torchrun)."""
        from cals_seg.evaluation.stream import evaluation_loader

        return evaluation_loader(dataset, self.plan.batch_size, self.plan.workers)

    # ------------------------------------------------------------------------ 2 fits
    def fit_calibrators(self, val: Any, val_loader: Any) -> tuple[dict, dict, dict[str, str]]:
        """Each planned calibrator: the run's own fit, read only, when it is for this use;
        else the plan's store's (reused or fitted and saved). One that cannot be fitted is
        named with its reason and left out. Then those fitted under drift."""
        from cals_seg.calibrators import calibrator_key
        from cals_seg.evaluation.engine import load_or_fit_calibrators
        from cals_seg.evaluation.inference import NonFiniteLogitsError

        plan, task, infer = self.plan, self.task, self.infer
        calibrators, fits, skipped = {}, {}, {}
        ids = getattr(val, "ids", None) or list(range(len(val)))
        for name in plan.calibrators:  # one that cannot be fitted is reported, not fatal
            try:  # reused only when fitted for this network, classes, images, params, precision
                key = calibrator_key(self.run_, name, plan.calibrator_params.get(name, {}), ids,
                                     precision=infer.amp, protocol=infer.protocol)
                found = None if plan.refit or self.own else self.own_fit(name, key)
                one, fit = found or load_or_fit_calibrators(
                    [name], self.store, task.num_classes, infer, val_loader, task.ignore_index,
                    plan.refit, plan.calibrator_params, keys={name: key})
            except NonFiniteLogitsError:  # the network's fault, not the calibrator's
                raise
            except (UserError, OSError, ValueError) as err:
                skipped[name] = calibrator_skip(name, err)
                print(f"error: calibrator {name} skipped: {skipped[name]}", file=sys.stderr,
                      flush=True)
                continue
            if not fit[name].get("loaded"):
                self.say(self.fit_notice(name, fit[name]["file"]))
            calibrators.update(one)
            fits.update(fit)
        if plan.fit_shift and calibrators:
            from cals_seg.evaluation.drift import drift_calibrators

            drifted = drift_calibrators(self.run_, list(calibrators), self.store.folder,
                                        plan.shift_seed, loader=self.loader, refit=plan.refit,
                                        params=plan.calibrator_params)
            calibrators, fits = calibrators | drifted[0], fits | drifted[1]
        return calibrators, fits, skipped

    def own_fit(self, name: str, key: Any) -> tuple[dict, dict] | None:
        """The run's own saved fit of calibrator ``name``, read (never written), when it was
        made for this use; None otherwise (a damaged one is said)."""
        from cals_seg.calibrators import load_calibrator

        own = self.run_.fits
        path = own.calibrator(name)
        cal, problem = own.reuse(path, key, lambda p: load_calibrator(
            p, self.infer.device, num_classes=self.task.num_classes))
        if problem is not None:
            if problem[0] == "file" and path.is_file():  # this evaluation fits its own
                print(f"notice: {path} {problem[1]}; not used (this evaluation fits its own)",
                      file=sys.stderr, flush=True)
            return None
        return {name: cal}, {name: {**cal.fit_info, "loaded": True, "file": str(path),
                                    "fitted_for": key.record()}}

    def fit_notice(self, name: str, file: str) -> str:
        """Where a new fit of calibrator ``name`` went: the run's own (used by predict and
        export), or this evaluation's, the run's own left as it is."""
        tool = self.plan.tool
        if self.own:
            return (f"calibrator {name}: fitted on the validation split and saved as the run's "
                    f"own fit, {file} ({tool} --calibrator {name} and export use it)")
        return (f"calibrator {name}: fitted on the validation split for this evaluation "
                f"({self.plan.fits_why}), saved to {file}; the run's own fit, "
                f"{self.run_.fits.calibrator(name)}, which {tool} and export use, is left as "
                "it is (--save-calibrators-to-run replaces it)")

    def temperature(self, val_loader: Any, calibrators: Mapping[str, Any],
                    fits: Mapping[str, Any]) -> float | None:
        """T of the post-TS view: the ``ts`` calibrator's when it was fitted here (the same
        fit, to the bit), else fitted on the validation logits; None without the view."""
        from cals_seg.evaluation.engine import fit_post_temperature

        if not self.plan.temperature_scaling:
            return None
        ts_fit = fits.get("ts", {}).get("temperature")
        if ts_fit is not None and "ts" in calibrators:
            return float(ts_fit)
        return fit_post_temperature(self.infer, val_loader, self.task.ignore_index)

    def views(self, val: Any, split: Any, temperature: float | None) -> dict[str, Any]:
        """The consumers of the test pass beside the meters: the conformal sets (fitted here on
        the held-out validation images) and the clean entropy statistics of the shift flag."""
        out: dict[str, Any] = {}
        plan = self.plan
        if plan.conformal:
            from cals_seg.evaluation.conformal_eval import conformal_sets

            maps = plan.maps_dir if self.run_.family == "segmentation" else None
            out["sets"] = conformal_sets(self.run_, dict(plan.conformal), val, split, maps,
                                         plan.num_maps if maps else 0, self.store.folder,
                                         loader=self.loader)
        if plan.shift:
            from cals_seg.evaluation.ood import MeanEntropy

            out["entropy"] = MeanEntropy(temperature or 1.0)  # the flag's clean rate
        return out

    # ------------------------------------------------------------------------ 3 test
    def test(self, split: Any, val_loader: Any, calibrators: Mapping[str, Any],
             temperature: float | None, views: Mapping[str, Any]) -> dict[str, Any]:
        """The one pass over the evaluated split feeding every view."""
        from cals_seg.evaluation.engine import calibrated_test

        plan, run = self.plan, self.run_
        result = calibrated_test(
            self.infer, self.task, val_loader, self.loader(split), plan.n_bins,
            plan.temperature_scaling, plan.progress, calibrators=calibrators,
            temperature=temperature, extra=[v for v in views.values() if v is not None])
        result.update(checkpoint=str(run.checkpoint), epoch=run.epoch, split=plan.split,
                      precision=self.infer.amp, family=run.family,
                      score_metric=run.score_metric)
        if run.family == "classification":
            result["class_names"] = list(run.class_names)
        return result

    def record(self, val_loader: Any, fits: Mapping[str, Any],
               skipped: Mapping[str, str]) -> dict[str, Any]:
        """The rest of metrics.json: the plan, the fits' summaries, the errors, the ensemble,
        and the confidence regime (:func:`advice`: the line for the user)."""
        from cals_seg.evaluation import confidence_regime

        out: dict[str, Any] = {"plan": self.plan.record()}
        regime = confidence_regime.measured_under_confidence(
            self.infer, val_loader, self.task.num_classes, self.task.ignore_index,
            str(self.run_.path), self.run_.family)
        if regime is not None:
            out[confidence_regime.KEY] = regime
        if fits:
            out["calibrator_fits"] = dict(fits)
        if self.run_.extra.get("ensemble"):
            out["ensemble"] = self.run_.extra["ensemble"]
        if skipped:
            out["calibrator_errors"] = dict(skipped)
        return out

    def conformal_results(self, results: dict[str, Any]) -> dict[str, Any]:
        """``{MODE: numbers}``; for classification without the spatial keys (bands, sizes,
        pixels) and with the first mode's summary at the top level."""
        if self.run_.family != "classification":
            return results
        out: dict[str, Any] = {}
        for mode, r in results.items():
            out[mode] = {k: v for k, v in r.items() if k not in SPATIAL_KEYS}
        first = next(iter(out.values()), {})
        for key in SUMMARY_KEYS:
            if key in first:
                out.setdefault(key, first[key])
        return out

    # ------------------------------------------------------------------------ 4 shift
    def shifted(self, split: Any, metrics: Mapping[str, Any], calibrators: Mapping[str, Any],
                entropy: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """One pass per corruption of the plan, with the clean evaluation's fits."""
        from cals_seg.evaluation.shift import shift_results

        return shift_results(self.run_, list(self.plan.shift), split, metrics, calibrators,
                             loader=self.loader, clean_entropies=entropy.all_values())


# Keys of the set meter that describe space (boundary bands, object sizes, pixels): left out
# of a classification evaluation.
SPATIAL_KEYS = ("pixels", "band_edges", "size_edges", "coverage_image_below_tau", "tau",
                *[f"{stat}_{region}" for stat in ("count", "coverage", "set_size", "multi")
                  for region in ("band", "size")])
# The numbers of the first mode repeated at metrics["conformal"] itself (classification).
SUMMARY_KEYS = ("mode", "alpha", "score", "threshold", "calibration_images", "guarantee",
                "needs_images", "coverage", "set_size", "coverage_class", "empty", "multi")


def calibrator_skip(name: str, err: Exception) -> str:
    """Why calibrator ``name`` could not be fitted, on one line, with the option to change."""
    reason = " ".join(str(err).split())
    if "holdout_every" in reason:
        reason += f" (--calibrator-param {name}.holdout_every=N, or more validation images)"
    return reason


# ----------------------------------------------------------------------------- classification
# The conformal modes of classification: marginal coverage, and per class (Mondrian). The
# image:TAU mode is risk for one label per input; band needs space.
MODES = ("risk", "class")


def flat_calibrators(num_classes: int = 3) -> list[str]:
    """The registered calibrators that apply to logits without space, ``(N, K)``, in registry
    order: those that need no image and whose new (identity) instance maps a ``(2, K)`` batch
    to a batch of its shape (the spatial ones, boundary bands or a temperature map, refuse it).
    A calibrator registered later is probed the same way."""
    import torch

    from cals_seg.calibrators import CALIBRATORS, build_calibrator

    logits = torch.randn(2, num_classes, generator=torch.Generator().manual_seed(0))
    names = []
    for name, cls in CALIBRATORS.items():
        if cls.needs_image:
            continue
        try:
            with torch.no_grad():
                out = build_calibrator(name, num_classes).eval()(logits, None)
        except (ValueError, RuntimeError, TypeError, IndexError, UserError):
            continue
        if tuple(out.shape) == tuple(logits.shape):
            names.append(name)
    return names


def check_flat(names: Sequence[str], flag: str) -> None:
    """Refuse, in one line listing the valid ones, a calibrator of ``names`` that needs space
    (a classification input has none).

    Raises:
        UserError: ``--calibrators lts: needs ...; for classification runs use one of [...]``.
    """
    names = [n for n in names if n is not None]
    valid = flat_calibrators() if names else []
    for name in names:
        if name not in valid:
            raise UserError(f"{flag} {name}: a spatial calibrator (it needs an image's pixels); "
                            f"for classification and text runs use one of {valid}.")


def check_conformal(spec: dict[str, Any]) -> None:
    """Refuse the conformal modes that need space, and a spatial calibrator before the sets.

    Raises:
        UserError: one line naming the mode and the valid ones.
    """
    for mode in spec["mode"]:
        if mode not in MODES:
            raise UserError(f"--conformal mode={mode}: for classification and text runs the "
                            f"modes are {list(MODES)} (risk: marginal coverage, class: per "
                            "class; one label per input leaves nothing for image:TAU or band).")
    check_flat([spec.get("calibrator")], "--conformal calibrator=")


def check_plan_for(family: str, calibrators: Sequence[str], conformal: Mapping[str, Any] | None,
                   shift: Sequence[Any], flag: str = "eval") -> None:
    """Refuse, before any work, a plan the task family cannot run: for classification and text,
    a calibrator that needs space, a conformal mode other than risk / class, any image
    corruption; under torchrun the calibrators that fit in one process only.

    Raises:
        UserError: one line naming the key (``flag.calibrators``, ...) and what is allowed.
    """
    from cals_seg.utils.distributed import is_distributed

    if family == "classification":
        check_flat(calibrators, f"{flag}.calibrators")
        if conformal:
            check_conformal(dict(conformal))
        if shift:
            raise UserError(f"{flag}.shift: image corruptions apply to segmentation runs; a "
                            "classification or text run is evaluated without them (remove the "
                            "key, or --shift).")
    if is_distributed() and {"lts", "selective"} & set(calibrators):
        raise UserError(f"{flag}.calibrators: lts and selective fit in one process only (without "
                        "torchrun); the others fit under torchrun too.")


# ----------------------------------------------------------------------------- sample ids
def sample_ids(dataset: Any, root: str | Path | None = None) -> list[str]:
    """An id per sample, in order, that names what the sample is: an image's path (relative to
    ``root``, the data root, when inside it), a text's digest (of its token ids: the same text
    and vocabulary give the same id), else its position. A fit records the digest of the ids it
    saw (:mod:`cals_seg.utils.fits`)."""
    import torch

    samples = getattr(dataset, "samples", None)
    if isinstance(samples, list) and samples and isinstance(samples[0], tuple | list):
        base = Path(root).resolve() if root is not None else None
        out = []
        for path, _ in samples:
            p = Path(path)
            try:
                out.append(p.resolve().relative_to(base).as_posix() if base else p.as_posix())
            except ValueError:
                out.append(p.as_posix())
        return out
    rows = getattr(dataset, "ids", None)
    if isinstance(rows, torch.Tensor) and rows.dim() == 2 and len(rows) == len(dataset):
        return [hashlib.blake2b(r.contiguous().numpy().tobytes(), digest_size=12).hexdigest()
                for r in rows.cpu()]
    if isinstance(rows, list | tuple) and len(rows) == len(dataset):
        return [str(i) for i in rows]
    return [str(i) for i in range(len(dataset))]


class SampleIds:
    """A dataset with :func:`sample_ids` as its ``ids`` (what the fits record of the samples
    they saw); items, length and every other attribute are the dataset's."""

    def __init__(self, dataset: Any, ids: Sequence[str]) -> None:
        self.dataset, self.ids = dataset, list(ids)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "ids") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def with_ids(dataset: Any, root: str | Path | None) -> SampleIds:
    """``dataset`` with its :func:`sample_ids`."""
    return SampleIds(dataset, sample_ids(dataset, root))


__all__ = ["MODES", "PLAN_KEYS", "EvalPlan", "EvalResult", "Evaluator", "SampleIds",
           "calibrator_keys", "calibrator_skip", "check_calibrator_params", "check_conformal",
           "check_flat", "check_plan_for", "flat_calibrators", "parse_conformal_spec",
           "sample_ids", "with_ids"]
