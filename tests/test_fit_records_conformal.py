"""Conformal fits know what they were fitted for, are validated when read back, say when their
guarantee is empty; ensembles keep their fits in their own output and count a network once by
content; ``compare R R`` is one row.

Every case goes through the commands (``eval_seg``, ``predict_seg``, ``export``, ``compare``)
on random-weight runs of the embedded synthetic set; the references are independent: the
threshold rules themselves for the number of images a guarantee needs, the hold-out mask for
the images ``every`` keeps, the digests of :mod:`cals_seg.utils.fits` for the records.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from ._commands_cheap import clean_figures_left_out, networks_built_once, seeded_networks
from .conftest import copy_run, load_tool, untrained_seg_run

ROOT = Path(__file__).resolve().parents[1]
# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn), eval_seg's
# clean ones not made, and a run's network built once for all the commands loading it
# (tests/_commands_cheap.py): this file checks numbers, messages and which fit files are written.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:.*temperature.json", "ignore:The validation NLL is minimal",
        "ignore:.*search boundary", "ignore:no far-from-validation check"),
    pytest.mark.usefixtures("undrawn_figures", "cheaper_commands"),
]


@pytest.fixture(scope="module")
def cheaper_commands():
    with networks_built_once(), clean_figures_left_out():
        yield

RECORD_KEYS = {"kind", "name", "network", "classes", "split", "ids", "params", "precision",
               "protocol", "seed", "after"}


def _run(tmp: Path, name: str, seed: int = 0, num_train: int = 30) -> Path:
    """A random-weight run of the synthetic setup (conftest.untrained_seg_run); ``num_train //
    5`` validation images (the data folder is shared by the runs of the same ``num_train``)."""
    with seeded_networks():
        return untrained_seg_run(tmp / name, tmp / f"data{num_train}", seed, [
            f"data.synthetic={{num_train: {num_train}, num_test: 2, image_size: 32}}"])


def _images(tmp: Path) -> Path:
    from PIL import Image

    folder = tmp / "images"
    if not folder.is_dir():
        folder.mkdir()
        rgb = np.random.default_rng(0).integers(0, 256, (29, 35, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(folder / "a.png")
    return folder


@contextlib.contextmanager
def _data_unreadable(run: Path) -> Iterator[None]:
    """The run's data folder replaced by a plain file (nothing can read or generate it)."""
    from cals_seg.config.schema import load_config

    root = Path(load_config(run / "config.yaml").data.root)
    away = root.with_name(root.name + ".away")
    root.rename(away)
    root.write_text("not a folder")
    try:
        yield
    finally:
        root.unlink()
        away.rename(root)


def _one_line_error(err: str) -> str:
    """The error line of a refused command: exactly one ``error:`` line, no traceback."""
    assert "Traceback" not in err
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def _predict(run: Path, tmp: Path, out: str, spec: list[str], capsys, *extra: str
             ) -> tuple[int, str, str]:
    capsys.readouterr()
    code = load_tool("predict_seg").main([str(run), str(_images(tmp)), "--out", str(tmp / out),
                                          "--conformal", *spec, "--no-progress",
                                          "--no-ood-check", *extra])
    got = capsys.readouterr()
    return code, got.out, got.err


# --------------------------------------------------------------------------------------------
# The number of images a guarantee needs, and how `every` is chosen.
# --------------------------------------------------------------------------------------------

ALPHAS = (0.01, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 1 / 3, 0.4, 0.5, 0.7, 0.9, 0.99)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_guarantee_images_is_where_the_rules_stop_giving_every_class(alpha):
    """guarantee_images(alpha) is the fewest images at which the quantile rule and the
    risk-control rule (with a loss of 0 everywhere: the most favourable data) can pick a
    threshold below "every class", found by running both rules on growing n."""
    from cals_seg.evaluation.conformal import crc_threshold, guarantee_images, quantile_threshold

    grid = 8
    first_quantile = next(n for n in range(1, 1000)
                          if quantile_threshold([n] + [0] * grid, alpha) < grid)
    first_risk = next(n for n in range(1, 1000) if crc_threshold([0] * (grid + 1), n, alpha) < grid)
    # and from the exact fraction: the smallest n with alpha (n + 1) >= 1
    exact = next(n for n in range(0, 1000) if Fraction(repr(alpha)) * (n + 1) >= 1)
    assert guarantee_images(alpha) == first_quantile == first_risk == exact


def test_guarantee_status_per_group():
    """Grouped modes: the groups below the count are named; the warning is one line with the
    count needed and the fixes; a larger alpha is offered only when it would be enough."""
    from cals_seg.evaluation.conformal import guarantee_images, guarantee_status

    rng = np.random.default_rng(0)
    for _ in range(50):
        alpha = float(rng.choice(ALPHAS))
        kind = str(rng.choice(["risk", "image", "class", "band"]))
        groups = 1 if kind in ("risk", "image") else int(rng.integers(2, 15))
        counts = rng.integers(0, 2 * guarantee_images(alpha) + 2, groups).tolist()
        status = guarantee_status(alpha, kind, counts)
        need = guarantee_images(alpha)
        short = [g for g, c in enumerate(counts) if c < need]
        assert status["guarantee"] == (not short) and status["needs_images"] == need
        if kind in ("class", "band"):
            assert status["groups_without_guarantee"] == short
        if short:
            w = status["warning"]
            assert "\n" not in w and f"needs {need}" in w and "validation images" in w
            fewest = min(counts[g] for g in short)
            if fewest:
                offered = float(w.split("a larger alpha (>= ")[1].split(")")[0])
                assert Fraction(repr(offered)) * (fewest + 1) >= 1  # enough, as written
            else:
                assert "larger alpha" not in w
        else:
            assert "warning" not in status


@pytest.mark.parametrize("alpha", (0.1, 0.2, 0.3, 0.5))
def test_every_is_chosen_from_what_the_holdout_keeps(alpha):
    """Without every: 1 without a calibrator (every validation image calibrates); with one the
    largest of 5..2 whose held-out images reach the count, else 2; counted with the hold-out
    mask itself."""
    from cals_seg.calibrators._base import holdout_mask
    from cals_seg.evaluation.conformal import guarantee_images
    from cals_seg.evaluation.conformal_fit import calibration_ids, choose_every

    need = guarantee_images(alpha)
    for m in range(0, 41):
        for calibrator in (None, "ts"):
            spec = {"alpha": alpha, "calibrator": calibrator, "every": None}
            allowed = [5, 4, 3, 2] if calibrator else [1]
            held = {e: int(holdout_mask(m, 0, e).sum()) for e in allowed}
            want = next((e for e in allowed if held[e] >= need), allowed[-1])
            every, note = choose_every(spec, m)
            assert every == want, (m, calibrator)
            assert (note is None) == (every in (5, 1))
            if note:
                assert f"every={every}" in note and f"{held[every]} of {m}" in note
            assert len(calibration_ids(list(range(m)), every)) == held[every]
            for given in (1, 3, 7):
                assert choose_every({**spec, "every": given}, m) == (given, None)


def test_conformal_arguments_are_refused_in_one_line(tmp_path, capsys):
    """Generated malformed --conformal values (other scripts' digits, spaces, empty, out of
    range, unknown names) each end in one line and a non-zero exit; valid ones parse."""
    from cals_seg.commands._conformal import parse_conformal
    from cals_seg.errors import UserError

    bad = {"alpha": ["٠.١", "0.1 ", " 0.1", "nan", "inf", "0", "1", "-0.1", "", "x", "1e400"],
           "every": ["0", "²", "٣", " 2", "2.0", "-1", "", "x", "+2"],
           "seed": ["-1", "²", "٣", "1.5", "", " 1"],
           "mode": ["wide", "image:", "image:0", "image:1.5", "rísk", ""],
           "score": ["rapz", ""], "calibrator": ["nope", ""]}
    items = [[f"alpha={v}"] if k == "alpha" else ["alpha=0.1", f"{k}={v}"]
             for k, vs in bad.items() for v in vs]
    items += [["alpha=0.1", "colour=red"], ["mode=risk"],  # unknown key; no alpha
              ["alpha=0.1", "calibrator=ts", "every=1"]]  # no image left for the calibrator
    for spec in items:
        with pytest.raises(UserError, match="--conformal") as err:
            parse_conformal(spec)
        assert "\n" not in str(err.value)
    assert parse_conformal(["0.1", "every=1", "seed=3"])["every"] == 1
    assert parse_conformal(["alpha=0.5"])["every"] is None
    run = _run(tmp_path, "r")
    for spec in (["alpha=0.1", "every=²"], ["alpha=0.1", "seed=-1"], ["alpha=٠.١"]):
        capsys.readouterr()
        assert load_tool("eval_seg").main([str(run), "--out", str(tmp_path / "e"),
                                           "--conformal", *spec]) != 0
        assert "--conformal" in _one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "e" / "metrics.json").exists()


# --------------------------------------------------------------------------------------------
# Records: a saved fit is used only for what it was fitted for.
# --------------------------------------------------------------------------------------------


def _changed(value):
    """A different value of the same JSON kind."""
    if isinstance(value, bool) or value is None:
        return "changed"
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, 1]
    return {**value, "changed": 1}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> Path:
    """A random-weight run (:func:`_run`, 6 validation images) with the conformal fits that
    eval_seg saved into it (``--save-calibrators-to-run --conformal alpha=0.3``, with seed=1,
    then with the default seed 0). Read only: a test that changes it works on a copy
    (conftest.copy_run), which reads the same data folder."""
    tmp = tmp_path_factory.mktemp("evaluated")
    run = _run(tmp, "r")
    for seed in (["seed=1"], []):
        assert load_tool("eval_seg").main([str(run), "--out", str(tmp / "e"),
                                           "--save-calibrators-to-run", "--conformal",
                                           "alpha=0.3", *seed]) == 0
    return run


def test_a_fit_is_used_only_for_what_it_was_fitted_for(tmp_path, capsys, evaluated):
    """eval_seg saves each fit with its record; predict_seg reuses it when every recorded
    field matches, refits it (data readable) or refuses in one line naming the file and the
    key (data unreadable) when any one differs; a seed=1 fit is never used for seed=0."""
    from cals_seg.config.schema import load_config
    from cals_seg.evaluation.conformal_fit import calibration_ids
    from cals_seg.tasks.segmentation import segmentation_splits
    from cals_seg.utils.fits import file_digest, ids_digest

    run = copy_run(evaluated, tmp_path)  # eval_seg's fits of seed 1 and seed 0
    folder = run / "calibrators"
    s0, s1 = folder / "conformal_risk_lac_a0.3_s0.json", folder / "conformal_risk_lac_a0.3_s1.json"
    saved = json.loads(s0.read_text())
    record = saved["fitted_for"]
    assert set(record) == RECORD_KEYS
    val = segmentation_splits(load_config(run / "config.yaml"))["val"]
    assert record["network"] == file_digest(run / "checkpoint_best.pt")
    assert record["params"]["every"] == 1 and record["seed"] == 0  # no calibrator: all of val
    assert record["classes"]["num_classes"] == 11 and record["kind"] == "conformal"
    assert record["name"] == "risk" and record["after"] == {"calibrator": None, "state": None}
    assert record["ids"] == ids_digest(calibration_ids(val, 1)) == ids_digest(
        saved["calibration_ids"])
    assert json.loads(s1.read_text())["fitted_for"]["seed"] == 1
    original = s0.read_text()

    # reused: a threshold written into the file (record intact) is the one predict_seg uses
    tampered = {**saved, "threshold_index": [saved["grid"]]}
    s0.write_text(json.dumps(tampered))
    code, out, _ = _predict(run, tmp_path, "p0", ["alpha=0.3"], capsys)
    assert code == 0 and "refitting" not in out
    sets = np.load(tmp_path / "p0" / "a_sets.npz")["sets"]
    assert sets.all()  # every class, as written
    s0.write_text(original)

    # every recorded field changed in turn: refit (data readable), the file's record restored
    for i, key in enumerate(sorted(record)):
        s0.write_text(json.dumps({**saved, "fitted_for": {**record, key: _changed(record[key])},
                                  "threshold_index": [saved["grid"]]}))
        code, out, _ = _predict(run, tmp_path, f"p{i + 1}", ["alpha=0.3"], capsys)
        assert code == 0 and "refitting" in out and key in out, (key, out)
        again = json.loads(s0.read_text())
        assert again["fitted_for"] == record and again["threshold_index"] == \
            saved["threshold_index"], key
    # a field added or taken away: refit too
    for variant in ({**record, "extra": 1}, {k: v for k, v in record.items() if k != "seed"}, {}):
        s0.write_text(json.dumps({**saved, "fitted_for": variant}))
        code, out, _ = _predict(run, tmp_path, "pv", ["alpha=0.3"], capsys)
        assert code == 0 and "refitting" in out
        assert json.loads(s0.read_text())["fitted_for"] == record

    # the seed=1 fit under seed=0's name: refit, never used
    shutil.copyfile(s1, s0)
    code, out, _ = _predict(run, tmp_path, "ps", ["alpha=0.3"], capsys)
    assert code == 0 and "seed=1" in out
    assert json.loads(s0.read_text())["fitted_for"]["seed"] == 0

    # without readable data: what can be checked is checked, the rest refused in one line
    with _data_unreadable(run):
        code, _, err = _predict(run, tmp_path, "pu", ["alpha=0.3"], capsys)
        assert code == 0, err  # the matching fit is used
        for key in sorted(record):
            if key in ("ids", "every"):  # they need the validation split to be checked
                continue
            s0.write_text(json.dumps({**saved, "fitted_for": {**record,
                                                              key: _changed(record[key])}}))
            code, _, err = _predict(run, tmp_path, f"pu{key}", ["alpha=0.3"], capsys)
            line = _one_line_error(err)
            assert code != 0 and str(s0) in line and key in line and "eval_seg" in line, key
        s0.write_text(original)
        code, _, err = _predict(run, tmp_path, "pue", ["alpha=0.3", "every=3"], capsys)
        line = _one_line_error(err)
        assert code != 0 and "every" in line and str(s0) in line
        s0.unlink()
        code, _, err = _predict(run, tmp_path, "pum", ["alpha=0.3"], capsys)
        assert code != 0 and "does not exist" in _one_line_error(err)
    s0.write_text(original)


BROKEN = {
    "truncated": lambda text, d: text[: len(text) // 2],
    "not json": lambda text, d: "abc",
    "a string": lambda text, d: '"abc"',
    "a list": lambda text, d: "[]",
    "null": lambda text, d: "null",
    "empty": lambda text, d: "",
    "grid 3": lambda text, d: {**d, "grid": 3},
    "grid 0": lambda text, d: {**d, "grid": 0},
    "grid 2^40": lambda text, d: {**d, "grid": 2**40},
    "grid true": lambda text, d: {**d, "grid": True},
    "index -7": lambda text, d: {**d, "threshold_index": [-7]},
    "index above grid": lambda text, d: {**d, "threshold_index": [d["grid"] + 1]},
    "index float": lambda text, d: {**d, "threshold_index": [1.5]},
    "two indices": lambda text, d: {**d, "threshold_index": [1, 2]},
    "index text": lambda text, d: {**d, "threshold_index": ["1"]},
    "5 classes": lambda text, d: {**d, "num_classes": 5},
    "alpha 1.5": lambda text, d: {**d, "alpha": 1.5},
    "alpha NaN": lambda text, d: text.replace('"alpha": 0.3', '"alpha": NaN'),
    "alpha text": lambda text, d: {**d, "alpha": "0.3"},
    "no alpha": lambda text, d: {k: v for k, v in d.items() if k != "alpha"},
    "mode wide": lambda text, d: {**d, "mode": "wide"},
    "score rapz": lambda text, d: {**d, "score": "rapz"},
    "seed -1": lambda text, d: {**d, "seed": -1},
    "bands down": lambda text, d: {**d, "bands": [8.0, 3.0]},
    "bands inf": lambda text, d: text.replace('"bands": [\n  3.0', '"bands": [\n  Infinity'),
    "images -1": lambda text, d: {**d, "calibration_images": -1},
    "record text": lambda text, d: {**d, "fitted_for": "x"},
    "groups missing": lambda text, d: {k: v for k, v in d.items()
                                       if k != "calibration_images_group"},
}


def test_saved_fits_are_validated_like_a_config(tmp_path, capsys, evaluated):
    """Every broken fit file ends predict_seg (and export) with one line naming the file and
    the refit command, a non-zero exit, no traceback and no output, when the validation images
    cannot be read to refit it; when they can, it is refitted with a line naming it."""
    from cals_seg.config.schema import load_config
    from cals_seg.runs import run as runs_run

    run = copy_run(evaluated, tmp_path)  # eval_seg --save-calibrators-to-run --conformal 0.3
    path = run / "calibrators" / "conformal_risk_lac_a0.3_s0.json"
    text = path.read_text()
    d = json.loads(text)
    path.write_text("{")  # damaged, the data readable: refitted, the run loaded once
    loads = []
    with pytest.MonkeyPatch.context() as patch:
        load = runs_run.load_run
        patch.setattr(runs_run, "load_run",
                      lambda *args, **kwargs: loads.append(args) or load(*args, **kwargs))
        code, out, err = _predict(run, tmp_path, "remade", ["alpha=0.3"], capsys)
    assert code == 0 and path.name in out and "refitting" in out, err
    assert len(loads) == 1  # the refit builds the run's task, it does not load the run again
    assert json.loads(path.read_text())["threshold"] == d["threshold"]
    data = Path(load_config(run / "config.yaml").data.root)
    away = data.with_name(data.name + ".away")
    data.rename(away)  # the validation images cannot be read: refused
    try:
        _each_broken_fit_refused(run, path, text, d, tmp_path, capsys)
    finally:
        away.rename(data)
    path.write_text(text)
    code, _, err = _predict(run, tmp_path, "ok", ["alpha=0.3"], capsys)
    assert code == 0, err


def _each_broken_fit_refused(run: Path, path: Path, text: str, d: dict, tmp_path: Path,
                             capsys) -> None:
    """Each damage of :data:`BROKEN` written into ``path`` (the validation images away):
    predict_seg refused in one line, and export too for four of them."""
    for i, (name, make) in enumerate(BROKEN.items()):
        broken = make(text, d)
        if name in ("alpha NaN", "bands inf"):
            assert broken != text, name  # the replacement found its place
        path.write_text(broken if isinstance(broken, str) else json.dumps(broken))
        code, _, err = _predict(run, tmp_path, f"p{i}", ["alpha=0.3"], capsys)
        line = _one_line_error(err)
        assert code != 0 and str(path) in line and "eval_seg" in line, (name, line)
        assert not (tmp_path / f"p{i}" / "a_sets.npz").exists()
        if name in ("grid 3", "index -7", "5 classes", "truncated"):
            capsys.readouterr()
            assert load_tool("export").main([str(run), "--format", "pt2", "--out",
                                             str(tmp_path / f"m{i}.pt2"), "--conformal",
                                             "alpha=0.3"]) != 0, name
            line = _one_line_error(capsys.readouterr().err)
            assert str(path) in line and "eval_seg" in line
            assert not (tmp_path / f"m{i}.pt2").exists()


# --------------------------------------------------------------------------------------------
# Empty guarantees are said: metrics.json, conformal.md, stderr, predict_seg's output.
# --------------------------------------------------------------------------------------------


def test_empty_guarantees_are_announced(tmp_path, capsys):
    """2 validation images at alpha = 0.1 (9 needed): every one calibrates, guarantee false
    with the count and the fix in metrics.json, the table and stderr (once per mode), and in
    predict_seg's stderr line and JSON lines. Every given explicitly is kept, and every=1 is
    offered as the fix; with enough images the guarantee holds."""
    small = _run(tmp_path, "small", num_train=10)
    capsys.readouterr()
    assert load_tool("eval_seg").main([str(small), "--out", str(tmp_path / "e"), "--conformal",
                                       "alpha=0.1", "mode=risk,class,image:0.9"]) == 0
    got = capsys.readouterr()
    metrics = json.loads((tmp_path / "e" / "metrics.json").read_text())["conformal"]
    table = (tmp_path / "e" / "conformal.md").read_text()
    for mode, r in metrics.items():
        assert r["guarantee"] is False and r["needs_images"] == 9 and r["every"] == 1
        assert r["calibration_images"] == 2
        assert "\n" not in r["warning"] and "needs 9" in r["warning"]
        assert got.err.count(f"--conformal {mode}: {r['warning']}") == 1, mode
        assert f"- {mode}: {r['warning']}" in table
    assert table.count("NO: needs 9") == 3
    assert metrics["risk"]["set_size"] == 11  # every set holds every class: said, not silent

    code, out, err = _predict(small, tmp_path, "p", ["alpha=0.1"], capsys)
    assert code == 0
    warnings = [x for x in err.splitlines() if "no guarantee" in x]
    assert len(warnings) == 1 and "needs 9" in warnings[0]
    line = json.loads((tmp_path / "p" / "predictions.jsonl").read_text().splitlines()[0])
    assert line["conformal"]["guarantee"] is False and line["conformal"]["needs_images"] == 9

    run = _run(tmp_path, "r")  # 6 validation images
    for spec, every, ok in ((["alpha=0.3", "every=5"], 5, False),
                            (["alpha=0.3"], 1, True), (["alpha=0.3", "every=1"], 1, True),
                            (["alpha=0.1"], 1, False)):
        capsys.readouterr()
        assert load_tool("eval_seg").main([str(run), "--out", str(tmp_path / "e6"),
                                           "--conformal", *spec]) == 0
        r = json.loads((tmp_path / "e6" / "metrics.json").read_text())["conformal"]["risk"]
        assert r["every"] == every and r["guarantee"] is ok
        assert r["calibration_images"] == 6 // every
        if not ok and every > 1:
            assert "every=1" in r["warning"]


@pytest.mark.parametrize("num_train", (5, 10))
def test_a_calibrator_on_one_or_two_validation_images_is_one_line(tmp_path, capsys, num_train):
    run = _run(tmp_path, "r", num_train=num_train)
    for calibrator in ("lts", "ts"):
        capsys.readouterr()
        code = load_tool("eval_seg").main([str(run), "--out", str(tmp_path / "e"),
                                           "--conformal", "alpha=0.1",
                                           f"calibrator={calibrator}"])
        err = capsys.readouterr().err
        if calibrator == "lts":
            assert code != 0
            assert f"calibrator={calibrator}" in _one_line_error(err)
        else:  # ts fits on one image; the empty guarantee is said
            assert code == 0 and "no guarantee" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------
# Ensembles: their fits in their own output; a network counted once, by content.
# --------------------------------------------------------------------------------------------


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_ensemble_fits_live_in_its_output(tmp_path, capsys):
    from cals_seg.utils.fits import members_digest

    eval_seg = load_tool("eval_seg")
    m1, m2, m3 = (_run(tmp_path, f"m{i}", seed=i) for i in (1, 2, 3))
    capsys.readouterr()
    assert eval_seg.main([str(m1), str(m2), "--ensemble", "--conformal", "alpha=0.3"]) != 0
    assert "--out" in _one_line_error(capsys.readouterr().err)
    # M1's own fits
    assert eval_seg.main([str(m1), "--out", str(tmp_path / "own"), "--calibrators", "ts",
                          "--conformal", "alpha=0.3", "--save-calibrators-to-run"]) == 0
    own = _tree(m1 / "calibrators")
    assert "ts.pt" in own and "conformal_risk_lac_a0.3_s0.json" in own

    def ensemble(members, out):
        assert eval_seg.main([*map(str, members), "--ensemble", "--out", str(out),
                              "--calibrators", "ts", "--conformal", "alpha=0.3"]) == 0
        digest = members_digest([m / "checkpoint_best.pt" for m in members])
        folder = out / "calibrators" / f"ensemble_{digest[:16]}"
        fit = json.loads((folder / "conformal_risk_lac_a0.3_s0.json").read_text())
        assert fit["fitted_for"]["network"] == digest
        assert (folder / "ts.pt").is_file()
        return folder

    a = ensemble([m1, m2], tmp_path / "E")
    assert _tree(m1 / "calibrators") == own  # nothing of the ensemble in a member's folder
    b = ensemble([m1, m3], tmp_path / "E")  # another ensemble, the same --out: its own fits,
    # and the folder holds one evaluation: the earlier one's fits are removed (its manifest's)
    assert a != b and not (a / "ts.pt").exists()
    assert ensemble([m2, m1], tmp_path / "E") == a  # the same members in another order
    # --out M1: M1's own ts.pt and conformal fit are neither used nor replaced
    inside = ensemble([m1, m2], m1)
    assert inside.parent == m1 / "calibrators"
    assert {k: v for k, v in _tree(m1 / "calibrators").items() if "ensemble_" not in k} == own
    metrics = json.loads((m1 / "metrics.json").read_text())
    assert metrics["calibrator_fits"]["ts"]["loaded"] is False

    # a byte copy of a member is the same network: refused, both paths named
    copy = tmp_path / "copy_of_m1"
    shutil.copytree(m1, copy, ignore=shutil.ignore_patterns("calibrators", "eval_*"))
    capsys.readouterr()
    assert eval_seg.main([str(m1), str(copy), "--ensemble", "--out", str(tmp_path / "E2")]) != 0
    line = _one_line_error(capsys.readouterr().err)
    assert "same network" in line and str(m1.resolve()) in line and str(copy.resolve()) in line
    assert not (tmp_path / "E2" / "metrics.json").exists()


def test_compare_counts_a_run_once(tmp_path, capsys):
    """compare R R (spelt two ways, through a link, or a byte copy) gives one row."""
    run = _run(tmp_path, "r")
    copy = tmp_path / "elsewhere" / "r"
    shutil.copytree(run, copy)
    (tmp_path / "link").symlink_to(tmp_path)
    spelt = [run, tmp_path / "link" / "r", Path(str(run) + "/../r"), copy]
    capsys.readouterr()
    out = tmp_path / "cmp"
    assert load_tool("compare").main([*map(str, spelt), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("is the same run as") == 3
    rows = [r for r in (out / "results.csv").read_text().splitlines()[1:] if r.strip()]
    assert len(rows) == 1
