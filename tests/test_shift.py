"""Corruptions (seeded, masks untouched, severity monotone), the shift evaluation, ensembles and
calibrators fitted for drift."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cals_seg.data.corruptions import (
    CORRUPTIONS,
    FIT_CORRUPTIONS,
    SEVERITIES,
    Corruption,
    DriftMixture,
    corrupted_dataset,
    motion_kernel,
    parse_shifts,
    plasma_fractal,
)
from cals_seg.errors import UserError

from ._commands_cheap import clean_figures_left_out, networks_built_once, seeded_networks
from .conftest import untrained_seg_run

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn), eval_seg's
# clean ones not made, and a run's network built once for all the commands loading it
# (tests/_commands_cheap.py): this file checks numbers, messages and which files are written.
pytestmark = pytest.mark.usefixtures("undrawn_figures", "cheaper_commands")


@pytest.fixture(scope="module")
def cheaper_commands():
    with networks_built_once(), clean_figures_left_out():
        yield

ROOT = Path(__file__).resolve().parents[1]
# ImageNet-C's own parameters are not monotone in PSNR for these (glass blur: severity 2 has one
# iteration, 1 and 3 two and three; pixelate: the sampling grid's phase; fog: the fractal's
# decay and the final rescaling; saturate: factors .3 .1 2 5 20): severity 5 is still the worst.
NOT_MONOTONE = {"glass_blur", "pixelate", "fog", "saturate"}


def _image(h: int = 96, w: int = 128) -> np.ndarray:
    """Smooth colour waves and two flat rectangles (edges), uint8 (h, w, 3)."""
    yy, xx = np.mgrid[:h, :w] / max(h, w)
    base = np.stack([0.5 + 0.3 * np.sin(6 * xx + 1), 0.5 + 0.3 * np.cos(5 * yy),
                     0.5 + 0.25 * np.sin(4 * (xx + yy))], -1)
    base[20:60, 30:70] = [0.9, 0.2, 0.1]
    base[50:90, 80:120] = [0.1, 0.3, 0.8]
    return (base * 255).astype(np.uint8)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10 * np.log10(255.0**2 / max(mse, 1e-12))


@pytest.mark.parametrize("name", CORRUPTIONS + FIT_CORRUPTIONS)
def test_each_corruption_is_seeded_and_keeps_the_mask(name):
    image = _image(40, 56)
    mask = np.arange(40 * 56, dtype=np.uint8).reshape(40, 56)
    for severity in SEVERITIES:
        tf = Corruption(name, severity, seed=3)
        out = tf(image=image, mask=mask, index=5)
        assert out["mask"] is mask and out["image"].shape == image.shape
        assert out["image"].dtype == np.uint8
        assert np.array_equal(out["image"], Corruption(name, severity, 3).apply(image, 5))
        assert not np.array_equal(out["image"], image)
    assert np.array_equal(image, _image(40, 56))  # the input is not modified
    random = name in ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "fog",
                      "glass_blur", "motion_blur")
    if random:  # another image index or seed draws another corruption
        a = Corruption(name, 3, 3).apply(image, 5)
        assert not np.array_equal(a, Corruption(name, 3, 3).apply(image, 6))
        assert not np.array_equal(a, Corruption(name, 3, 4).apply(image, 5))


@pytest.mark.parametrize("name", CORRUPTIONS + FIT_CORRUPTIONS)
def test_severity_lowers_the_psnr(name):
    image = _image()
    psnr = [np.mean([_psnr(image, Corruption(name, s, seed).apply(image, 0))
                     for seed in range(3)]) for s in SEVERITIES]
    if name in NOT_MONOTONE:
        assert psnr[4] < psnr[0] or name == "saturate" and psnr[4] < psnr[2]
    else:
        assert all(np.diff(psnr) < 0), psnr


def test_hand_cases():
    image = np.full((4, 4, 3), 100, np.uint8)
    image[0, 0] = (200, 40, 10)
    # contrast: (x - mean) c + mean, per channel
    x = image / 255.0
    mean = x.mean(axis=(0, 1))
    want = np.clip((x - mean) * 0.4 + mean, 0, 1) * 255
    got = Corruption("contrast", 1).apply(image, 0)
    assert np.abs(got - want).max() <= 0.5 + 1e-9
    # brightness: V + 0.5 scales every channel by V' / V (a grey pixel: 100 + 127.5)
    assert (Corruption("brightness", 5).apply(image, 0)[1, 1] == 228).all()
    # impulse noise: only 0 and 255 appear where values changed
    noisy = Corruption("impulse_noise", 5).apply(image, 0)
    changed = noisy != image
    assert changed.any() and set(np.unique(noisy[changed])) <= {0, 255}
    # the motion kernel sums to 1, starts at the centre and is one-sided
    k = motion_kernel(10, 3.0, 0.0)
    assert k.sum() == pytest.approx(1.0) and k[10, 10] == k.max() and k[10, :10].sum() == 0
    p = plasma_fractal(64, 2.0, np.random.default_rng(0))
    assert p.shape == (64, 64) and p.min() == 0 and p.max() == 1


def test_parse_shifts():
    assert [c.key for c in parse_shifts(["fog:3", "fog:3", "contrast:1"])] == \
        ["fog:3", "contrast:1"]
    assert len(parse_shifts(["all:3"])) == len(CORRUPTIONS)
    assert len(parse_shifts(["all"])) == 5 * len(CORRUPTIONS)
    for bad in ("fog", "fog:0", "fog:6", "snow:2", "speckle_noise:2", "fog:x"):
        with pytest.raises(UserError, match="--shift"):
            parse_shifts([bad])
    for name in ("gaussian_noise", "motion_blur", "jpeg_compression", "fog", "brightness",
                 "contrast"):
        assert name in CORRUPTIONS
    assert not set(FIT_CORRUPTIONS) & set(CORRUPTIONS)


# Malformed --shift items: other scripts' digits (int() reads "٣" as 3 and refuses "²" with a
# traceback), spaces, empty parts, out-of-range, non-integer and unregistered names.
BAD_SHIFTS = ["fog:²", "fog:٣", "fog:³", "fog: 3", "fog:3 ", " fog:3", "fog:", ":3", "fog", "",
              "fog:0", "fog:6", "fog:3.0", "fog:+3", "fog:-1", "fog:03", "fog:3:1", "FOG:3",
              "nope:3", "snow:2", "speckle_noise:2", "all:²", "all:0", "all:", "all:x"]
BAD_SEEDS = ["-1", "²", "٣", " 1", "1.0", "", "x", "+1", "1e3"]


def test_malformed_shifts_are_refused_in_one_line():
    for item in BAD_SHIFTS:
        with pytest.raises(UserError, match="--shift") as err:
            parse_shifts([item])
        assert "\n" not in str(err.value), item
    for seed in (-1, -100, True, 1.0):
        with pytest.raises(UserError, match="--shift-seed"):
            parse_shifts(["fog:3"], seed)
    good = {"fog:3": ["fog:3"], "all:2": [f"{n}:2" for n in CORRUPTIONS]}
    for item, keys in good.items():
        assert [c.key for c in parse_shifts([item], 7)] == keys


def test_eval_seg_refuses_malformed_shifts_before_any_work(tmp_path, capsys):
    """Through the command: each malformed --shift or --shift-seed is one error line and a
    non-zero exit, before the run is opened (nothing written)."""
    from .conftest import load_tool

    run = _tiny_run(tmp_path, "r", 0)
    eval_seg = load_tool("eval_seg")
    cases = [["--shift", item] for item in BAD_SHIFTS]
    cases += [["--shift", "fog:1", "--shift-seed", seed] for seed in BAD_SEEDS]
    cases += [["--calibrators", "ts", "--calibrator-fit-shift", "--shift-seed", "-1"]]
    for extra in cases:
        capsys.readouterr()
        assert eval_seg.main([str(run), "--out", str(tmp_path / "e"), *extra]) != 0, extra
        err = capsys.readouterr().err
        assert "Traceback" not in err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --shift"), (extra, err)
    assert not (tmp_path / "e").exists()


class _Samples(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = ["a", "b", "c"]
        self.loads = 0

    def load_image(self, sample_id: str) -> np.ndarray:
        self.loads += 1
        return _image(24, 32) + self.ids.index(sample_id)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.load_image(self.ids[i]), "mask": np.full((24, 32), i)}


def test_corrupted_dataset_and_drift_mixture():
    clean = _Samples()
    tf = Corruption("gaussian_noise", 2, seed=1)
    shifted = corrupted_dataset(clean, tf)
    for i in range(3):
        assert np.array_equal(shifted[i]["image"], tf.apply(clean[i]["image"], i))
        assert np.array_equal(shifted[i]["mask"], clean[i]["mask"])
    assert clean.load_image.__self__ is clean  # the original dataset is unchanged
    mixture = DriftMixture(seed=0)
    chosen = [mixture.choice(i) for i in range(60)]
    assert {c.name for c in chosen if c} == set(FIT_CORRUPTIONS)
    assert None in chosen and {c.severity for c in chosen if c} == set(SEVERITIES)
    drifted = corrupted_dataset(clean, mixture)
    for i in range(3):
        c = mixture.choice(i)
        want = clean[i]["image"] if c is None else c.apply(clean[i]["image"], i)
        assert np.array_equal(drifted[i]["image"], want)
    with pytest.raises(UserError, match="load_image"):
        corrupted_dataset([1, 2], tf)


def test_ensemble_is_the_mean_probability():
    from cals_seg.evaluation.ensemble import Ensemble
    from cals_seg.evaluation.inference import EvalProtocol, segment_logits

    torch.manual_seed(0)
    nets = [torch.nn.Conv2d(3, 4, 3, padding=1).double() for _ in range(3)]
    x = torch.randn(2, 3, 20, 26, dtype=torch.float64)
    probs = [torch.softmax(net(x), 1) for net in nets]
    with torch.no_grad():
        got = torch.softmax(Ensemble(nets)(x), 1).double()  # float32 log-probabilities
        want = sum(probs) / 3
        assert torch.allclose(got, want, atol=1e-6)
        # one member: the run's probabilities under any protocol (tiles, resize)
        for protocol in (EvalProtocol(), EvalProtocol(mode="slide", window=12, stride=7),
                         EvalProtocol(resize=13)):
            one = segment_logits(Ensemble(nets[:1]).float(), x.float(), protocol)
            ref = segment_logits(nets[0].float(), x.float(), protocol)
            assert torch.allclose(torch.softmax(one, 1), torch.softmax(ref, 1), atol=1e-5)


def test_different_protocols_are_refused():
    from cals_seg.evaluation.ensemble import check_members, protocol_of
    from cals_seg.evaluation.inference import EvalProtocol

    a = protocol_of({"data": {"name": "voc", "num_classes": 21}}, EvalProtocol())
    check_members(["r1", "r2"], [a, dict(a)])
    b = protocol_of({"data": {"name": "voc", "num_classes": 21}}, EvalProtocol(resize=512))
    with pytest.raises(UserError, match="r2 has eval protocol"):
        check_members(["r1", "r2"], [a, b])


def test_a_member_given_twice_is_refused(tmp_path: Path):
    """The same network twice, by path or by content (a byte copy), is refused naming both
    files; different bytes are different networks."""
    import shutil

    from cals_seg.evaluation.ensemble import check_members, protocol_of
    from cals_seg.evaluation.inference import EvalProtocol

    a = protocol_of({"data": {"name": "voc", "num_classes": 21}}, EvalProtocol())
    files = []
    for i in range(3):
        files.append(tmp_path / f"{i}.pt")
        files[-1].write_bytes(bytes([i]) * 64)
    check_members(["r1", "r2", "r3"], [a, a, a], files)
    copy = tmp_path / "copy" / "0.pt"
    copy.parent.mkdir()
    shutil.copyfile(files[0], copy)
    (tmp_path / "link").symlink_to(tmp_path)
    for order in ([files[0], files[1], files[0]], [files[1], files[1], files[2]],
                  [files[0], files[1], copy], [files[2], tmp_path / "link" / "2.pt", files[1]]):
        with pytest.raises(UserError, match="same network .*give each member once") as err:
            check_members(["r1", "r2", "r3"], [a, a, a], order)
        assert "\n" not in str(err.value)
        if copy in order:
            assert str(files[0]) in str(err.value) and str(copy) in str(err.value)


def _tiny_run(tmp_path: Path, name: str, seed: int, extra: tuple[str, ...] = ()) -> Path:
    """A random-weight run (conftest.untrained_seg_run) of 20 training and 3 test images; the
    data folder is shared by the runs of one test."""
    with seeded_networks():
        return untrained_seg_run(tmp_path / name, tmp_path / "data", seed, [
            "data.synthetic={num_train: 20, num_test: 3, image_size: 32}", *extra])


def test_eval_seg_shift_ensemble_and_drift_fit(tmp_path, capsys):
    from .conftest import load_tool

    eval_seg = load_tool("eval_seg")
    r1, r2 = _tiny_run(tmp_path, "r1", 0), _tiny_run(tmp_path, "r2", 1)
    out = tmp_path / "e1"
    assert eval_seg.main([str(r1), "--out", str(out), "--shift", "fog:1", "contrast:5",
                          "--calibrators", "ts", "--calibrator-fit-shift"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert list(m["shift"]) == ["fog:1", "contrast:5"]
    for entry in m["shift"].values():
        assert set(entry["pre_ts"]) == set(m["pre_ts"])
        assert set(entry["calibrators"]) == {"ts", "ts+drift"}
        assert entry["temperature"] == m["temperature"]
    assert m["shift"]["contrast:5"]["pre_ts"]["ece"] != m["pre_ts"]["ece"]
    # --out elsewhere: the drift fits live with the evaluation, the run's own are left alone
    assert (out / "calibrators" / "drift_s0" / "ts.pt").is_file()
    assert not (r1 / "calibrators" / "drift_s0").exists()
    assert m["calibrator_fits"]["ts+drift"]["fitted_for"]["after"].endswith("seed 0")
    assert "mean at severity 5" in (out / "shift.md").read_text()
    # another corruption seed: another drift fit (its own file), never the seed-0 one
    assert eval_seg.main([str(r1), "--out", str(out), "--shift", "fog:1", "--shift-seed", "1",
                          "--calibrators", "ts", "--calibrator-fit-shift"]) == 0
    m1 = json.loads((out / "metrics.json").read_text())
    assert m1["calibrator_fits"]["ts+drift"]["loaded"] is False
    assert m1["calibrator_fits"]["ts+drift"]["fitted_for"]["after"].endswith("seed 1")
    assert (out / "calibrators" / "drift_s1" / "ts.pt").is_file()
    assert m1["shift"]["fog:1"]["pre_ts"]["ece"] != m["shift"]["fog:1"]["pre_ts"]["ece"]
    # the ensemble of one run is the run
    ens = tmp_path / "ens1"
    assert eval_seg.main([str(r1), "--ensemble", "--out", str(ens)]) == 0
    one = json.loads((ens / "metrics.json").read_text())
    for key in ("ece", "nll", "miou", "ece_band_weighted"):
        assert one["pre_ts"][key] == pytest.approx(m["pre_ts"][key], abs=1e-5)
    assert one["ensemble"]["size"] == 1
    # two runs: an ensemble; without --ensemble refused
    assert eval_seg.main([str(r1), str(r2), "--ensemble", "--out", str(tmp_path / "e2")]) == 0
    assert json.loads((tmp_path / "e2" / "metrics.json").read_text())["ensemble"]["size"] == 2
    capsys.readouterr()
    assert eval_seg.main([str(r1), str(r2), "--out", str(tmp_path / "e3")]) != 0
    assert "--ensemble" in capsys.readouterr().err
    r3 = _tiny_run(tmp_path, "r3", 2, ("eval.resize=48",))
    assert eval_seg.main([str(r1), str(r3), "--ensemble", "--out", str(tmp_path / "e4")]) != 0
    err = capsys.readouterr().err
    assert "eval protocol" in err and len(err.strip().splitlines()) == 1
    # the same network twice (as its folder and as its checkpoint file): refused, nothing written
    twice = [str(r1), str(r2), str(r1 / "checkpoint_best.pt")]
    assert eval_seg.main([*twice, "--ensemble", "--out", str(tmp_path / "e5")]) != 0
    err = capsys.readouterr().err
    assert "same network" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "e5" / "metrics.json").exists()


def test_mean_entropy_flag_against_loops():
    from cals_seg.evaluation.ood import MeanEntropy, entropy_limit, flagged_rate

    torch.manual_seed(0)
    logits = torch.randn(3, 4, 5, 6, dtype=torch.float64) * 3
    ref = MeanEntropy(temperature=1.5)
    ref.update(logits[:2].float(), None, None)
    ref.update(logits[2:].float(), None, None)
    for n in range(3):
        total = 0.0
        for i in range(5):
            for j in range(6):
                z = [float(v) / 1.5 for v in logits[n, :, i, j]]
                m = max(z)
                e = [np.exp(v - m) for v in z]
                p = [v / sum(e) for v in e]
                total -= sum(q * np.log(q) for q in p)
        assert ref.values[n] == pytest.approx(total / 30, rel=1e-5)
    values = [0.1, 0.2, 0.3, 0.4]
    assert entropy_limit(values, 0.5) == pytest.approx(0.25)
    assert flagged_rate([0.1, 0.5, 0.9], 0.4) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no validation"):
        entropy_limit([])


def test_predict_seg_warns_far_from_validation(tmp_path, capsys):
    from PIL import Image

    from .conftest import load_tool

    run = _tiny_run(tmp_path, "r", 0)
    assert load_tool("eval_seg").main([str(run), "--out", str(tmp_path / "e"), "--shift",
                                       "gaussian_noise:5"]) == 0
    flag = json.loads((tmp_path / "e" / "metrics.json").read_text())["entropy_flag"]
    assert set(flag["rates"]) == {"gaussian_noise:5"} and 0 <= flag["clean_rate"] <= 1
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(_image(32, 32)).save(images / "a.png")
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(images / "b.png")
    out = tmp_path / "pred"
    assert load_tool("predict_seg").main([str(run), str(images), "--out", str(out),
                                          "--no-progress", "--temperature", "1"]) == 0
    saved = json.loads(next((run / "calibrators").glob("entropy_p99_T1.0000.json")).read_text())
    lines = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    err = capsys.readouterr().err
    for line in lines:
        far = line["mean_entropy"] > saved["limit_nats"]
        assert line["far_from_validation"] == far
        assert (f"{line['input']}: mean predictive entropy" in err) == far


ENTROPY_BROKEN = {
    "not json": lambda text, d: "abc",
    "a string": lambda text, d: '"abc"',
    "a list": lambda text, d: "[]",
    "truncated": lambda text, d: text[: len(text) // 2],
    "limit NaN": lambda text, d: {**d, "limit_nats": "NaN"},
    "limit text": lambda text, d: {**d, "limit_nats": "x"},
    "limit negative": lambda text, d: {**d, "limit_nats": -1.0},
    "limit inf": lambda text, d: text.replace(f'"limit_nats": {d["limit_nats"]!r}',
                                              '"limit_nats": Infinity'),
    "quantile 2": lambda text, d: {**d, "quantile": 2},
    "images 0": lambda text, d: {**d, "images": 0},
    "images true": lambda text, d: {**d, "images": True},
    "no record": lambda text, d: {k: v for k, v in d.items() if k != "fitted_for"},
    "record text": lambda text, d: {**d, "fitted_for": "x"},
}


def _other(value):
    if isinstance(value, bool) or value is None:
        return "changed"
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    return {**value, "changed": 1} if isinstance(value, dict) else [*value, 1]


def test_entropy_reference_is_validated_and_recorded(tmp_path, capsys):
    """predict_seg's far-from-validation statistic: saved with what it was computed for,
    reused only for that (recomputed when the validation images can be read, refused in one
    line when not), and every broken file is one line naming it and the fix."""
    from PIL import Image

    from cals_seg.runs.run import load_run
    from cals_seg.utils.fits import file_digest

    from .conftest import load_tool

    run = _tiny_run(tmp_path, "r", 0)
    load_run(run, with_data=True)  # the embedded data, generated on first use
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(_image(32, 32)).save(images / "a.png")
    predict = load_tool("predict_seg")

    def call(out: str, *extra: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = predict.main([str(run), str(images), "--out", str(tmp_path / out),
                             "--no-progress", "--temperature", "1", *extra])
        got = capsys.readouterr()
        return code, got.out, got.err

    def error_line(err: str) -> str:
        assert "Traceback" not in err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1, err
        return lines[0]

    assert call("p0")[0] == 0
    path = run / "calibrators" / "entropy_p99_T1.0000.json"
    text = path.read_text()
    saved = json.loads(text)
    record = saved["fitted_for"]
    assert record["network"] == file_digest(run / "checkpoint_best.pt")
    assert record["name"] == "T1.0000" and record["classes"]["num_classes"] == 11
    assert record["kind"] == "entropy" and "ids" in record
    path.write_text("{")  # damaged, the validation images readable: recomputed, said
    code, out, _ = call("remade")
    assert code == 0 and path.name in out and "recomputing" in out
    assert json.loads(path.read_text())["fitted_for"] == record
    data = tmp_path / "data"
    data.rename(tmp_path / "data.away")  # they cannot be read: every damage refused
    for i, (name, make) in enumerate(ENTROPY_BROKEN.items()):
        broken = make(text, saved)
        assert broken != text, name
        path.write_text(broken if isinstance(broken, str) else json.dumps(broken))
        code, _, err = call(f"b{i}")
        line = error_line(err)
        assert code != 0 and str(path) in line and "--no-ood-check" in line, (name, line)
        if i == 0:  # the way out named works (it never reads the file: once for every damage)
            assert call(f"n{i}", "--no-ood-check")[0] == 0
    (tmp_path / "data.away").rename(data)
    # each recorded field changed: recomputed, the record restored
    for key in sorted(record):
        path.write_text(json.dumps({**saved, "fitted_for": {**record, key: _other(record[key])}}))
        code, out, _ = call(f"r{key}")
        assert code == 0 and key in out and "recomputing" in out, key
        assert json.loads(path.read_text())["fitted_for"] == record
    # without the validation images: the matching file is used, a different one refused
    root = tmp_path / "data"
    root.rename(tmp_path / "data.away")
    root.write_text("not a folder")
    try:
        assert call("u0")[0] == 0
        for key in sorted(set(record) - {"ids"}):
            path.write_text(json.dumps({**saved,
                                        "fitted_for": {**record, key: _other(record[key])}}))
            code, _, err = call(f"u{key}")
            line = error_line(err)
            assert code != 0 and str(path) in line and key in line, key
        path.unlink()
        code, _, err = call("u1")  # no file and no data: no check, said, the images predicted
        assert code == 0 and "no far-from-validation check" in err
    finally:
        root.unlink()
        (tmp_path / "data.away").rename(root)


def _metrics(ece: float) -> dict:
    return {"ece": ece, "ece_band_weighted": 2 * ece, "nll": ece, "miou": 0.5,
            "ece_band": [3 * ece, ece / 2]}


def test_severity_means_tables_and_curves(tmp_path):
    from cals_seg.evaluation.shift import severity_means, shift_table
    from cals_seg.training.tables import shift_records, write_shift_results

    result = {"pre_ts": _metrics(0.1), "post_ts": _metrics(0.05), "temperature": 1.2,
              "shift": {"fog:1": {"pre_ts": _metrics(0.2), "post_ts": _metrics(0.1)},
                        "contrast:1": {"pre_ts": _metrics(0.4), "post_ts": _metrics(0.3)},
                        "fog:5": {"pre_ts": _metrics(0.6), "post_ts": _metrics(0.5)}}}
    means = severity_means(result["shift"])
    assert means[1]["uncalibrated"]["ece"] == pytest.approx(0.3)
    assert means[1]["ts (the run's T)"]["ece_band_weighted"] == pytest.approx(0.4)
    assert means[5]["uncalibrated"]["ece"] == pytest.approx(0.6)
    assert means[1]["uncalibrated"]["ece_boundary"] == pytest.approx(0.9)
    assert means[1]["uncalibrated"]["ece_interior"] == pytest.approx(0.15)
    table = shift_table(result["shift"], clean=result)
    assert "| mean at severity 1 | uncalibrated | 30.00 | 60.00 | 90.00 | 15.00 |" in table
    assert "| clean | uncalibrated | 10.00 |" in table
    # compare's curves and summary (OUT/shift.md, shift_ece_severity.png): clean, then the
    # mean over the corruptions at each severity
    curve = {r["severity"]: r["ece_mean"] for r in shift_records({"ce": [result]})
             if r["calibration"] == "uncalibrated" and (
                 r["corruption"] == "clean" or r["corruption"].startswith("mean at"))}
    assert curve == {0: 0.1, 1: pytest.approx(0.3), 5: 0.6}
    write_shift_results(tmp_path, {"ce": [result]})
    line = [x for x in (tmp_path / "shift.md").read_text().splitlines()
            if x.startswith("| ce | uncalibrated | clean |")][0]
    assert line == "| ce | uncalibrated | clean | 20.00 | 60.00 | 120.00 | 10.00 | 30.00 | 60.00 |"
    assert (tmp_path / "shift_ece_severity.png").stat().st_size > 0
