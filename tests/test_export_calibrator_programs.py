"""The calibrators' programs of the export (tools/export.py --calibrator NAME), second half of
tests/test_export_calibrators.py (split for the test workers' balance): each fitted
calibrator's own program in both formats equals its forward; the whole network in ONNX (one
calibrator in make test, every one in the slow run) equals predict_seg; the predicted boundary
bands inside the program are those of the fitted calibrator (generated label maps); conformal
sets after a calibrator are predict_seg's. The run, its fitted calibrators and the reference
(predict_seg's own path) are those of tests/test_export_calibrators.py.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from cals_seg.calibrators._export import graph_bands
from cals_seg.calibrators.boundary_ts import predicted_bands
from cals_seg.metrics.distance import int_thresholds

from .conftest import copy_run, load_tool
from .test_export_calibrators import NAMES, K, _check, _pixels, _predictor, _structured

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def run(fitted_calibrators) -> Path:
    """tests/test_export_calibrators.py's run with every calibrator fitted, the session's (read
    only: the conformal test fits into a copy)."""
    return fitted_calibrators


def _onnx_call(path: Path):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"image": x.numpy()})[0])


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[] if n == "boundary_ts_conf" else pytest.mark.slow) for n in NAMES])
def test_onnx_model_equals_predict_seg(run, tmp_path, name):
    """The whole network in ONNX (make test: boundary_ts_conf, whose program holds the bands,
    the confidence bins and a gather; the slow run: every calibrator)."""
    pytest.importorskip("onnxscript")
    from cals_seg.runs.export import export_run

    out = tmp_path / f"{name}.onnx"
    info = export_run(run, out, "onnx", name)
    assert info["onnx_check"]["max_difference_to_pt2"] <= 1e-4
    _check(run, name, _onnx_call(out), tmp_path)


@pytest.mark.parametrize("name", NAMES)
def test_calibrator_program_in_both_formats_equals_forward(run, name):
    """Each fitted calibrator's own program (export_module), traced with dynamic N, H, W and
    run by torch.export and by onnxruntime, equals its forward on logits with regions of every
    class: within 1e-5, labels exactly. The ONNX program is converted as export_run converts
    it (onnxscript's optimiser on: the graph users get) and run from memory."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from cals_seg.calibrators import load_calibrator

    calibrator = load_calibrator(run / "calibrators" / f"{name}.pt")
    batches = [(_structured((2, K, 37, 45), 0) * 4, torch.randn(2, 3, 37, 45))]
    dim = torch.export.Dim
    sizes = {0: dim("n", min=1, max=64), 2: dim("h", min=9), 3: dim("w", min=9)}
    tests = [(_structured((1, K, 40, 33), 7) * 4, torch.randn(1, 3, 40, 33)),
             (_structured((2, K, 17, 70), 8) * 4, torch.randn(2, 3, 17, 70))]
    traced: dict[str, tuple[torch.nn.Module, object]] = {}
    for fmt in ("pt2", "onnx"):
        program = _Both(calibrator.export_module(fmt), calibrator.needs_image)
        example = batches[0]
        # traced once when both formats get the same program (all but cms_op's, whose ONNX
        # one ranks with topk; cms_ap ranks nothing: tested below)
        same = [e for p, e in traced.values() if _same_program(p, program)]
        exported = same[0] if same else torch.export.export(
            program, example, dynamic_shapes={"logits": sizes, "image": sizes})
        traced[fmt] = (program, exported)
        if fmt == "pt2":
            call = exported.module()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                converted = torch.onnx.export(exported, example, dynamo=True, verbose=False,
                                              input_names=["logits", "image"])
            session = ort.InferenceSession(converted.model_proto.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
            inputs = [i.name for i in session.get_inputs()]

            def call(logits, image, session=session, inputs=inputs):
                feed = {"logits": logits.numpy(), "image": image.numpy()}
                return torch.from_numpy(session.run(None, {k: feed[k] for k in inputs})[0])
        for logits, image in tests:
            with torch.no_grad():
                want = calibrator(logits, image if calibrator.needs_image else None)
                got = call(logits, image)
            assert (got.softmax(1) - want.softmax(1)).abs().max() <= 1e-5, (name, fmt)
            assert torch.equal(got.argmax(dim=1), want.argmax(dim=1)), (name, fmt)


def test_expert_affine_ranks_with_topk_in_order_mode_only():
    """cms_op's ONNX module ranks with topk (no stable sort in ONNX); cms_ap's ranks nothing,
    so both formats get the same module, traced once above."""
    from cals_seg.calibrators._export import ExpertAffine

    weight, bias = torch.randn(4, 3, 3), torch.randn(4, 3)
    assert ExpertAffine(weight, bias, "order", topk=True).topk
    assert _same_program(ExpertAffine(weight, bias, "argmax", topk=True),
                         ExpertAffine(weight, bias, "argmax", topk=False))
    assert not _same_program(ExpertAffine(weight, bias, "order", topk=True),
                             ExpertAffine(weight, bias, "order", topk=False))


def _same_program(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two modules compute the same program: one class, equal plain attributes (every
    submodule's) and equal state."""
    def plain(m: torch.nn.Module) -> list:
        return [(type(x), {k: v for k, v in vars(x).items() if not k.startswith("_")})
                for x in m.modules()]

    sa, sb = a.state_dict(), b.state_dict()
    return plain(a) == plain(b) and sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


class _Both(torch.nn.Module):
    """A calibrator's program with the image as a second input (passed on when it needs it)."""

    def __init__(self, program: torch.nn.Module, needs_image: bool) -> None:
        super().__init__()
        self.program, self.needs_image = program, needs_image

    def forward(self, logits: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return self.program(logits, image if self.needs_image else None)


def _label_maps():
    """Generated label maps: regions of every scale, thin lines, single pixels, one class,
    images smaller than the largest distance, every aspect."""
    g = torch.Generator().manual_seed(0)
    for shape in [(2, 1, 1), (1, 1, 9), (3, 5, 2), (2, 40, 33), (1, 70, 90), (1, 100, 3),
                  (1, 31, 31)]:
        for scale in (1, 3, 7, 40):
            low = torch.randint(0, 4, (shape[0], shape[1] // scale + 1, shape[2] // scale + 1),
                                generator=g)
            yield F.interpolate(low[:, None].float(), size=shape[1:], mode="nearest")[:, 0].long()
    yield torch.zeros(1, 20, 30, dtype=torch.long)


@pytest.mark.parametrize("bands", [(3.0, 8.0), (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0),
                                   (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0),
                                   (0.5,), (2.5, 30.0)])
def test_bands_inside_the_program_are_the_fitted_calibrators(bands):
    """graph_bands (what the exported program computes) equals predicted_bands (what the
    boundary calibrators are fitted and applied with) on every generated map."""
    for label in _label_maps():
        logits = F.one_hot(label, 5).permute(0, 3, 1, 2).float()
        assert torch.equal(graph_bands(logits, int_thresholds(bands)),
                           predicted_bands(logits, bands)), (bands, tuple(label.shape))


def test_conformal_sets_after_a_calibrator_are_predict_seg_s(run, tmp_path, capsys):
    """--calibrator NAME --conformal ALPHA: the probabilities are the calibrator's, the sets
    those predict_seg --calibrator NAME --conformal ALPHA writes (on the network's logits)."""
    images = run.parent / "images"
    run = copy_run(run, tmp_path / "copy")  # the threshold is fitted into the run folder
    spec = ["alpha=0.2", "mode=class"]  # predict_seg fits it on held-out validation images
    pred = tmp_path / "pred"
    assert load_tool("predict_seg").main([str(run), str(images), "--out", str(pred),
                                          "--calibrator", "boundary_ts", "--conformal", *spec,
                                          "--no-progress", "--no-ood-check"]) == 0, \
        capsys.readouterr().err
    out = tmp_path / "m.pt2"
    assert load_tool("export").main([str(run), "--format", "pt2", "--out", str(out),
                                     "--calibrator", "boundary_ts", "--conformal", *spec]) == 0, \
        capsys.readouterr().err
    info = json.loads(Path(f"{out}.json").read_text())
    assert info["calibrator"] == "boundary_ts" and info["outputs"] == ["probs", "sets"]
    program = torch.export.load(out).module()
    predicted = _predictor(run, "boundary_ts", tmp_path)
    for path in sorted(images.glob("*.png")):
        image = np.asarray(Image.open(path).convert("RGB"))
        with torch.no_grad():
            probs, sets = program(_pixels(image))
        want_probs, _ = predicted(image)
        assert (probs - want_probs).abs().max() <= 1e-5
        want_sets = np.load(pred / f"{path.stem}_sets.npz")["sets"]
        assert np.array_equal(sets[0].numpy(), want_sets)


def _brute_squared_distance(boundary: torch.Tensor, limit: int) -> torch.Tensor:
    """min(D, limit) by loops: every pixel against every boundary pixel of its image."""
    n, h, w = boundary.shape
    out = torch.full((n, h, w), limit, dtype=torch.int64)
    for i in range(n):
        points = boundary[i].nonzero().tolist()
        for y in range(h):
            for x in range(w):
                for by, bx in points:
                    out[i, y, x] = min(int(out[i, y, x]), (y - by) ** 2 + (x - bx) ** 2)
    return out


def test_the_programs_distance_and_boundary_equal_loops_and_the_library():
    """graph_squared_distance (doubling steps along the height) equals the capped squared
    Euclidean distance by loops and capped_squared_distance, and graph_boundary (3 x 3 max /
    min pooling) equals boundary_mask, on generated maps: every limit from 1 to 40 and some
    larger, sides from 1, boundary densities from none to all."""
    from cals_seg.calibrators._export import graph_boundary, graph_squared_distance
    from cals_seg.metrics.distance import boundary_mask, capped_squared_distance

    g = torch.Generator().manual_seed(0)
    shapes = [(1, 1, 1), (1, 1, 9), (2, 7, 1), (1, 6, 13), (2, 11, 8), (1, 17, 17)]
    for trial in range(60):
        n, h, w = shapes[trial % len(shapes)]
        density = (0.0, 0.02, 0.1, 0.5, 1.0)[trial % 5]
        boundary = torch.rand((n, h, w), generator=g) < density
        # min(D, limit) by loops for each limit below: the loops' D (capped far above every
        # limit and every distance), computed once, capped at each limit
        brute = _brute_squared_distance(boundary, 10**9) if h * w <= 200 else None
        for limit in [*range(1, 41, 1 + trial % 3), 100, 1000]:
            got = graph_squared_distance(boundary, limit)
            assert torch.equal(got.long(), capped_squared_distance(boundary, limit).long())
            if limit in (1, 2, 5, 17, 40, 100) and brute is not None:
                assert torch.equal(got.long(), brute.clamp(max=limit)), (trial, limit)
        label = torch.randint(0, 1 + trial % 4, (n, h, w), generator=g)
        label = F.interpolate(label[:, None].float(), scale_factor=1 + trial % 3,
                              mode="nearest")[:, 0].long()
        assert torch.equal(graph_boundary(label), boundary_mask(label)), trial
