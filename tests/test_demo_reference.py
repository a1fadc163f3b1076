"""The demo's reference numbers come from a data file that the study command writes: what
``tools/compare.py --reference-out`` writes is what ``tools/demo.py`` reads, the shipped file is
valid, and a broken file is refused in one line before any training."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cals_seg.commands import compare, demo
from cals_seg.errors import UserError
from cals_seg.training.study import (
    check_reference,
    precision_words,
    read_reference,
    reference_entry,
    write_reference,
)


def _rows() -> dict:
    """compare's rows for two methods x three seeds: per seed a summary (test ECE as a
    fraction) and the calibrators' table values; ``cals_alm`` lacks ``boundary_ts``."""
    def seed(ece: float, ts: float, bts: float | None) -> dict:
        cal = {"uncalibrated": {"ece": ece}, "post-TS": {"ece": ts}, "ts": {"ece": ts}}
        if bts is not None:
            cal["boundary_ts"] = {"ece": bts}
        return cal

    return {
        "ce": {"summaries": [{"ece": e} for e in (0.02, 0.03, 0.04)],
               "calibrators": [seed(0.02, 0.01, 0.005), seed(0.03, 0.01, 0.007),
                               seed(0.04, 0.01, 0.009)],
               "metrics": [("r0", {"precision": "bf16"})]},
        "cals_alm": {"summaries": [{"ece": e} for e in (0.01, 0.02, 0.03)],
                     "calibrators": [seed(0.01, 0.02, None)] * 3},
    }


def test_the_writer_gives_what_the_demo_reads(tmp_path):
    entry = reference_entry(_rows(), ["ts", "boundary_ts"], command="python tools/compare.py X",
                            seeds=[0, 1, 2], machine="a CPU", date="2026-01-02",
                            precision=precision_words("bf16", "none"))
    path = tmp_path / "ref.json"
    write_reference(path, demo.SETUP, entry)
    read = read_reference(path)["setups"][demo.SETUP]
    assert read["ece"]["ce"]["raw"] == {"mean": 3.0, "std": 1.0, "n": 3}
    assert read["ece"]["ce"]["boundary_ts"] == {"mean": 0.7, "std": 0.2, "n": 3}
    assert "boundary_ts" not in read["ece"]["cals_alm"]
    assert read["precision"] == "training bfloat16, test pass float32"
    assert demo.reference_cell(read, "ce", "raw") == "3.00 ± 1.00"
    assert demo.reference_cell(read, "cals_alm", "ts") == "2.00 ± 0.00"
    assert demo.reference_cell(read, "cals_alm", "boundary_ts") == "-"
    assert demo.provenance(read) == ("3 seeds (0, 1, 2), a CPU, training bfloat16, test pass "
                                     "float32, 2026-01-02: python tools/compare.py X")
    # the demo's table takes the entry as it is
    row = {"pre_ts": {"ece": 0.03}, "calibrators": {"ts": {"ece": 0.01}}}
    lines = demo.table({"ce": (row, row, {})}, read)
    assert lines[2].endswith("| 3.00 ± 1.00 |") and lines[3].endswith("| 1.00 ± 0.00 |")
    # another setup is added beside it, this one replaced
    write_reference(path, "configs/other.yaml", {**entry, "date": "2026-01-03"})
    write_reference(path, demo.SETUP, {**entry, "seeds": [0]})
    setups = read_reference(path)["setups"]
    assert set(setups) == {demo.SETUP, "configs/other.yaml"} and setups[demo.SETUP]["seeds"] == [0]


def test_precision_in_words():
    assert precision_words("bf16", "none") == "training bfloat16, test pass float32"
    assert precision_words("none", "none") == "float32"
    assert precision_words(None, "fp16") == "test pass float16"
    assert precision_words(None, None) is None


def test_one_seed_has_no_std_and_the_default_date_is_today():
    rows = {"ce": {"summaries": [{"ece": 0.02}]}}
    entry = reference_entry(rows, ["ts"], command="c", seeds=[0], machine="m")
    assert entry["ece"] == {"ce": {"raw": {"mean": 2.0, "std": None, "n": 1}}}
    check_reference({"schema": 1, "setups": {"s": entry}}, "x")
    assert demo.reference_cell(entry, "ce", "raw") == "2.00"


def test_compare_writes_the_entry_of_its_setup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    args = argparse.Namespace(configs=[Path("configs/s.yaml")], calibrators=["ts"], seeds=[0, 1, 2],
                              reference_out=tmp_path / "ref.json",
                              argv=["configs/s.yaml", "--seeds", "0", "1", "2"])
    compare.write_reference_out(args, _rows())
    entry = read_reference(tmp_path / "ref.json")["setups"]["configs/s.yaml"]
    assert entry["command"] == "python tools/compare.py configs/s.yaml --seeds 0 1 2"
    assert entry["precision"] == "test pass bfloat16" and set(entry["ece"]["ce"]) == {"raw", "ts"}


def test_compare_refuses_a_reference_of_two_setups(tmp_path):
    args = compare.parse_args(["a.yaml", "b.yaml", "--out", str(tmp_path),
                               "--reference-out", str(tmp_path / "r.json")])
    with pytest.raises(UserError, match="^--reference-out: give one setup file"):
        compare.check_extras(args)


def test_the_shipped_file_covers_the_demos_setups():
    setups = read_reference(demo.REFERENCE_FILE)["setups"]
    assert set(setups) == set(demo.SETUPS.values())
    for entry in setups.values():
        assert set(entry["ece"]) == set(demo.METHODS)
        assert entry["seeds"] == [0, 1, 2] and entry["command"].startswith("python tools/")


BROKEN = {
    "missing": None,
    "not JSON": "{",
    "another schema": json.dumps({"schema": 2, "setups": {}}),
    "no date": json.dumps({"schema": 1, "setups": {"s": {
        "machine": "m", "command": "c", "seeds": [0], "ece": {"ce": {"raw": {
            "mean": 1.0, "std": None, "n": 1}}}}}}),
    "a mean that is text": json.dumps({"schema": 1, "setups": {"s": {
        "machine": "m", "date": "2026-01-02", "command": "c", "seeds": [0], "ece": {
            "ce": {"raw": {"mean": "2.97 ± 0.31", "std": None, "n": 1}}}}}}),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_the_demo_refuses_a_broken_file_in_one_line(case, tmp_path, monkeypatch, capsys):
    path = tmp_path / "ref.json"
    if BROKEN[case] is not None:
        path.write_text(BROKEN[case])
    monkeypatch.chdir(tmp_path)
    # nothing may train: the refusal comes before the first subprocess
    monkeypatch.setattr(demo, "run_parallel", lambda *a: pytest.fail("the demo went on"))
    monkeypatch.setattr(demo, "run_command", lambda *a: pytest.fail("the demo went on"))
    assert demo.main(["--reference", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: "), err
    assert "--reference-out" in err
    assert not (tmp_path / "runs").exists()
