"""tools/predict_cls.py on new images and texts, the image classifier's export (its .pt2 agrees
with predict_cls to 1e-4 on the top-label confidence, its sets equal), and their bad inputs in
one line naming the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from .conftest import copy_run, load_tool

pytestmark = pytest.mark.usefixtures("undrawn_figures")


def run_tool(name: str, argv: list, capsys) -> tuple[int, str, str]:
    code = load_tool(name).main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_predictions_and_the_export_agree(cls_run, tmp_path, capsys):
    """eval_cls in place fits the run's own calibrator and sets; predict_cls with them on new
    images, and the .pt2 export of the same run, calibrator and sets on the same images: the
    same class, the top-label confidence within 1e-4, the same sets."""
    run = copy_run(Path(cls_run), tmp_path / "runs")
    code, _, err = run_tool("eval_cls", [run, "--calibrators", "vector",
                                         "--conformal", "alpha=0.1"], capsys)
    assert code == 0, err
    assert {"vector.pt", "conformal_risk_lac_a0.1_s0.json"} <= {
        p.name for p in (run / "calibrators").iterdir()}
    images = sorted((Path(cls_run).parent.parent / "synthetic_cls" / "test").rglob("*.png"))[::7]
    code, _, err = run_tool("predict_cls", [run, *images, "--out", tmp_path / "pred",
                                            "--calibrator", "vector", "--conformal", "0.1"],
                            capsys)
    assert code == 0, err
    got = lines(tmp_path / "pred" / "predictions.jsonl")
    assert [g["input"] for g in got] == [str(p) for p in images]
    for g in got:
        assert g["calibrator"] == "vector" and g["temperature"] is None
        assert g["class"] == g["top"][0][0] and g["confidence"] == g["top"][0][1]
        assert g["set_size"] == len(g["set"]) and g["conformal"]["guarantee"]
    out = tmp_path / "model.pt2"
    code, stdout, err = run_tool("export", [run, "--format", "pt2", "--out", out,
                                            "--calibrator", "vector", "--conformal", "0.1"],
                                 capsys)
    assert code == 0, err
    info = json.loads(Path(f"{out}.json").read_text())
    assert info["family"] == "classification" and info["output"]["shape"] == ["N", "K"]
    assert info["input"]["shape"] == ["N", 3, 16, 16] and info["conformal"]["alpha"] == 0.1
    program = torch.export.load(out).module()
    batch = torch.stack([torch.from_numpy(np.array(Image.open(p).convert("RGB")))
                         .permute(2, 0, 1).float() for p in images])  # 16 x 16: no resize
    with torch.no_grad():
        probs, sets = program(batch)
    names = info["class_names"]
    assert probs.shape == (len(images), 10) and sets.dtype == torch.bool
    for i, g in enumerate(got):
        assert names[int(probs[i].argmax())] == g["class"]
        assert float(probs[i].max()) == pytest.approx(g["confidence"], abs=1e-4)
        assert sorted(names[k] for k in torch.nonzero(sets[i]).view(-1).tolist()) == \
            sorted(g["set"])
    assert "(N, 10) probabilities (calibrator vector)" in stdout


def test_text_documents_per_file_post_and_line(text_run, tmp_path, capsys):
    """Text runs: one document per file (posts cleaned with --posts) or per line (--lines);
    a document without a word is a one-line error naming it, the others are written. The sets'
    fit, missing, is made on the validation posts and saved into the run."""
    posts = sorted((Path(text_run).parent.parent / "synthetic_text" / "20news-bydate-test")
                   .rglob("*"))
    posts = [p for p in posts if p.is_file()][:3]
    run = copy_run(Path(text_run), tmp_path / "runs")  # the sets' fit is saved into it
    code, _, err = run_tool("predict_cls", [run, *posts, "--out", tmp_path / "a",
                                            "--posts", "--conformal", "0.1", "score=raps",
                                            "--top", "2"], capsys)
    assert code == 0, err
    got = lines(tmp_path / "a" / "predictions.jsonl")
    assert len(got) == 3 and all(len(g["top"]) == 2 and g["tokens"] > 0 for g in got)
    assert all(0 <= g["unknown"] < 1 and g["conformal"]["score"] == "raps" for g in got)
    assert (run / "calibrators" / "conformal_risk_raps_a0.1_s0.json").is_file()
    text = tmp_path / "texts.txt"
    text.write_text("first words of a post\n\n  ?!  \nsecond line\n")
    code, _, err = run_tool("predict_cls", [text_run, text, "--out", tmp_path / "b",
                                            "--lines"], capsys)
    assert code == 1
    assert err.splitlines()[0].startswith(f"error: {text}, line 3: holds no word")
    got = lines(tmp_path / "b" / "predictions.jsonl")
    assert [g.get("line") for g in got] == [1, 3, 4] and "error" in got[1]
    assert got[0]["temperature"] > 0 and got[0]["class"] in got[0]["top"][0]


def test_bad_inputs_are_one_line(cls_run, text_run, untrained_run, tmp_path, capsys):
    """One line naming the file and the fix: a segmentation run (predict_seg), a missing
    input, an unreadable image (its line in the JSON lines, the others written; --strict
    stops), a calibrator not fitted (the eval_cls command), a spatial calibrator, --lines on an
    image run, a text run to export (predict_cls)."""
    image = sorted((Path(cls_run).parent.parent / "synthetic_cls" / "test").rglob("*.png"))[0]
    bad = tmp_path / "inputs" / "broken.png"
    bad.parent.mkdir()
    bad.write_bytes(b"not an image")

    def refused(argv: list, expected: str, tool: str = "predict_cls", code: int = 2) -> str:
        got, _, err = run_tool(tool, argv, capsys)
        assert got == code and err.startswith("error: "), (argv, err)
        assert expected in err.splitlines()[0], (argv, err)
        return err

    refused([untrained_run, image, "--out", tmp_path / "o"],
            f"is a segmentation run ('synthetic'): use tools/predict_seg.py {untrained_run}")
    refused([cls_run, tmp_path / "nowhere.png", "--out", tmp_path / "o"],
            "nowhere.png does not exist; check the path")
    refused([cls_run, image, "--out", tmp_path / "o", "--calibrator", "dirichlet"],
            f"fit it first with tools/eval_cls.py {cls_run} --calibrators dirichlet")
    refused([cls_run, image, "--out", tmp_path / "o", "--calibrator", "boundary_ts"],
            "--calibrator boundary_ts: a spatial calibrator")
    refused([cls_run, image, "--out", tmp_path / "o", "--lines"], "is an image run")
    refused([text_run, "--format", "pt2", "--out", tmp_path / "t.pt2"],
            "is a text run: export takes image runs", tool="export")
    err = refused([cls_run, image, bad, "--out", tmp_path / "p"], "broken.png", code=1)
    assert "skipped, going on" in err
    got = lines(tmp_path / "p" / "predictions.jsonl")
    assert "class" in got[0] and got[1]["input"] == str(bad) and "error" in got[1]
    refused([cls_run, bad, image, "--out", tmp_path / "q", "--strict"], "stopping (--strict)")
    assert not (tmp_path / "o").exists()
