"""Saved calibrator fits know what they were fitted for, are reused only for that, and are
validated when read back; NaN or infinite logits stop an evaluation in one line.

- Every registered calibrator, fitted on random logits and saved, then each field of the file
  broken in turn (truncated, another class count, a state of another shape, NaN, a key
  dropped, ...): one-line ``UserError`` naming the file and the fix, never a traceback later.
- ``load_or_fit_calibrators``: a fit is reused when its record equals the use's; any recorded
  field changed (or added, dropped, missing, the file broken) refits with one line.
- ``load_run_calibrator`` (``predict_seg``): refused in one line naming the file, the key and
  the command, on every field such a use can know; params and image ids are not compared.
- ``FitKey.problem`` against an independent reference (canonical JSON equality), generated.
- ``FiniteLogits``: at once on the CPU, once per pass when deferred (no host read per batch);
  ``eval_seg`` and ``predict_seg`` of a network with NaN weights end in one line.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cals_seg.calibrators import (
    CALIBRATORS,
    CalibratorFileError,
    build_calibrator,
    calibrator_key,
    load_calibrator,
    load_run_calibrator,
    save_calibrator,
)
from cals_seg.errors import MissingPathError, UserError
from cals_seg.evaluation.engine import load_or_fit_calibrators
from cals_seg.evaluation.inference import (
    EvalProtocol,
    FiniteLogits,
    NonFiniteLogitsError,
    segment_logits,
)
from cals_seg.evaluation.stream import Inference, evaluate
from cals_seg.utils.fits import KEY_FIELDS, FitKey, file_digest, ids_digest, members_digest

from .test_calibrators import batches_of, structured
from .test_compile_sync import HostReads

K, VOID = 4, 255
ROOT = Path(__file__).resolve().parents[1]
# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:boundary_ts", "ignore:selective", "ignore:.*identity"),
    pytest.mark.usefixtures("undrawn_figures"),
]


def _params(name: str) -> dict:
    return {"epochs": 1} if name in ("lts", "selective") else {}


@pytest.fixture(scope="module")
def fitted():
    """Every registered calibrator fitted on the same random, mis-calibrated logits."""
    z, target = structured(n=10, h=16, w=16, seed=3)
    image = torch.randn(10, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    out = {}
    for name in sorted(CALIBRATORS):
        cal = build_calibrator(name, K, **_params(name))
        cal.fit(batches_of(2 * z, target, image), ignore_index=VOID)
        out[name] = cal.eval()
    return out


def _one_line(err: BaseException, path: Path) -> str:
    text = str(err)
    assert "\n" not in text and str(path) in text, text
    return text


# ------------------------------------------------------------------ the file read back
def _corruptions(name: str, saved: dict) -> list[tuple[str, object, str]]:
    """``(label, what to write instead, regex of the reason)`` for one saved calibrator."""
    state = saved["state"]
    first = sorted(state)[0]
    floats = [k for k, v in sorted(state.items()) if v.is_floating_point() and v.numel()]
    cases: list[tuple[str, object, str]] = [
        ("not a mapping", [1, 2, 3], "not a saved calibrator"),
        ("name unknown", {**saved, "name": "platt"}, "names calibrator 'platt'"),
        ("name not text", {**saved, "name": 3}, "names calibrator 3"),
        ("num_classes 1", {**saved, "num_classes": 1}, "num_classes=1"),
        ("num_classes text", {**saved, "num_classes": "4"}, "num_classes='4'"),
        ("num_classes bool", {**saved, "num_classes": True}, "num_classes=True"),
        ("other class count", {**saved, "num_classes": K + 1},
         rf"was fitted for {K + 1} classes, but the run has {K}"),
        ("params not a mapping", {**saved, "params": [1]}, "params"),
        ("unknown parameter", {**saved, "params": {**saved["params"], "bogus": 1}},
         "invalid params"),
        ("state not a mapping", {**saved, "state": [1]}, "state that is not a mapping"),
        ("state value not a tensor", {**saved, "state": {**state, first: 1.0}},
         "state that is not a mapping of tensors"),
        ("state key dropped", {**saved, "state": {k: v for k, v in state.items() if k != first}},
         "lacks the state"),
        ("state key added", {**saved, "state": {**state, "extra": torch.zeros(1)}},
         "does not have"),
        ("state shape", {**saved, "state": {**state, first: torch.cat([state[first].reshape(-1),
                                                                       state[first].reshape(-1)])
                                            if state[first].numel() else torch.zeros(3)}},
         f"holds state {first} of"),
        ("state dtype", {**saved, "state": {**state, first: state[first].to(torch.float16)
                                            if state[first].dtype != torch.float16
                                            else state[first].double()}},
         f"holds state {first} of"),
        ("fit_info not a mapping", {**saved, "fit_info": "abc"}, "fit_info 'abc'"),
        ("fitted_for not a mapping", {**saved, "fitted_for": [1]}, "fitted_for"),
    ]
    cases += [(f"{key} dropped", {k: v for k, v in saved.items() if k != key},
               f"no {key}") for key in ("name", "num_classes", "params", "state")]
    for key in floats[:2]:
        for value in (float("nan"), float("inf"), -float("inf")):
            bad = state[key].clone()
            bad.reshape(-1)[bad.numel() // 2] = value
            cases.append((f"{value} in {key}", {**saved, "state": {**state, key: bad}},
                          f"NaN or infinite values in state {key}"))
    for key in state:
        if key.split(".")[-1] in ("temperature", "temperatures"):
            for value in (0.0, -1.5):
                bad = state[key].clone()
                bad.reshape(-1)[0] = value
                cases.append((f"{key}={value}", {**saved, "state": {**state, key: bad}},
                               f"temperature <= 0 in state {key}"))
    if "choice" in state:
        count = len(saved["params"]["candidates"])
        for value in (-1, count, count + 7):
            cases.append((f"choice={value}", {**saved, "state": {**state,
                                                                 "choice": torch.tensor(value)}},
                          f"choice={value}, not one of its {count} candidates"))
    if name != "ts":  # a state whose shape depends on K: forged to the run's class count
        other = build_calibrator(name, K + 1, **saved["params"]).state_dict()
        if any(other[k].shape != state[k].shape for k in state):
            cases.append(("K changed, state kept", {**saved, "num_classes": K + 1},
                          rf"holds state .* for {K + 1} classes holds"))
    return cases


@pytest.mark.parametrize("name", sorted(CALIBRATORS))
def test_every_broken_field_is_one_line(name, fitted, tmp_path):
    """Each corruption of a valid file: a CalibratorFileError (a UserError) of one line that
    names the file, what is wrong and the command that refits; the intact file loads and
    computes what the fitted calibrator computes."""
    path = save_calibrator(fitted[name], tmp_path / "run" / "calibrators" / f"{name}.pt",
                           fitted_for={"calibrator": name})
    saved = torch.load(path, weights_only=True)
    back = load_calibrator(path, num_classes=K)
    assert back.fitted_for == {"calibrator": name}
    x, image = 3 * torch.randn(2, K, 16, 16), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(back(x, image), fitted[name](x, image), rtol=0, atol=0)
    data = path.read_bytes()
    writes: list[tuple[str, object, str]] = [
        ("truncated", data[: len(data) // 2], "not a saved calibrator"),
        ("empty", b"", "not a saved calibrator"),
        ("text", b'{"name": "ts"}', "not a saved calibrator"),
        *_corruptions(name, saved),
    ]
    for label, content, reason in writes:
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(content, path)
        with pytest.raises(UserError) as info:
            # the forged file claims K + 1 classes: loaded for a run of K + 1 classes
            load_calibrator(path, num_classes=K + 1 if label.startswith("K changed") else K)
        assert isinstance(info.value, CalibratorFileError), label
        text = _one_line(info.value, path)
        assert re.search(reason, text), (label, text)
        assert f"refit it: tools/eval_seg.py {tmp_path / 'run'} --calibrators {name} " \
               "--refit-calibrators" in text, (label, text)
    path.unlink()
    with pytest.raises(MissingPathError):
        load_calibrator(path)


def test_an_older_file_without_a_record_loads_with_none(fitted, tmp_path):
    path = save_calibrator(fitted["vector"], tmp_path / "vector.pt")
    saved = torch.load(path, weights_only=True)
    del saved["fitted_for"]
    torch.save(saved, path)
    assert load_calibrator(path, num_classes=K).fitted_for is None


# ------------------------------------------------------------------ what a fit is for
def _fake_run(tmp: Path, name: str = "run", *, members: list[Path] | None = None,
              precision: str = "none", k: int = K) -> SimpleNamespace:
    """What calibrator_key reads of a loaded Run: a checkpoint file, the data section,
    class names, precision, protocol, the ensemble's members."""
    folder = tmp / name
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = folder / "checkpoint_best.pt"
    if not checkpoint.is_file():
        torch.save({"model": {"w": torch.tensor([float(ord(c)) for c in name])}}, checkpoint)
    extra = {"ensemble": {"members": [str(m) for m in members]}} if members else {}
    return SimpleNamespace(
        path=folder, checkpoint=checkpoint, device=torch.device("cpu"), precision=precision,
        protocol=EvalProtocol(), class_names=[f"c{i}" for i in range(k)], extra=extra,
        config=SimpleNamespace(data=SimpleNamespace(num_classes=k, ignore_index=VOID)))


def test_the_record_names_the_network_by_content(tmp_path):
    a = _fake_run(tmp_path, "a")
    record = calibrator_key(a, "vector", {}, ["x1", "x2"]).record()
    assert set(record) == set(KEY_FIELDS)
    assert record == json.loads(json.dumps(record))  # plain values
    assert record["kind"] == "calibrator" and record["name"] == "vector"
    assert record["network"] == file_digest(a.checkpoint)
    assert record["classes"] == {"num_classes": K, "names": ["c0", "c1", "c2", "c3"]}
    assert record["ids"] == ids_digest(["x1", "x2"]) and record["split"] == "val"
    assert record["params"] == {"max_iter": 100, "ignore_index": VOID}  # defaults filled in
    assert record == calibrator_key(a, "vector", {"max_iter": 100}, ["x1", "x2"]).record()
    assert record != calibrator_key(a, "vector", {"max_iter": 5}, ["x1", "x2"]).record()
    assert record != calibrator_key(a, "vector", {}, ["x2", "x1"]).record()  # ids in order
    copy = tmp_path / "copy"
    shutil.copytree(a.path, copy)  # a byte-identical copy is the same network
    assert record == calibrator_key(_fake_run(tmp_path, "copy"), "vector", {},
                                    ["x1", "x2"]).record()
    b = _fake_run(tmp_path, "b")  # other bytes: another network
    assert calibrator_key(b, "vector", {}, ["x1", "x2"]).network != record["network"]
    ens = _fake_run(tmp_path, "a", members=[a.checkpoint, b.checkpoint])
    swapped = _fake_run(tmp_path, "a", members=[b.checkpoint, a.checkpoint])
    assert calibrator_key(ens, "ts").network == calibrator_key(swapped, "ts").network
    assert calibrator_key(ens, "ts").network == members_digest([a.checkpoint, b.checkpoint])
    assert calibrator_key(ens, "ts").network != record["network"]
    partial = calibrator_key(a, "vector")
    assert set(partial.record()) == set(KEY_FIELDS) - {"params", "split", "ids"}
    with pytest.raises(ValueError, match="unknown fields"):  # a use's key is never saved
        save_calibrator(build_calibrator("vector", K), tmp_path / "v.pt", fitted_for=partial)
    assert calibrator_key(a, "ts", data="fog:3 seed 0").record()["after"] == "fog:3 seed 0"
    with pytest.raises(UserError, match="bogus"):
        calibrator_key(a, "vector", {"bogus": 1}, [])


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 2 else 4)
    if kind == 0:
        return rng.randrange(-3, 4)
    if kind == 1:
        return rng.choice(["a", "b", "val", "none", ""])
    if kind == 2:
        return rng.choice([None, True, False, 0.5])
    if kind == 3:
        return rng.choice([1.0, 2.0, 1e-3])
    if kind == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice("xyz"): _random_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def test_key_problem_against_canonical_json(tmp_path):
    """Generated keys and saved records edited from them: the fit is for the use exactly when
    the record, its unknown fields left out, equals the key's record as canonical JSON (tuples
    and lists alike, numbers compared by value) and says what kind of fit it is; the field
    returned is one where they differ."""
    rng = random.Random(0)

    def numbers(v):  # as Python compares them: True == 1 == 1.0
        if isinstance(v, dict):
            return {k: numbers(x) for k, x in v.items()}
        if isinstance(v, list):
            return [numbers(x) for x in v]
        return float(v) if isinstance(v, bool | int | float) else v

    canon = lambda d: json.dumps(numbers(d), sort_keys=True)  # noqa: E731
    fields = [f for f in KEY_FIELDS if f != "kind"]
    for _ in range(400):
        unknown = tuple(rng.sample(fields, rng.randrange(3)))
        key = FitKey(rng.choice(["calibrator", "conformal", "entropy"]),
                     **{f: _random_value(rng) for f in fields}, unknown=unknown)
        saved = {f: _random_value(rng) for f in KEY_FIELDS}  # unknown fields: any value
        saved.update(key.record())
        edit = rng.randrange(5)
        if edit == 1:
            saved[rng.choice(list(KEY_FIELDS))] = _random_value(rng)
        elif edit == 2:
            del saved[rng.choice(list(KEY_FIELDS))]
        elif edit == 3:
            saved[rng.choice(["extra", "data", "calibrator"])] = 1
        elif edit == 4:
            saved = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
        problem = key.problem(saved)
        plain = json.loads(json.dumps(saved))
        known = {k: v for k, v in plain.items() if k not in unknown}
        equal = "kind" in plain and canon(known) == canon(key.record())
        assert (problem is None) == equal, (saved, key, problem)
        if problem is not None and problem[0] != "record":
            field = problem[0]
            assert field not in unknown
            assert field not in plain or field not in known or plain[field] != \
                json.loads(json.dumps(key.record())).get(field, object()), (field, saved, key)
        elif problem is not None:
            assert "kind" not in plain
    key = FitKey("calibrator", "ts", "n", {})
    for nothing in (None, {}, [], "x"):
        assert key.problem(nothing)[0] == "record"


# ------------------------------------------------------------------ reuse or refit
def _setting(tmp_path: Path):
    torch.manual_seed(0)
    model = nn.Conv2d(3, K, 1)
    model.weight.data *= 4
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 8, 8, generator=g)
    with torch.no_grad():
        y = model(x).argmax(dim=1)
    flip = torch.rand(6, 8, 8, generator=g) < 0.3
    y[flip] = torch.randint(0, K, (int(flip.sum()),), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=3)
    return Inference(model, torch.device("cpu"), "none", None), loader


def _changed(value):
    if isinstance(value, dict):
        return {**value, "changed": 1}
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, bool) or value is None:
        return "other"
    if isinstance(value, int | float):
        return value + 1
    return [*value, 1] if isinstance(value, list) else "other"


def test_a_fit_is_reused_only_for_its_record(tmp_path, capsys):
    """Saved with its record, loaded again for the same record; every recorded key changed in
    the file (or dropped, or one added, or no record, or a broken file) refits with one line,
    and the file then holds the use's record again."""
    infer, loader = _setting(tmp_path)
    run = _fake_run(tmp_path)
    folder = tmp_path / "run" / "calibrators"
    names = ["ts", "vector"]
    keys = {n: calibrator_key(run, n, {}, [f"im{i}" for i in range(6)]) for n in names}
    records = {n: k.record() for n, k in keys.items()}

    def call(keys=keys):
        capsys.readouterr()
        cals, info = load_or_fit_calibrators(names, folder, K, infer, loader, VOID, keys=keys)
        return cals, info, capsys.readouterr().err

    first, info, err = call()
    assert [info[n]["loaded"] for n in names] == [False, False] and err == ""
    for n in names:
        assert torch.load(folder / f"{n}.pt", weights_only=True)["fitted_for"] == records[n]
        assert info[n]["fitted_for"] == records[n]
    again, info, err = call()
    assert [info[n]["loaded"] for n in names] == [True, True] and "refitting" not in err
    x = 3 * torch.randn(2, K, 8, 8)
    for n in names:
        torch.testing.assert_close(again[n](x), first[n](x), rtol=0, atol=0)
    path = folder / "vector.pt"
    good = torch.load(path, weights_only=True)
    record = good["fitted_for"]
    variants = [(f"{key} changed", {**record, key: _changed(record[key])},
                 "another network" if key == "network" else
                 "other images" if key == "ids" else f"was fitted for {key}=")
                for key in sorted(record)]
    variants += [(f"{key} dropped", {k: v for k, v in record.items() if k != key},
                  "written by an older version" if key == "kind" else f"does not record {key}")
                 for key in sorted(record)]
    variants += [("extra key", {**record, "data": 1}, "records data=1"),
                 ("no record", None, "records nothing of what it was fitted for")]
    for label, saved_record, reason in variants:
        torch.save({**good, "fitted_for": saved_record}, path)
        _, info, err = call()
        assert info["vector"]["loaded"] is False and info["ts"]["loaded"] is True, label
        lines = err.strip().splitlines()
        assert lines == [line for line in lines if line.startswith(str(path))], err
        assert len(lines) == 1 and reason in lines[0] and lines[0].endswith(": refitting"), \
            (label, err)
        assert torch.load(path, weights_only=True)["fitted_for"] == record, label
    path.write_bytes(path.read_bytes()[:100])  # a broken file is refit too
    _, info, err = call()
    assert info["vector"]["loaded"] is False and "is not a saved calibrator" in err
    wrong_k = build_calibrator("vector", K + 1)
    save_calibrator(wrong_k, path, fitted_for=record)  # a fit for another class count
    _, info, err = call()
    assert info["vector"]["loaded"] is False and f"was fitted for {K + 1} classes" in err
    # the use changes instead of the file: another precision refits, and is then reused
    other = {n: dataclasses.replace(k, precision="bf16") for n, k in keys.items()}
    _, info, err = call(other)
    assert not any(info[n]["loaded"] for n in names) and err.count("refitting") == 2
    _, info, _ = call(other)
    assert all(info[n]["loaded"] for n in names)
    _, info, err = call(None)  # a caller without records: never reused
    assert not any(info[n]["loaded"] for n in names) and "gives no record" in err


def test_predict_uses_a_fit_only_for_this_run(tmp_path):
    """load_run_calibrator: reused when every key a use without data knows matches (params
    and image ids are not compared); any of them changed, no record, another class count or
    no file: one line naming the file, the key and the command that refits."""
    run = _fake_run(tmp_path)
    path = run.path / "calibrators" / "vector.pt"
    cal = build_calibrator("vector", K)
    full = calibrator_key(run, "vector", {"max_iter": 7}, ["a", "b"]).record()
    save_calibrator(cal, path, fitted_for=full)
    assert isinstance(load_run_calibrator(run, "vector"), type(cal))
    command = f"tools/eval_seg.py {run.path} --calibrators vector --refit-calibrators"
    for key in sorted(calibrator_key(run, "vector").record()):
        save_calibrator(cal, path, fitted_for={**full, key: _changed(full[key])})
        with pytest.raises(UserError) as info:
            load_run_calibrator(run, "vector")
        text = _one_line(info.value, path)
        assert f"[{key}]" in text and command in text, text
    save_calibrator(cal, path, fitted_for={**full, "precision": "bf16"})
    with pytest.raises(UserError, match="--amp bf16"):
        load_run_calibrator(run, "vector")
    save_calibrator(cal, path)
    with pytest.raises(UserError, match="records nothing of what it was fitted for"):
        load_run_calibrator(run, "vector")
    eleven = _fake_run(tmp_path, "run", k=11)  # a 4-class fit on an 11-class run
    save_calibrator(cal, path, fitted_for=full)
    with pytest.raises(UserError, match=rf"was fitted for {K} classes, but the run has 11"):
        load_run_calibrator(eleven, "vector")
    path.unlink()
    with pytest.raises(MissingPathError, match="fit it first with tools/eval_seg.py"):
        load_run_calibrator(run, "vector")


# ------------------------------------------------------------------ non-finite logits
def test_finite_logits_at_once_or_once_per_pass():
    """Generated batches with a NaN / inf / -inf at a random place: at once (CPU default), or
    deferred: no host read per batch, and one error at the end naming how many batches."""
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        batches = [torch.randn(2, K, 5, 5, generator=g) for _ in range(5)]
        bad = sorted(random.Random(trial).sample(range(5), 1 + trial % 3))
        for i in bad:
            batches[i].view(-1)[trial * 7 % 50] = [float("nan"), float("inf"),
                                                   -float("inf")][trial % 3]
        now = FiniteLogits()
        for i, b in enumerate(batches):
            if i == bad[0]:
                with pytest.raises(NonFiniteLogitsError, match="NaN or infinite logits"):
                    now.observe(b)
                break
            now.observe(b)
        later = FiniteLogits(defer=True)
        with HostReads() as reads:
            for b in batches:
                later.observe(b)
        assert reads.calls == []
        with pytest.raises(NonFiniteLogitsError, match=rf"in {len(bad)} of 5 batches"):
            later.check()
        clean = FiniteLogits(defer=True)
        for b in batches:
            clean.observe(torch.nan_to_num(b))
        clean.check()


class _Broken(nn.Module):
    """A network whose logits hold ``value`` at images whose first pixel is negative."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, K, 1)
        self.value = value

    def forward(self, x):
        out = self.conv(x)
        hit = (x[:, 0, 0, 0] < 0).view(-1, 1, 1, 1)
        return torch.where(hit & (torch.arange(out.shape[-1]) == 0), self.value, out)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_evaluation_pass_raises_on_non_finite_logits(value, monkeypatch):
    """segment_logits raises at once; a deferred evaluation pass raises once, after the last
    batch (every consumer saw every batch); finite logits pass untouched."""
    model = _Broken(value).eval()
    x = torch.rand(4, 3, 6, 6)
    x[2, 0, 0, 0] = -1.0
    with pytest.raises(NonFiniteLogitsError):
        segment_logits(model, x, EvalProtocol())
    segment_logits(model, x.abs(), EvalProtocol())
    from cals_seg.evaluation import stream

    monkeypatch.setattr(stream, "FiniteLogits", lambda: FiniteLogits(defer=True))
    seen = []
    loader = DataLoader(TensorDataset(x, torch.zeros(4, 6, 6, dtype=torch.long)),
                        batch_size=1)
    with pytest.raises(NonFiniteLogitsError, match="in 1 of 4 batches"):
        evaluate(model, loader, torch.device("cpu"), [lambda logits, t: seen.append(1)],
                 protocol=EvalProtocol())
    assert len(seen) == 4


def _synthetic_run(tmp_path: Path) -> tuple[Path, list[str]]:
    from cals_seg.config.schema import load_config, save_config
    from cals_seg.tasks.segmentation import build_model

    from .conftest import fake_run

    sets = [f"data.root={tmp_path / 'data'}",
            "data.synthetic={num_train: 10, num_test: 2, image_size: 32}",
            "train.amp=none", "train.threads=1", "train.progress=false", "eval.num_maps=0",
            "train.device=cpu", "model.encoder_name=tu-mobilenetv3_small_050",
            "model.params={encoder_output_stride: 16, decoder_channels: 16}"]
    cfg = load_config(ROOT / "configs" / "synthetic_deeplabv3.yaml", sets, "ce")
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        model.segmentation_head[0].weight.fill_(float("nan"))
    run = fake_run(tmp_path / "run", cfg, model=model)
    save_config(cfg, run / "config.yaml")
    return run, sets


def test_commands_end_in_one_line_on_nan_logits(tmp_path, capsys):
    """eval_seg (with and without calibrators) and predict_seg of a network with NaN weights:
    exit 2, one ``error:`` line naming the run and what to check, no traceback."""
    from PIL import Image

    from .conftest import load_tool

    run, _ = _synthetic_run(tmp_path)
    for extra in ([], ["--calibrators", "ts"]):
        capsys.readouterr()
        rc = load_tool("eval_seg").main([str(run), "--out", str(tmp_path / f"eval{len(extra)}"),
                                         *extra])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
        assert str(run) in lines[0] and "NaN or infinite logits" in lines[0]
        assert "check the network's weights" in lines[0]
    Image.new("RGB", (24, 20), (90, 120, 30)).save(tmp_path / "a.png")
    capsys.readouterr()
    rc = load_tool("predict_seg").main([str(run), str(tmp_path / "a.png"), "--out",
                                        str(tmp_path / "pred"), "--no-progress",
                                        "--no-ood-check"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert str(run) in lines[0] and "NaN or infinite logits" in lines[0]
