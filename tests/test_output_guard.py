"""Trust at the edges, the writers' side: eval_seg replaces only files its own manifest lists and
never writes through a link (every file it writes, with every option, is planned and checked
before any work); predict_seg on a missing input creates nothing; check_data counts every
problem; the tools' warnings are one line; nothing built by install is tracked."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from cals_seg.commands import eval_seg, predict_seg
from cals_seg.data.checks import MAX_LISTED, check_splits
from cals_seg.utils.paths import MANIFEST

from .conftest import copy_run

K = 11
ROOT = Path(__file__).resolve().parents[1]


# The figures eval_seg writes are saved undrawn: these tests check numbers and file names.
pytestmark = pytest.mark.usefixtures("undrawn_figures")


@pytest.fixture(scope="module")
def run(imported_run, tmp_path_factory) -> Path:
    """This file's copy of the session's imported run (eval_seg saves its calibrators and
    conformal fits into the run)."""
    return copy_run(imported_run, tmp_path_factory.mktemp("run"))


ALL_OPTIONS = ["--calibrators", "ts", "boundary_ts", "--conformal", "alpha=0.5",
               "mode=risk,band", "every=1", "--shift", "fog:1", "--num-maps", "2"]


def written_files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if p.is_file() and p.name != MANIFEST}


@pytest.fixture(scope="module")
def full_output(run, tmp_path_factory) -> tuple[Path, set[str]]:
    out = tmp_path_factory.mktemp("full") / "out"
    code = eval_seg.main([str(run), "--out", str(out), *ALL_OPTIONS])
    assert code in (0, 1)
    return out, written_files(out)


def test_every_written_file_is_in_the_manifest(full_output) -> None:
    out, files = full_output
    manifest = set(json.loads((out / MANIFEST).read_text()))
    assert {"metrics.json", "conformal.md", "shift.md"} <= files
    assert files <= manifest, files - manifest


def test_a_second_run_replaces_its_own_files(run, full_output):
    out, files = full_output
    assert eval_seg.main([str(run), "--out", str(out), *ALL_OPTIONS]) in (0, 1)
    assert written_files(out) == files


def test_a_users_file_of_any_written_name_is_kept(run, full_output, tmp_path, capsys):
    """For every file eval_seg writes (sampled), a user's file of that name in --out, or a link
    of that name pointing outside, makes it refuse before any work; the file is unchanged."""
    _, files = full_output
    rng = np.random.default_rng(0)
    names = sorted(files)
    picked = {"conformal.md", "shift.md", "metrics.json",
              *[n for n in names if "set_size" in n][:1],
              *rng.choice(names, size=min(4, len(names)), replace=False).tolist()}
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    for i, name in enumerate(sorted(picked)):
        for kind in ("file", "link"):
            out = tmp_path / f"o{i}{kind}"
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if kind == "file":
                target.write_text("mine")
            else:
                os.symlink(outside, target)
            code = eval_seg.main([str(run), "--out", str(out), *ALL_OPTIONS])
            err = capsys.readouterr().err
            assert code != 0, (name, kind)
            assert any(w in err for w in ("not overwritten", "symbolic link", "outside")), err
            assert outside.read_text() == "keep me"
            if kind == "file":
                assert target.read_text() == "mine"
            assert not (out / "metrics.json").exists() or name == "metrics.json"


def test_link_in_the_default_folder_is_not_followed(run, tmp_path, capsys):
    run = copy_run(run, tmp_path)
    outside = tmp_path / "victim.json"
    outside.write_text("{}")
    default = run / "eval_val"
    default.mkdir(exist_ok=True)
    link = default / "metrics.json"
    os.symlink(outside, link)
    try:
        assert eval_seg.main([str(run), "--split", "val", "--num-maps", "0"]) != 0
        assert "outside" in capsys.readouterr().err
        assert outside.read_text() == "{}"
    finally:
        link.unlink()


def test_predict_on_a_missing_input_creates_nothing(run, tmp_path, capsys):
    out = tmp_path / "pred"
    for missing in (["nope/"], ["a.png", "b/"]):
        assert predict_seg.main([str(run), *[str(tmp_path / m) for m in missing], "--out",
                                 str(out)]) != 0
        err = capsys.readouterr().err.strip()
        assert "does not exist" in err and "restore" not in err and len(err.splitlines()) == 1
        assert not out.exists()


class Pairs:
    """A dataset of items, the first ``bad`` of them unreadable."""

    def __init__(self, n: int, bad: int) -> None:
        self.ids = [f"im{i}" for i in range(n)]
        self.bad = bad

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        if i < self.bad:
            raise ValueError(f"im{i}.png: unreadable")
        return {"image": torch.zeros(3, 4, 4), "mask": torch.zeros(4, 4, dtype=torch.long)}


@pytest.mark.parametrize("bad", [0, 1, MAX_LISTED - 1, MAX_LISTED, MAX_LISTED + 1, 64, 97])
def test_check_data_counts_every_problem(bad):
    datasets = {"train": Pairs(100, bad), "val": Pairs(3, 0), "test": Pairs(3, 0)}
    report = check_splits(datasets, [str(k) for k in range(K)], K, 255, progress=False)
    assert report.problem_count == bad
    assert report.ok == (bad == 0)
    if bad:
        assert f"{bad} problem(s)" in report.format().splitlines()[-1]
    assert report.to_dict()["problem_count"] == bad


def test_warnings_of_the_tools_are_one_line():
    code = ("import warnings, cals_seg.commands._cli\n"
            "warnings.warn('first\\nsecond part')\n")
    out = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stderr.strip() == "warning: first second part"


def test_nothing_built_by_install_is_tracked():
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    assert not [p for p in tracked.stdout.splitlines() if ".egg-info" in p]
