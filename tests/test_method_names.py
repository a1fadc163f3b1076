"""One meaning per method name, in every setup file found under configs/ (not a hand list):
``cals_alm`` is the paper's CALS-ALM at the paper's setting (m = 10 on vision, 6 on text, and the
paper's other hyper-parameters); ``cals_alm_auto`` is the evidence rule (``margin: auto``), opt-in,
present in every segmentation setup with a comment stating its measured limits; no other name
means the evidence rule. The demo runs the paper's method."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from cals_seg.config.schema import load_config
from cals_seg.data import DATASETS
from cals_seg.losses import build_loss
from cals_seg.losses.margin_rules import margin_rule_of

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def _setups() -> list[Path]:
    found = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if isinstance(raw, dict) and "methods" in raw:
            found.append(path)
    return found


SETUPS = _setups()
# The paper's hyper-parameters of CALS-ALM (its appendix table, and section 4's safeguarding
# interval for the multipliers); the margin depends on the task.
PAPER = {"lambda_init": 1e-6, "rho_init": 1.0, "gamma": 1.2, "tau": 0.9, "rho_period": 10,
         "lambda_min": 1e-6, "lambda_max": 1e6, "penalty": "phr"}


def _table(path: Path) -> tuple[dict, dict]:
    raw = yaml.safe_load(path.read_text())
    return raw, raw["methods"]


def _kind(raw: dict) -> str:
    return DATASETS[raw["data"]["name"]].kind


def test_every_setup_is_found():
    # the shipped setups of every family: a glob that finds nothing would pass everything below
    kinds = {_kind(_table(p)[0]) for p in SETUPS}
    assert len(SETUPS) >= 10 and kinds == {"segmentation", "classification", "text"}


@pytest.mark.parametrize("path", SETUPS, ids=lambda p: p.stem)
def test_cals_alm_is_the_papers_method(path):
    raw, table = _table(path)
    assert "cals_alm" in table, f"{path.name}: no `cals_alm` method"
    entry = table["cals_alm"]
    assert entry["name"] == "cals_alm", f"{path.name}: `cals_alm` runs the loss {entry['name']!r}"
    params = entry.get("params", {})
    paper_margin = 6.0 if _kind(raw) == "text" else 10.0
    assert params.get("margin") == paper_margin, (
        f"{path.name}: `cals_alm` has margin {params.get('margin')!r}, the paper's is "
        f"{paper_margin:g}")
    loss = build_loss("cals_alm", raw["data"]["num_classes"], **params)
    assert loss.margin == paper_margin and margin_rule_of(loss) is None
    assert loss.lambdas.eq(PAPER["lambda_init"]).all() and loss.rhos.eq(PAPER["rho_init"]).all()
    assert (loss.gamma, loss.tau, loss.rho_period) == (PAPER["gamma"], PAPER["tau"],
                                                      PAPER["rho_period"])
    assert (loss.lambda_min, loss.lambda_max) == (PAPER["lambda_min"], PAPER["lambda_max"])
    assert loss.penalty.name == PAPER["penalty"]
    # the file name of the alias runs the same loss (configs/<setup>_cals.yaml)
    cfg = load_config(CONFIGS / f"{path.stem}_cals.yaml")
    assert cfg.loss.name == "cals_alm" and cfg.loss.params.get("margin") == paper_margin


@pytest.mark.parametrize("path", SETUPS, ids=lambda p: p.stem)
def test_the_evidence_rule_has_its_own_name(path):
    raw, table = _table(path)
    if _kind(raw) == "segmentation":
        assert "cals_alm_auto" in table, f"{path.name}: no `cals_alm_auto` beside `cals_alm`"
    for method, entry in table.items():
        auto = entry.get("params", {}).get("margin") == "auto"
        if entry["name"] in ("cals_alm", "cals_hr"):
            assert auto == method.endswith("_auto"), (
                f"{path.name}: method {method!r} {'is' if auto else 'is not'} the evidence rule")
    if "cals_alm_auto" in table:
        entry = table["cals_alm_auto"]
        assert entry["name"] == "cals_alm" and entry["params"]["margin"] == "auto"
        # the same loss as the paper's method but for the margin
        same = {k: v for k, v in entry["params"].items() if k != "margin"}
        paper = {k: v for k, v in table["cals_alm"].get("params", {}).items() if k != "margin"}
        assert same == paper, f"{path.name}: `cals_alm_auto` is more than `cals_alm` + auto"
        assert raw["method"] != "cals_alm_auto", f"{path.name}: the evidence rule is opt-in"
        # kept beside the core: the entry opts in to its module, and the setup builds with it
        assert entry.get("contrib") == ["auto_margin"], (
            f"{path.name}: `cals_alm_auto` needs `contrib: [auto_margin]`")
        cfg = load_config(path, method="cals_alm_auto")
        assert cfg.loss.params["margin"] == "auto" and "auto_margin" in cfg.contrib
        loss = build_loss("cals_alm", raw["data"]["num_classes"], **cfg.loss.params)
        assert margin_rule_of(loss) is not None and loss.margin == 10.0


@pytest.mark.parametrize("path", [p for p in SETUPS if "cals_alm_auto" in _table(p)[1]],
                         ids=lambda p: p.stem)
def test_the_evidence_rule_states_its_limits_where_offered(path):
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("cals_alm_auto:"))
    above = []
    for line in reversed(lines[:at]):  # the comment block right above the entry
        if not line.strip().startswith("#"):
            break
        above.append(line)
    comment = " ".join(above)
    assert "docs/margin.md" in comment and "Opt-in" in comment and "Measured" in comment, (
        f"{path.name}: `cals_alm_auto` needs a comment with its measured limits above it")
    assert any(ch.isdigit() for ch in comment), f"{path.name}: the limits need their numbers"


@pytest.mark.parametrize("long", [False, True])
def test_the_demo_runs_the_papers_method(long):
    from cals_seg.commands import demo

    raw, table = _table(ROOT / demo.SETUPS[long])
    assert set(demo.METHODS) == {"ce", "cals_alm"} and demo.SETUP == demo.SETUPS[False]
    assert table["cals_alm"] == {"name": "cals_alm", "params": {"margin": 10.0}}
    assert set(demo.CALIBRATORS) == {"ts", "boundary_ts"}


def test_the_demos_reference_column_quotes_the_docs():
    # every 3-seed number the demo prints next to its rows is one the docs published, in the
    # study its reference file names
    from cals_seg.commands import demo
    from cals_seg.training.study import read_reference

    reference = read_reference(demo.REFERENCE_FILE)["setups"]
    assert set(reference) == set(demo.SETUPS.values())
    for setup, entry in reference.items():
        docs = "".join((ROOT / path).read_text() for path in
                       sorted(set(re.findall(r"docs/[\w/]+\.md", entry["source"]))))
        for method, cells in entry["ece"].items():
            assert method in demo.METHODS and set(cells) <= {"raw", *demo.CALIBRATORS}
            for name in cells:
                shown = demo.reference_cell(entry, method, name)
                assert shown.split(" ")[0] in docs, (setup, method, shown)
                if "±" in shown:
                    assert shown in docs, (setup, method, shown)
        assert {"raw", "ts"} <= set(entry["ece"]["ce"]) and "raw" in entry["ece"]["cals_alm"]


def _metrics(ece: float, calibrated: dict[str, float]) -> dict:
    row = lambda e: {"ece": e, "ece_band_weighted": e + 0.01, "nll": 0.4, "miou": 0.3}  # noqa: E731
    return {"pre_ts": row(ece), "calibrators": {k: row(v) for k, v in calibrated.items()}}


def test_the_demo_picks_the_calibrator_on_validation_only():
    from cals_seg.commands import demo

    # the validation ECE decides, whatever the test split says
    val = _metrics(0.03, {"ts": 0.012, "boundary_ts": 0.010})
    test = _metrics(0.03, {"ts": 0.005, "boundary_ts": 0.020})
    assert demo.pick_calibrator(val) == ("boundary_ts", 0.010)
    assert demo.pick_calibrator(_metrics(0.03, {"ts": 0.01, "boundary_ts": 0.01}))[0] == "ts"
    from cals_seg.training.study import read_reference

    entry = read_reference(demo.REFERENCE_FILE)["setups"][demo.SETUP]
    lines = demo.table({"ce": (test, val, {}), "cals_alm": (test, _metrics(0.03, {"ts": 0.01}),
                                                           {})}, entry)
    assert len(lines) == 2 + 4  # header, rule, two rows per method
    assert lines[2].startswith("| ce | raw | 3.00 | 3.00 |") and "| 2.97 ± 0.31 |" in lines[2]
    assert lines[3].startswith("| ce | boundary_ts | 1.00 | 2.00 |")
    assert lines[5].startswith("| cals_alm | ts | 1.00 | 0.50 |") and "1.21 ± 0.36" in lines[5]
    with pytest.raises(SystemExit):
        demo.pick_calibrator({"pre_ts": {}, "calibrators": {}})
