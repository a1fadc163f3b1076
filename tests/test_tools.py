"""Every tool is a door: ``tools/<name>.py`` runs ``cals_seg.commands.<name>``, its ``--help``
answers without importing torch, and no file edits ``sys.path``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted(p.stem for p in (ROOT / "tools").glob("*.py"))


def test_every_tool_has_a_command_and_a_console_script():
    commands = sorted(p.stem for p in (ROOT / "cals_seg" / "commands").glob("*.py")
                      if not p.stem.startswith("_"))
    assert TOOLS == commands
    scripts = (ROOT / "pyproject.toml").read_text()
    for name in TOOLS:
        assert f'cals-{name.replace("_", "-")} = "cals_seg.commands.{name}:cli"' in scripts


def python(code: str, timeout: int = 60) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter in the repository root; it must exit with 0."""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize("name", TOOLS)
def test_help_answers_without_importing_torch(name):
    code = (f"import runpy, sys; sys.argv = ['{name}.py', '--help']\n"
            f"try:\n    runpy.run_path('tools/{name}.py', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'\n")
    result = python(code)
    assert "usage:" in result.stdout



@pytest.mark.parametrize("tool, config", [("train_seg", "synthetic_deeplabv3"),
                                          ("train_cls", "synthetic_cls")])
@pytest.mark.parametrize("item", ["loss.params={oops", "train.bogus_key=1", "name=[1, 2",
                                  "train.epochs=0"])
def test_a_refused_set_answers_without_importing_torch(tool, config, item):
    """A --set that the config refuses (one it cannot read, or a value out of the rule table's
    range) is said (one line naming the key, exit status 2) before torch, the models and the
    data are imported."""
    code = (f"import sys; from cals_seg.commands.{tool} import main\n"
            f"code = main(['configs/{config}.yaml', '--set', {item!r}])\n"
            "assert code == 2, code\n"
            "assert 'torch' not in sys.modules, 'torch imported for a refused config'\n")
    result = python(code)
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, \
        result.stderr
    assert item.split("=")[0].split(".")[-1] in result.stderr, result.stderr  # the key named
    if item == "train.epochs=0":  # a rule of the table: its one format, the key first
        assert result.stderr.startswith("error: train.epochs: "), result.stderr

def test_nothing_edits_sys_path():
    for folder in ("tools", "tests", "cals_seg", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__):
                continue
            text = path.read_text()
            assert "sys.path.insert" not in text and "sys.path.append" not in text, path


def test_missing_prediction_inputs_are_named_and_counted(tmp_path):
    """check_inputs_exist (predict_seg, predict_cls): the first missing input named, the others
    counted, on every mix of existing files, folders, dangling links and missing paths."""
    import itertools

    from cals_seg.commands._cli import check_inputs_exist
    from cals_seg.errors import MissingPathError

    (tmp_path / "a.png").write_bytes(b"x")
    (tmp_path / "folder").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")  # exists as a link: the reader says
    present = [str(tmp_path / "a.png"), str(tmp_path / "folder"), str(tmp_path / "dangling")]
    absent = [str(tmp_path / f"missing{i}.png") for i in range(3)]
    for n in range(1, 5):
        for items in itertools.permutations(present + absent, n):
            missing = [i for i in items if i in absent]
            if not missing:
                check_inputs_exist(list(items))
                continue
            with pytest.raises(MissingPathError) as err:
                check_inputs_exist(list(items))
            more = f" (nor {len(missing) - 1} more inputs)" if len(missing) > 1 else ""
            assert str(err.value) == (f"{missing[0]} does not exist{more}; check the path. "
                                      "Nothing was written.")
