"""A conformal score added from outside the package: defined and registered here (no package
file edited), it is chosen by ``eval_seg RUN --conformal score=NAME``, fitted, saved, read back
and measured by the real user path, with the threshold, coverage and set size of a reference
computed here from the run's logits.

The score is the ratio to the top class, ``s_k = 1 - p_k / max_j p_j`` (0 for the most probable
class, so no set is empty). The reference applies the documented risk-control rule
(docs/conformal.md) with integers: per calibration image ``i`` and grid index ``g``, the
fixed-point loss ``ceil(2^32 m_i(g) / t_i)`` (``t_i`` valid pixels, ``m_i(g)`` those whose true
class's cell ``ceil(4096 s)`` is above ``g``), and the threshold is the smallest ``g`` with
``10 (sum_i loss_i(g) + 2^32) <= 3 (n + 1) 2^32`` for ``alpha = 0.3``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from cals_seg.errors import UserError
from cals_seg.evaluation.conformal_score import SCORES, ConformalScore, refuse_onnx

from .conftest import load_tool
from .test_fit_records_conformal import _run

NAME = "ratio"
GRID = 2**12
CALLS: list[int] = []  # one entry per call of the test score, its batch size

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:.*temperature.json", "ignore:The validation NLL is minimal",
        "ignore:.*search boundary"),
    pytest.mark.usefixtures("undrawn_figures"),
]


class RatioScore(ConformalScore):
    """``s_k = 1 - p_k / max_j p_j``, in ``[0, 1]``.

    Shape:
        - probs: ``(N, K, P)`` float32 -> ``(N, K, P)`` float32.
    """

    name = NAME

    @staticmethod
    def scores(probs: Tensor, seed: int = 0) -> Tensor:
        CALLS.append(len(probs))
        return (1.0 - probs / probs.amax(dim=1, keepdim=True)).clamp_(0.0, 1.0)


@pytest.fixture
def registered():
    """``ratio`` registered through the public decorator for one test, removed at teardown."""
    CALLS.clear()
    list(SCORES)  # the built-ins discovered first: the new one comes after them
    yield SCORES.register(NAME)(RatioScore)
    SCORES.unregister(NAME)


def _reference_cells(run_dir: Path, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per image of ``split`` (loader order): the cells ``(K, P)`` of the test score on the
    run's logits (one image at a time, as ``eval.batch_size=1`` evaluates) and the valid true
    labels ``(P,)`` (-1 where void)."""
    from cals_seg.evaluation.inference import segment_logits
    from cals_seg.runs.run import load_run

    run = load_run(run_dir, with_data=True, device="cpu", amp="none", family="segmentation")
    dataset = {"val": run.task.val_set, "test": run.task.test_set}[split]
    out = []
    with torch.no_grad():
        for i in range(len(dataset)):
            item = dataset[i]
            logits = segment_logits(run.model, item["image"][None], run.task.protocol, "none")
            probs = logits.float().softmax(dim=1).flatten(2)
            p = probs[0].double()
            s = (1.0 - probs / probs.amax(dim=1, keepdim=True)).clamp(0.0, 1.0)[0]
            cells = np.clip(np.ceil(s.double().numpy() * GRID), 0, GRID).astype(np.int64)
            y = item["mask"].reshape(-1).numpy().astype(np.int64)
            y = np.where((y >= 0) & (y < p.shape[0]), y, -1)
            out.append((cells, y))
    return out


def _crc_index(calibration: list[tuple[np.ndarray, np.ndarray]], a: int, b: int) -> int:
    """The smallest grid index ``g`` with ``b (sum_i ceil(2^32 m_i(g) / t_i) + 2^32) <=
    a (n + 1) 2^32`` over the calibration images with a valid pixel (``alpha = a / b``)."""
    fixed, total, n = 2**32, [0] * (GRID + 1), 0
    for cells, y in calibration:
        valid = y >= 0
        t = int(valid.sum())
        if t == 0:
            continue
        n += 1
        true_cell = cells[y[valid], np.nonzero(valid)[0]]
        for g in range(GRID + 1):
            m = int((true_cell > g).sum())
            total[g] += -(-m * fixed // t)
    return next((g for g in range(GRID + 1) if b * (total[g] + fixed) <= a * (n + 1) * fixed),
                GRID)


def test_a_registered_score_runs_through_eval_seg(registered, tmp_path, capsys):
    run = _run(tmp_path, "run")
    args = [str(run), "--out", str(tmp_path / "eval"), "--set", "eval.batch_size=1",
            "--conformal", "alpha=0.3", "mode=risk", f"score={NAME}", "every=1"]
    assert load_tool("eval_seg").main(args) == 0, capsys.readouterr().err
    assert CALLS, "the registered score was never computed"
    result = json.loads((tmp_path / "eval" / "metrics.json").read_text())["conformal"]["risk"]
    assert result["score"] == NAME and result["fitted_for"]["params"]["score"] == NAME

    calibration = _reference_cells(run, "val")
    assert result["calibration_images"] == len(calibration)
    g = _crc_index(calibration, 3, 10)
    assert 0 < g < GRID  # a threshold below "every class": the test says something
    assert result["threshold"] == g / GRID

    covered = size = valid = 0
    for cells, y in _reference_cells(run, "test"):
        keep = y >= 0
        sets = cells[:, keep] <= g
        covered += int(sets[y[keep], np.arange(int(keep.sum()))].sum())
        size += int(sets.sum())
        valid += int(keep.sum())
    assert result["coverage"] == pytest.approx(covered / valid, abs=1e-12)
    assert result["set_size"] == pytest.approx(size / valid, abs=1e-12)

    # the fit is saved under its score's name and read back by the validated reader
    from cals_seg.evaluation.conformal_fit import load_conformal

    # (with the evaluation: its config is overridden, so the run's own fits stay as they are)
    assert not (run / "calibrators" / f"conformal_risk_{NAME}_a0.3_s0.json").exists()
    saved = load_conformal(tmp_path / "eval" / "calibrators" /
                           f"conformal_risk_{NAME}_a0.3_s0.json", 11)
    assert saved.score == NAME and saved.thresholds() == g / GRID


def test_the_registry_is_what_the_choices_and_export_read(registered):
    from cals_seg.commands._conformal import parse_conformal

    assert parse_conformal(["0.1", f"score={NAME}"])["score"] == NAME
    with pytest.raises(UserError, match=re.escape(f"one of {list(SCORES)}")):
        parse_conformal(["0.1", "score=nope"])
    refuse_onnx(NAME)  # no refusal: the score says ONNX can hold it
    with pytest.raises(UserError) as err:
        refuse_onnx("aps")
    assert str(err.value) == ("--format onnx --conformal score=aps: the APS randomisation "
                              "reads the bits of the probabilities, which ONNX cannot; use "
                              f"--format pt2, or score=lac or score={NAME}.")


def test_the_docs_table_lists_every_score():
    """docs/conformal.md's table of scores: one row per registered score, with where it is
    defined and the formats it is exported to (``ONNX`` only when it has no refusal)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "conformal.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)`[^|]*\| `[^`]+` \| ([^|]+) \|", text, re.M))
    assert set(rows) == set(SCORES)
    for name, score in SCORES.items():
        assert ("ONNX" in rows[name]) == (score.onnx_refusal is None), name
