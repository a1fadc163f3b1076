"""Post-hoc calibrators: identity at initialisation, recovery of planted mis-calibration against
independent float64 references, save / load, the argmax contract, and the one-pass evaluation."""

from __future__ import annotations

import argparse
import math
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cals_seg.contrib.boundary_conf_ts  # noqa: F401  (opt-in; tested with the built-ins)
from cals_seg.calibrators import (
    CALIBRATORS,
    build_calibrator,
    load_calibrator,
    save_calibrator,
)
from cals_seg.calibrators.boundary_ts import predicted_bands
from cals_seg.calibrators.ts import fit_temperature
from cals_seg.evaluation.engine import fit_calibrators, run_test_pass
from cals_seg.evaluation.stream import Inference
from cals_seg.metrics import BoundaryCalibrationMeter, CalibrationMeter, SegmentationMeter

VOID = 255


def batches_of(*tensors, size=2):
    """A zero-argument callable yielding the tensors in batches of ``size`` images."""
    n = tensors[0].shape[0]
    return lambda: (tuple(t[i:i + size] for t in tensors) for i in range(0, n, size))


def mean_nll(logits: torch.Tensor, target: torch.Tensor) -> float:
    return float(nn.functional.cross_entropy(logits.double(), target, ignore_index=VOID))


def structured(n=6, k=4, h=32, w=32, seed=0, scale=2.5, noise=0.8, blobs=6):
    """Calibrated logits ``z`` of blob-like class maps and labels drawn from ``softmax(z)``."""
    g = torch.Generator().manual_seed(seed)
    regions = torch.zeros(n, h, w, dtype=torch.int64)
    for i in range(n):
        for _ in range(blobs):
            c = int(torch.randint(0, k, (1,), generator=g))
            y0, x0 = (int(v) for v in torch.randint(0, h - 8, (2,), generator=g))
            dy, dx = (int(v) for v in torch.randint(6, max(h, w) // 2, (2,), generator=g))
            regions[i, y0:y0 + dy, x0:x0 + dx] = c
    z = scale * nn.functional.one_hot(regions, k).permute(0, 3, 1, 2).float()
    z = z + noise * torch.randn(n, k, h, w, generator=g)
    probs = z.softmax(dim=1).movedim(1, -1).reshape(-1, k)
    target = torch.multinomial(probs, 1, generator=g).view(n, h, w)
    target[:, :, :2] = VOID  # a void strip: excluded from every fit
    return z, target


# ----------------------------------------------------------------------------- the contract
@pytest.mark.parametrize("name", sorted(CALIBRATORS))
def test_identity_at_initialisation(name):
    cal = build_calibrator(name, 5)
    logits = 4 * torch.randn(2, 5, 12, 12)
    image = torch.randn(2, 3, 12, 12)
    out = cal(logits, image)
    assert out.shape == logits.shape
    torch.testing.assert_close(out.softmax(dim=1), logits.softmax(dim=1), atol=1e-6, rtol=0)


def test_changes_argmax_flags():
    assert {n: c.changes_argmax for n, c in CALIBRATORS.items()} == {
        "ts": False, "vector": True, "dirichlet": True, "lts": False, "selective": False,
        "boundary_ts": False, "cms_ap": False, "cms_op": False, "boundary_ts_fine": False,
        "boundary_ts_conf": False, "image_ts": False}
    assert {n for n, c in CALIBRATORS.items() if c.needs_image} == {"lts", "image_ts"}
    assert build_calibrator("lts", 3, use_image=False).needs_image is False


def test_bad_names_and_parameters():
    with pytest.raises(ValueError, match="valid names"):
        build_calibrator("platt", 3)
    with pytest.raises(ValueError, match="valid ones"):
        build_calibrator("dirichlet", 3, lamda=0.1)
    with pytest.raises(ValueError, match="bands"):
        build_calibrator("boundary_ts", 3, bands=(8, 3))
    with pytest.raises(ValueError, match="needs the image"):
        build_calibrator("lts", 3)(torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="3 classes"):
        build_calibrator("ts", 3)(torch.randn(1, 4, 8, 8))


# ----------------------------------------------------------------------------- ts
def test_ts_is_fit_temperature():
    z, target = structured(seed=1)
    logits = 3.0 * z
    cal = build_calibrator("ts", 4)
    cal.fit(batches_of(logits, target), ignore_index=VOID)
    want = fit_temperature(batches_of(logits, target), ignore_index=VOID)
    assert float(cal.temperature) == pytest.approx(want, rel=1e-6)
    assert float(cal.temperature) == pytest.approx(3.0, rel=0.05)


# ----------------------------------------------------------------------------- boundary_ts
def test_boundary_ts_recovers_planted_band_temperatures():
    """Calibrated logits scaled by a known factor per predicted band: each factor comes back
    within 5 %."""
    z, target = structured(n=24, h=64, w=64, seed=2, scale=3.0, noise=0.3, blobs=3)
    band = predicted_bands(z, (3.0, 8.0))
    planted = torch.tensor([2.5, 0.6, 1.6])
    logits = z * planted[band].unsqueeze(1)  # positive scale: same argmax, same bands
    assert torch.equal(predicted_bands(logits, (3.0, 8.0)), band)
    cal = build_calibrator("boundary_ts", 4)
    info = cal.fit(batches_of(logits, target, size=5), ignore_index=VOID)
    assert min(info["count_band"]) > 1000
    torch.testing.assert_close(cal.temperatures, planted, rtol=0.05, atol=0)
    # Undoing the planted scales restores the calibrated logits.
    torch.testing.assert_close(cal(logits), z, rtol=0.05, atol=0.05)


def test_boundary_ts_empty_band_gets_the_pooled_temperature():
    z, target = structured(n=4, h=16, w=16, seed=8)
    cal = build_calibrator("boundary_ts", 4, bands=(3.0, 100.0))
    with pytest.warns(UserWarning, match=r"band\(s\) \[2\]"):
        info = cal.fit(batches_of(2 * z, target), ignore_index=VOID)
    want = fit_temperature(batches_of(2 * z, target), ignore_index=VOID)
    assert info["count_band"][2] == 0
    assert float(cal.temperatures[2]) == pytest.approx(want, rel=1e-6)


def test_boundary_ts_bands_follow_the_prediction():
    """Two classes split at column 10: predicted distance bands by a brute-force loop."""
    logits = torch.zeros(1, 2, 6, 20)
    logits[:, 0, :, :10] = 1.0
    logits[:, 1, :, 10:] = 1.0
    got = predicted_bands(logits, (3.0, 8.0))[0]
    for j in range(20):
        d = min(abs(j - 9), abs(j - 10))  # boundary pixels: columns 9 and 10
        want = 0 if d < 3 else (1 if d < 8 else 2)
        assert bool((got[:, j] == want).all()), j


# ----------------------------------------------------------------------------- vector, dirichlet
def reference_fit(rows: np.ndarray, labels: np.ndarray, kind: str, lam=0.0, mu=0.0) -> float:
    """Float64 full-batch minimum of the objective by scipy's L-BFGS with exact gradients."""
    n, k = rows.shape
    logp = rows - rows.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    onehot = np.eye(k)[labels]

    def objective(theta):
        if kind == "vector":
            s, b = theta[:k], theta[k:]
            z = rows * s + b
        else:
            w, b = theta[: k * k].reshape(k, k), theta[k * k:]
            z = logp @ w.T + b
        z = z - z.max(1, keepdims=True)
        lse = np.log(np.exp(z).sum(1))
        p = np.exp(z - lse[:, None])
        f = (lse - z[np.arange(n), labels]).mean()
        dz = (p - onehot) / n
        if kind == "vector":
            return f, np.concatenate([(dz * rows).sum(0), dz.sum(0)])
        gw, gb = dz.T @ logp, dz.sum(0)
        off = w - np.diag(np.diag(w))
        f += lam / (k * (k - 1)) * (off**2).sum() + mu / k * (b**2).sum()
        gw = gw + 2 * lam / (k * (k - 1)) * off
        gb = gb + 2 * mu / k * b
        return f, np.concatenate([gw.ravel(), gb])

    theta0 = (np.concatenate([np.ones(k), np.zeros(k)]) if kind == "vector"
              else np.concatenate([np.eye(k).ravel(), np.zeros(k)]))
    res = minimize(objective, theta0, jac=True, method="L-BFGS-B",
                   options={"maxiter": 5000, "ftol": 1e-15, "gtol": 1e-12})
    return float(res.fun)


def planted_class_bias(seed: int):
    """Logits with a per-class scale and offset (what vector scaling undoes)."""
    z, target = structured(n=8, k=4, h=24, w=24, seed=seed)
    scale = torch.tensor([2.0, 0.7, 1.3, 3.0]).view(1, 4, 1, 1)
    bias = torch.tensor([0.5, -1.0, 0.0, 1.0]).view(1, 4, 1, 1)
    return z * scale + bias, target


def valid_np(logits, target):
    rows = logits.movedim(1, -1).reshape(-1, logits.shape[1]).double().numpy()
    labels = target.reshape(-1).numpy()
    keep = labels != VOID
    return rows[keep], labels[keep]


@pytest.mark.parametrize("name,params", [("vector", {}), ("dirichlet", {}),
                                         ("dirichlet", {"lam": 0.05, "mu": 0.02})])
def test_matrix_calibrators_reach_the_float64_reference(name, params):
    logits, target = planted_class_bias(seed=3)
    cal = build_calibrator(name, 4, **params)
    info = cal.fit(batches_of(logits, target, size=3), ignore_index=VOID)
    rows, labels = valid_np(logits, target)
    kind = "vector" if name == "vector" else "dirichlet"
    want = reference_fit(rows, labels, kind, params.get("lam", 1e-3) if kind != "vector" else 0,
                         params.get("mu", 1e-3) if kind != "vector" else 0)
    assert info["objective"] == pytest.approx(want, abs=1e-4)
    assert info["objective"] >= want - 1e-7  # the reference is the minimum
    # The saved float32 parameters give the same NLL (recomputed independently).
    nll = mean_nll(cal(logits), target)
    assert nll == pytest.approx(info["nll"], abs=1e-4)
    assert nll < mean_nll(logits, target) - 0.05


def test_vector_streaming_equals_one_batch():
    logits, target = planted_class_bias(seed=4)
    a, b = build_calibrator("vector", 4), build_calibrator("vector", 4)
    a.fit(batches_of(logits, target, size=8), ignore_index=VOID)
    b.fit(batches_of(logits, target, size=1), ignore_index=VOID)
    torch.testing.assert_close(a.scale, b.scale, atol=1e-4, rtol=0)
    torch.testing.assert_close(a.bias, b.bias, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- lts, selective
def test_lts_lowers_validation_nll_on_a_planted_case():
    """Over-confident (x4) where the image's first channel is 1, calibrated elsewhere: a
    per-pixel temperature from the image fixes what one temperature cannot."""
    z, target = structured(n=20, h=24, w=24, seed=5)
    image = torch.zeros(20, 3, 24, 24)
    image[:, 0, :, 12:] = 1.0
    logits = z * torch.where(image[:, :1] > 0, 4.0, 1.0)
    cal = build_calibrator("lts", 4, epochs=30, lr=0.05, patience=30)
    info = cal.fit(batches_of(logits, target, image, size=2), ignore_index=VOID)
    assert info["heldout_images"] == 4 and info["fit_images"] == 16
    before, after = mean_nll(logits, target), mean_nll(cal(logits, image).detach(), target)
    ts = build_calibrator("ts", 4)
    ts.fit(batches_of(logits, target), ignore_index=VOID)
    assert after < mean_nll(ts(logits), target) < before
    assert info["heldout_loss"][info["best_epoch"]] < info["heldout_loss"][0]
    # Argmax unchanged (a positive temperature per pixel).
    assert torch.equal(cal(logits, image).argmax(dim=1), logits.argmax(dim=1))


def test_selective_lowers_validation_nll_on_a_planted_case():
    """Pixels predicted as class 3 are always wrong and confident: the classifier learns to
    flag them and the fitted temperature flattens them."""
    g = torch.Generator().manual_seed(6)
    n, k = 20, 4
    logits = 3 * torch.randn(n, k, 16, 16, generator=g)
    target = logits.argmax(dim=1)
    wrong = target == 3
    target[wrong] = torch.randint(0, 3, (int(wrong.sum()),), generator=g)
    cal = build_calibrator("selective", k, epochs=20, lr=0.01, patience=20,
                           pixels_per_step=4096)
    info = cal.fit(batches_of(logits, target, size=4), ignore_index=VOID)
    assert info["temperature"] > 5
    flagged = cal.flagged(logits)
    assert float((flagged == wrong).float().mean()) > 0.95
    assert mean_nll(cal(logits), target) < 0.5 * mean_nll(logits, target)
    assert torch.equal(cal(logits).argmax(dim=1), logits.argmax(dim=1))


def test_holdout_needs_enough_images():
    logits, target = torch.randn(3, 3, 8, 8), torch.randint(0, 3, (3, 8, 8))
    with pytest.raises(ValueError, match="held out"):
        build_calibrator("selective", 3).fit(batches_of(logits, target), ignore_index=VOID)


# ----------------------------------------------------------------------------- save / load
# Short fits for the tests that check what is done with a fitted state (saved and loaded, one
# test pass), whatever it is: 2 epochs, 5 L-BFGS iterations (the fits themselves are checked
# above against references and planted cases).
SHORT_FITS = {"lts": {"epochs": 2}, "selective": {"epochs": 2}, "vector": {"max_iter": 5},
              "dirichlet": {"max_iter": 5}, "cms_ap": {"max_iter": 5},
              "cms_op": {"max_iter": 5}, "image_ts": {"max_iter": 5}}


@pytest.mark.parametrize("name", sorted(CALIBRATORS))
def test_save_load_round_trip(name, short_fits, tmp_path):
    """Each calibrator of :func:`short_fits`, saved and loaded, gives bitwise the same output
    on the test split's logits and images."""
    model, _, test, cals = short_fits
    cal = cals[name]
    image = torch.cat([x for x, _ in test])
    with torch.no_grad():
        logits = model(image)
    path = save_calibrator(cal, tmp_path / "calibrators" / f"{name}.pt")
    saved = torch.load(path, weights_only=True)
    assert saved["name"] == name and saved["params"] == cal.params
    back = load_calibrator(path)
    assert type(back) is type(cal) and back.params == cal.params
    training = cal.training  # the fixture's calibrator is left as it was
    with torch.no_grad():
        torch.testing.assert_close(back(logits, image), cal.eval()(logits, image), atol=0,
                                   rtol=0)
    cal.train(training)


def test_load_rejects_other_files(tmp_path):
    torch.save({"model": torch.zeros(1)}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not a saved calibrator"):
        load_calibrator(tmp_path / "x.pt")
    with pytest.raises(FileNotFoundError):
        load_calibrator(tmp_path / "missing.pt")


# ----------------------------------------------------------------------------- one pass
@pytest.fixture(scope="module")
def short_fits() -> tuple:
    """A 3 x 3 convolution (4 classes), a validation and a test loader of 16 x 16 images
    (labels: its argmax, 30% flipped, the first row void), and every calibrator fitted on
    validation with :data:`SHORT_FITS` through ``fit_calibrators`` (the engine's fit). Read
    only: the one-pass test evaluates them, the round trips save and load them."""
    torch.manual_seed(0)
    k = 4
    model = nn.Conv2d(3, k, 3, padding=1)
    model.weight.data *= 3

    def split(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 3, 16, 16, generator=g)
        with torch.no_grad():
            y = model(x).argmax(dim=1)
        flip = torch.rand(n, 16, 16, generator=g) < 0.3
        y[flip] = torch.randint(0, k, (int(flip.sum()),), generator=g)
        y[:, 0] = VOID
        return DataLoader(TensorDataset(x, y), batch_size=3)

    val, test = split(15, 1), split(6, 2)
    cals = {n: build_calibrator(n, k, **SHORT_FITS.get(n, {})) for n in CALIBRATORS}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "boundary_ts")  # an empty band on these small images
        fit_calibrators(cals, model, val, torch.device("cpu"), VOID)
    return model, val, test, cals


@pytest.mark.filterwarnings("ignore:boundary_ts")
def test_test_pass_evaluates_every_calibrator_in_one_pass(short_fits):
    """Fit every calibrator on a validation loader, evaluate all on a test loader in one pass:
    each calibrator's metrics equal meters fed its output directly; the argmax-keeping ones
    leave mIoU bit-identical."""
    model, _, test, cals = short_fits
    k = 4

    def meters():
        return {"calibration": CalibrationMeter(k, ignore_index=VOID),
                "segmentation": SegmentationMeter(k, VOID),
                "boundary": BoundaryCalibrationMeter(k, ignore_index=VOID)}

    passed = run_test_pass(Inference(model, torch.device("cpu")), test, meters, calibrators=cals)
    assert passed["post_ts"] is None
    out = {"uncalibrated": passed["pre_ts"], **passed["calibrators"]}
    assert set(out) == {"uncalibrated", *CALIBRATORS}
    for name, cal in cals.items():
        ref = meters()
        with torch.no_grad():
            for x, y in test:
                logits = model(x)
                calibrated = cal(logits, x)
                for key, m in ref.items():
                    m.update(logits if key == "segmentation" and not cal.changes_argmax
                             else calibrated, y)
        want = {kk: v for m in ref.values() for kk, v in m.compute().items()}
        for key in ("ece", "nll", "ece_band_weighted", "miou"):
            assert out[name][key] == pytest.approx(want[key], abs=1e-12), (name, key)
        if not cal.changes_argmax:
            assert out[name]["miou"] == out["uncalibrated"]["miou"]
            assert out[name]["confusion"] == out["uncalibrated"]["confusion"]
    assert math.isfinite(out["dirichlet"]["nll"])


# ----------------------------------------------------------------------------- eval_seg
@pytest.mark.filterwarnings("ignore:boundary_ts", "ignore:The validation NLL is minimal")
def test_eval_seg_fits_saves_and_evaluates_calibrators(tmp_path, capsys, monkeypatch):
    """eval_seg --calibrators: fitted on validation, saved in the run, evaluated in the same
    pass as pre/post-TS; the ts calibrator reproduces post-TS; a second call with the same
    parameters loads them; one with other parameters refits those they change, saying so."""
    import json
    from pathlib import Path

    from cals_seg.config.schema import load_config

    from .conftest import fake_run, figures_undrawn, load_tool

    setup = Path(__file__).resolve().parents[1] / "configs" / "synthetic_deeplabv3.yaml"
    sets = [f"data.root={tmp_path / 'data'}",
            "data.synthetic={num_train: 30, num_test: 4, image_size: 32}",
            "train.amp=none", "train.threads=1", "train.progress=false", "eval.num_maps=0",
            "model.encoder_name=tu-mobilenetv3_small_050",
            "model.params={encoder_output_stride: 16, decoder_channels: 16}"]
    cfg = load_config(setup, sets, "ce")
    run = fake_run(tmp_path / "run", cfg)
    names = ["ts", "boundary_ts", "dirichlet", "selective"]
    base = [str(setup), "--method", "ce", "--checkpoint", str(run / "checkpoint_best.pt"),
            "--out", str(tmp_path / "eval"), "--calibrators", *names, "--set", *sets,
            "--save-calibrators-to-run"]  # saved as the run's own fits (--out elsewhere)
    params = ["--calibrator-param", "selective.epochs=1", "dirichlet.max_iter=5"]
    with figures_undrawn():  # the numbers and files are checked, not how a figure looks
        assert load_tool("eval_seg").main(base + params) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    cals = metrics["calibrators"]
    assert list(cals) == names
    for name in names:
        assert cals[name].keys() == metrics["pre_ts"].keys()
        assert "ece_band_weighted" in cals[name]
        assert (run / "calibrators" / f"{name}.pt").is_file()
        assert metrics["calibrator_fits"][name]["loaded"] is False
    for key in ("ece", "nll", "ece_band_weighted"):
        assert cals["ts"][key] == pytest.approx(metrics["post_ts"][key], abs=1e-12)
    for name in ("ts", "boundary_ts", "selective"):
        assert cals[name]["miou"] == metrics["pre_ts"]["miou"]
    assert metrics["calibrator_fits"]["selective"]["heldout_images"] >= 1
    table = (tmp_path / "eval" / "calibrators.md").read_text()
    assert "band-weighted ECE" in table and "| boundary_ts |" in table
    assert (tmp_path / "eval" / "reliability_boundary_ts.png").is_file()
    # A second call loads the saved calibrators and gives the same numbers. The first call made
    # the figures; the next two only mark where they would be made (numbers and fits checked).
    capsys.readouterr()
    import cals_seg.commands.eval_seg as eval_seg_command

    def mark_figures(result: dict, out: Path, setup: str, split: str) -> None:
        (out / "clean_figures.marked").write_text(",".join(result.get("calibrators", {})))

    monkeypatch.setattr(eval_seg_command, "draw_clean_figures", mark_figures)
    (tmp_path / "eval" / "reliability_boundary_ts.png").unlink()
    assert load_tool("eval_seg").main(base + params) == 0
    again = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert all(again["calibrator_fits"][n]["loaded"] for n in names)
    assert (tmp_path / "eval" / "clean_figures.marked").read_text() == ",".join(names)
    assert not (tmp_path / "eval" / "reliability_boundary_ts.png").exists()
    assert again["calibrators"] == cals
    assert "refitting" not in capsys.readouterr().err
    record = again["calibrator_fits"]["dirichlet"]["fitted_for"]
    assert record["params"]["max_iter"] == 5 and record["split"] == "val"
    # Other parameters for dirichlet and selective (ts and boundary_ts keep theirs): those two
    # were fitted with others, so refit (still short fits: the record check is tested).
    other = ["--calibrator-param", "selective.epochs=2", "dirichlet.max_iter=4"]
    (tmp_path / "eval" / "clean_figures.marked").unlink()
    assert load_tool("eval_seg").main(base + other) == 0
    assert (tmp_path / "eval" / "clean_figures.marked").read_text() == ",".join(names)
    third = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert {n: third["calibrator_fits"][n]["loaded"] for n in names} == {
        "ts": True, "boundary_ts": True, "dirichlet": False, "selective": False}
    err = capsys.readouterr().err
    assert "dirichlet.pt was fitted for params=" in err and "max_iter" in err
    assert "selective.pt was fitted for params=" in err and "ts.pt was" not in err
    # No parameters given: the defaults are what the records are compared with (dirichlet's
    # max_iter 4 is not its default: refit, saying so; ts is loaded).
    two = base[:base.index("--calibrators") + 1] + ["ts", "dirichlet"] \
        + base[base.index("--calibrators") + 1 + len(names):]
    assert load_tool("eval_seg").main(two) == 0
    fourth = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert {n: fourth["calibrator_fits"][n]["loaded"] for n in ("ts", "dirichlet")} == {
        "ts": True, "dirichlet": False}
    err = capsys.readouterr().err
    assert "dirichlet.pt was fitted for params=" in err and "ts.pt was" not in err
    assert fourth["calibrator_fits"]["dirichlet"]["fitted_for"]["params"]["max_iter"] != 4


def test_eval_seg_calibrator_params():
    from .conftest import load_tool

    parse = load_tool("eval_seg").calibrator_params
    assert parse(["lts.epochs=20", "boundary_ts.bands=[2, 5.5]"]) == {
        "lts": {"epochs": 20}, "boundary_ts": {"bands": [2, 5.5]}}
    with pytest.raises(ValueError, match="NAME.KEY=VALUE"):
        parse(["lts=3"])
    with pytest.raises(ValueError, match="unknown calibrator 'platt'"):
        parse(["platt.a=1"])


def test_the_registry_is_filled_where_the_classes_are_defined():
    """Each built-in registers itself under its own ``name``, in the listed order; the commands
    read the registry at the call, so any registered name is a valid --calibrators."""
    from .conftest import load_tool

    core = [n for n, c in CALIBRATORS.items() if not c.__module__.startswith("cals_seg.contrib.")]
    assert core == ["ts", "vector", "dirichlet", "lts", "selective", "boundary_ts", "cms_ap",
                    "cms_op", "boundary_ts_fine", "image_ts"]
    assert CALIBRATORS["boundary_ts_conf"].__module__ == "cals_seg.contrib.boundary_conf_ts"
    assert all(cls.name == name for name, cls in CALIBRATORS.items())
    names = load_tool("eval_seg").calibrator_name
    assert [names(n) for n in CALIBRATORS] == list(CALIBRATORS)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown calibrator 'platt'"):
        names("platt")


# ----------------------------------------------------------------------------- DDP
def _ddp_data():
    z, target = structured(n=8, h=32, w=32, seed=9, scale=3.0, noise=0.4, blobs=3)
    return z * torch.tensor([2.0, 1.0, 0.8, 1.5]).view(1, 4, 1, 1), target


def _ddp_fit(rank: int, world: int, want: dict) -> None:
    logits, target = _ddp_data()
    shard = batches_of(logits[rank::world], target[rank::world])
    for name, state in want.items():
        cal = build_calibrator(name, 4)
        cal.fit(shard, ignore_index=VOID)
        for key, value in state.items():
            torch.testing.assert_close(cal.state_dict()[key], value, atol=2e-4, rtol=0,
                                       msg=f"{name}.{key}")


# Marked slow: rank 0 aborts intermittently here ("terminate called without an active
# exception", C++ std::terminate in the spawned process, about one run in three; the state
# comparisons pass whenever it does not); kept out of the default suite until that is
# understood (pytest -m slow tests/test_calibrators.py runs it). With a barrier before the
# teardown (tests/_dist.py): 1 abort in 145 runs on an idle 2-core AMD EPYC (before: 2 in 29).
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:boundary_ts")
def test_scaling_fits_agree_on_two_processes():
    """ts, vector, dirichlet and boundary_ts all-reduce their sums: two processes, each with
    half of the images, fit the calibrator of one process over all of them."""
    from ._dist import run_distributed

    logits, target = _ddp_data()
    want = {}
    for name in ("ts", "vector", "dirichlet", "boundary_ts"):
        cal = build_calibrator(name, 4)
        cal.fit(batches_of(logits, target), ignore_index=VOID)
        want[name] = {k: v.clone() for k, v in cal.state_dict().items()}
    run_distributed(_ddp_fit, 2, want, start_method="fork")
