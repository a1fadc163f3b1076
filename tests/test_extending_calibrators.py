"""A calibrator added from outside the package: defined and registered here (no package file
edited), it is fitted, saved, evaluated and applied by the real user paths, ``eval_seg RUN
--calibrators NAME`` and ``predict_seg RUN --calibrator NAME``, with the numbers of a reference
computed here.

The calibrator is a temperature per class, ``forward(l)_k = l_k / T_k`` with ``T_k =
exp(a_k)``, fitted with the base's full-batch L-BFGS loop (:func:`lbfgs_fit`) on the mean
validation NLL ``(1 / |V|) sum_{i in V} [logsumexp_k(l_ik / T_k) - l_{i,y_i} / T_{y_i}]`` plus
``lam |a|^2`` (a class that is never the label would otherwise send its ``T_k`` to 0 or inf).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.optimize import minimize
from scipy.special import logsumexp
from torch import Tensor

from cals_seg.calibrators import CALIBRATORS, load_calibrator
from cals_seg.calibrators._base import Batches, Calibrator, iterate, lbfgs_fit, summed_nll
from cals_seg.config.schema import load_config
from cals_seg.tasks.segmentation import build_model

from .conftest import fake_run, load_tool
from .test_predict_seg import MEAN, STD, STEP, _lines, _read16

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")

NAME = "class_ts"
SETUP = Path(__file__).resolve().parents[1] / "configs" / "synthetic_deeplabv3.yaml"
# The validation batches every fit of the test calibrator saw (logits, target), for the reference.
SEEN: list[tuple[Tensor, Tensor]] = []


class PerClassTemperature(Calibrator):
    """A temperature per class (buffer ``temperatures`` ``(K,)``, 1.0 until fitted).

    Shape:
        - logits: ``(N, K, *S)`` -> same shape.
    """

    name = NAME
    changes_argmax = True

    temperatures: Tensor

    def __init__(self, num_classes: int, lam: float = 0.01, max_iter: int = 100) -> None:
        super().__init__(num_classes, lam=lam, max_iter=max_iter)
        self.register_buffer("temperatures", torch.ones(num_classes))

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        log_t = torch.zeros(self.num_classes, dtype=torch.float64, requires_grad=True)
        info = lbfgs_fit([log_t], lambda rows, labels: summed_nll(rows / log_t.exp(), labels),
                         lambda: self.params["lam"] * log_t.pow(2).sum(), batches,
                         ignore_index, self.params["max_iter"])
        self.temperatures.copy_(log_t.detach().exp())
        SEEN[:] = [(lg.detach().double().cpu(), y.cpu()) for lg, y, _ in iterate(batches)]
        self.fit_info = info
        return info

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self.check_input(logits, image)
        shape = (1, -1) + (1,) * (logits.dim() - 2)
        return logits / self.temperatures.view(shape).to(logits.dtype)


@pytest.fixture
def registered():
    """``class_ts`` registered through the public decorator for one test, removed at teardown."""
    list(CALIBRATORS)  # the built-ins discovered first: the new one comes after them
    CALIBRATORS.register(NAME)(PerClassTemperature)
    SEEN.clear()
    yield PerClassTemperature
    CALIBRATORS.unregister(NAME)
    SEEN.clear()


def _reference_temperatures(seen: list[tuple[Tensor, Tensor]], ignore_index: int,
                            lam: float = 0.01) -> np.ndarray:
    """The per-class temperatures minimising ``mean validation NLL + lam |log T|^2``, by
    scipy's L-BFGS-B on ``a = log T`` with the analytic gradient, in float64 numpy."""
    rows = np.concatenate([lg.movedim(1, -1).reshape(-1, lg.shape[1]).numpy() for lg, _ in seen])
    labels = np.concatenate([y.reshape(-1).numpy() for _, y in seen]).astype(np.int64)
    keep = labels != ignore_index
    rows, labels = rows[keep], labels[keep]
    n, k = rows.shape

    def objective(a: np.ndarray) -> tuple[float, np.ndarray]:
        z = rows * np.exp(-a)
        lse = logsumexp(z, axis=1)
        p = np.exp(z - lse[:, None])
        value = (lse - z[np.arange(n), labels]).mean() + lam * (a ** 2).sum()
        onehot = np.eye(k)[labels]
        grad = -((p - onehot) * z).sum(axis=0) / n + 2 * lam * a  # d z_ik / d a_k = -z_ik
        return float(value), grad

    result = minimize(objective, np.zeros(k), jac=True, method="L-BFGS-B",
                      options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 1000})
    return np.exp(result.x)


@pytest.mark.filterwarnings("ignore:class_ts")
def test_a_calibrator_registered_outside_the_package_runs_through_the_tools(
        registered, tmp_path):
    assert list(CALIBRATORS)[-1] == NAME and CALIBRATORS[NAME] is PerClassTemperature
    cfg = load_config(SETUP, [f"data.root={tmp_path / 'data'}",
                              "data.synthetic={num_train: 30, num_test: 4, image_size: 32}",
                              "train.amp=none", "train.threads=1", "train.device=cpu",
                              "train.progress=false", "eval.num_maps=0",
                              "model.encoder_name=tu-mobilenetv3_small_050",
                              "model.params={encoder_output_stride: 16, decoder_channels: 16}"],
                      "ce")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # a head that predicts several classes with spread-out logits
        model.segmentation_head[0].weight.normal_(0, 3)
        model.segmentation_head[0].bias.normal_(0, 1)
    run = fake_run(tmp_path / "run", cfg, model=model, config=True)

    # eval_seg RUN --calibrators class_ts: fitted on validation, saved, evaluated.
    out = tmp_path / "eval"
    assert load_tool("eval_seg").main([str(run), "--out", str(out), "--calibrators", NAME,
                                       "--save-calibrators-to-run"]) == 0  # the run's own fit
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics["calibrators"]) == [NAME]
    assert metrics["calibrators"][NAME].keys() == metrics["pre_ts"].keys()
    assert metrics["calibrator_fits"][NAME]["loaded"] is False
    cal = load_calibrator(run / "calibrators" / f"{NAME}.pt")
    assert type(cal) is PerClassTemperature and cal.fitted_for["name"] == NAME
    assert SEEN, "eval_seg did not fit the registered calibrator"
    want = _reference_temperatures(SEEN, cfg.data.ignore_index)
    got = cal.temperatures.double().numpy()
    assert np.abs(want - 1).max() > 0.05  # the fit moved: the comparison compares something
    np.testing.assert_allclose(got, want, rtol=2e-3)

    # predict_seg RUN --calibrator class_ts: the saved confidence is max softmax(l_k / T_k).
    pixels = np.zeros((48, 64, 3), dtype=np.uint8)
    pixels[8:36, 6:30] = 230
    pixels[:, 44:] = 120
    Image.fromarray(pixels).save(tmp_path / "a.png")
    pred = tmp_path / "pred"
    assert load_tool("predict_seg").main([str(run), str(tmp_path / "a.png"), "--out", str(pred),
                                          "--no-progress", "--calibrator", NAME]) == 0
    x = torch.from_numpy(((pixels / 255 - MEAN) / STD).astype(np.float32)).permute(2, 0, 1)[None]
    with torch.no_grad():
        logits = model(x)[0]
    t = torch.from_numpy(got).float().view(-1, 1, 1)
    conf = torch.softmax(logits / t, dim=0).max(dim=0).values.numpy()
    assert np.abs(_read16(pred / "a_confidence.png") - conf).max() <= 2 * STEP
    plain = torch.softmax(logits, dim=0).max(dim=0).values.numpy()
    assert np.abs(plain - conf).max() > 0.01  # the check can tell them apart
    assert _lines(pred)[0]["calibrator"] == NAME


def test_the_test_calibrator_does_not_stay_registered():
    """The fixture's registration ends with its test: the other tests see the built-ins."""
    assert NAME not in CALIBRATORS
    core = [n for n in CALIBRATORS if n not in CALIBRATORS.beside]  # contrib may be imported
    assert core[-1] == "image_ts"


def test_an_unregistered_name_is_refused_by_the_tools(tmp_path, capsys):
    """Without the registration, the commands refuse the name, listing the registered ones."""
    with pytest.raises(SystemExit) as exc:
        load_tool("eval_seg").parse_args([str(tmp_path), "--calibrators", NAME])
    assert exc.value.code == 2
    assert f"unknown calibrator '{NAME}'" in capsys.readouterr().err
