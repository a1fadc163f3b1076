"""Text classification: 20news reader and cleaning, tokenizer, vocabulary from train only, GloVe,
GPCN, the embedded corpus, and 2-epoch runs of the embedded configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cals_seg.config.schema import load_config
from cals_seg.data.synthetic_cls import TEXT_GROUPS, generate_synthetic_corpus
from cals_seg.data.text import (
    Vocabulary,
    clean_post,
    load_glove,
    read_newsgroups,
    tokenize,
    twenty_news_paper_split,
)
from cals_seg.metrics.groups import shot_groups
from cals_seg.models.text import GlobalPoolingCNN
from cals_seg.tasks import build_task

from .conftest import load_tool, recomputed_test_accuracy

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")

ROOT = Path(__file__).resolve().parents[1]

POST = (
    "From: someone@example.edu\nSubject: Re: engines\nLines: 6\n\n"
    "In article <1234@example.edu>, other@example.edu writes:\n"
    "> Quoted words should vanish.\n| So should these.\n"
    "The Engine's torque, 42 Nm!\n-- \nSignature words vanish too\n"
)


def test_clean_post_strips_headers_quotes_and_signature():
    text = clean_post(POST)
    assert tokenize(text) == ["the", "engine's", "torque", "42", "nm"]
    headers_only = clean_post(POST, ["headers"])
    assert "Quoted" in headers_only and "Signature" in headers_only
    assert "Subject" not in headers_only
    assert "Subject" in clean_post(POST, [])
    with pytest.raises(ValueError, match="footers"):
        clean_post(POST, ["footers"])


def test_tokenizer_is_lowercase_words():
    tokens = tokenize("Don't PANIC, 42 times!\n-- e-mail")
    assert tokens == ["don't", "panic", "42", "times", "e", "mail"]


def _news_tree(root: Path, docs: dict[str, dict[str, list[str]]]) -> Path:
    for split, groups in docs.items():
        for group, texts in groups.items():
            folder = root / f"20news-bydate-{split}" / group
            folder.mkdir(parents=True, exist_ok=True)
            for i, body in enumerate(texts):
                (folder / str(100 + i)).write_text(f"From: a@b\nSubject: s\n\n{body}\n")
    return root


def test_20news_reader_split_and_errors(tmp_path):
    train = {"alt.a": [f"alpha shared doc{i}" for i in range(6)],
             "sci.b": [f"beta shared doc{i}" for i in range(6)]}
    test = {"alt.a": ["alpha testonly"], "sci.b": ["beta"]}
    root = _news_tree(tmp_path / "news", {"train": train, "test": test})
    texts, labels, groups = read_newsgroups(root / "20news-bydate-train")
    assert groups == ["alt.a", "sci.b"] and labels == [0] * 6 + [1] * 6
    assert texts[0].strip() == "alpha shared doc0"  # header stripped
    split = twenty_news_paper_split(root, val_count=4, seed=0)
    assert len(split["train"][0]) == 8 and len(split["val"][0]) == 4 and len(split["test"][0]) == 2
    assert not set(split["train"][0]) & set(split["val"][0])
    assert twenty_news_paper_split(root, 4, seed=0)["val"] == split["val"]
    with pytest.raises(ValueError, match="val_count=12"):
        twenty_news_paper_split(root, val_count=12)

    missing = _news_tree(tmp_path / "missing", {"train": train, "test": {"alt.a": ["x"]}})
    with pytest.raises(ValueError, match="'sci.b' is missing from .*20news-bydate-test"):
        twenty_news_paper_split(missing, val_count=2)
    empty = tmp_path / "empty" / "20news-bydate-train"
    (empty / "alt.a").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"empty.20news-bydate-train holds no document"):
        read_newsgroups(empty)


def test_vocabulary_rules():
    docs = [["b", "a", "b", "c"], ["a", "b", "d"]]
    vocab = Vocabulary.build(docs)
    assert vocab.itos == ["<pad>", "<unk>", "b", "a", "c", "d"]  # frequency, then alphabetical
    assert Vocabulary.build(docs, min_freq=2).itos == ["<pad>", "<unk>", "b", "a"]
    assert Vocabulary.build(docs, max_size=3).itos == ["<pad>", "<unk>", "b"]
    ids = vocab.encode(["a", "zzz", "b"], max_len=5)
    assert ids.tolist() == [3, 1, 2, 0, 0]
    assert vocab.encode(["a"] * 9, max_len=4).tolist() == [3] * 4


def test_vocabulary_comes_from_the_training_split_only(tmp_path):
    train = {"alt.a": ["alpha common"] * 5 + ["valword"], "sci.b": ["beta common"] * 6}
    root = _news_tree(tmp_path, {"train": train, "test": {"alt.a": ["testword"], "sci.b": ["b"]}})
    overrides = [f"data.root={root}", "data.name=20news", "data.num_classes=2",
                 "data.val_count=3", "data.split_seed=0", "data.max_len=32", "data.min_freq=1"]
    cfg = load_config(ROOT / "configs" / "synthetic_text_ce.yaml", overrides)
    split = twenty_news_paper_split(root, 3, 0)
    task = build_task(cfg)
    vocab = task.train_set.vocab
    train_tokens = {t for text in split["train"][0] for t in tokenize(text)}
    assert set(vocab.itos[2:]) == train_tokens
    assert "testword" not in vocab and "subject" not in vocab  # test-only, header
    held_out_only = {t for text in split["val"][0] for t in tokenize(text)} - train_tokens
    assert not held_out_only & set(vocab.itos)
    ids, label = task.test_set[0]
    assert ids.shape == (32,) and ids[0] == 1 and label == 0  # "testword" -> <unk>


def test_glove_vectors_end_up_in_the_embedding(tmp_path):
    vocab = Vocabulary.build([["the", "cat", "zyx"]])
    glove = tmp_path / "glove.4d.txt"
    glove.write_text("the 0.1 0.2 0.3 0.4\nunused 1 1 1 1\ncat -1 0.5 0 2\n")
    weights, found = load_glove(glove, vocab, embed_dim=4, seed=0)
    assert weights.shape == (len(vocab), 4)
    assert torch.equal(weights[vocab.stoi["the"]], torch.tensor([0.1, 0.2, 0.3, 0.4]))
    assert torch.equal(weights[vocab.stoi["cat"]], torch.tensor([-1.0, 0.5, 0.0, 2.0]))
    assert found.tolist() == [False, False, True, True, False]
    assert weights[0].abs().sum() == 0  # <pad>
    unknown = weights[vocab.stoi["zyx"]]
    assert unknown.abs().sum() > 0 and torch.equal(unknown, load_glove(glove, vocab, 4)[0][4])

    model = GlobalPoolingCNN(len(vocab), 4, 3, kernel_sizes=(2,), embedding=weights, freeze=found)
    model(torch.tensor([[2, 3, 4, 0]])).sum().backward()
    grad = model.embedding.weight.grad
    assert grad[2:4].abs().sum() == 0 and grad[4].abs().sum() > 0  # GloVe rows frozen

    bad = tmp_path / "glove.bad.txt"
    bad.write_text("the 0.1 0.2 0.3 0.4\ncat 1 2 3\n")
    with pytest.raises(ValueError, match=r"glove.bad.txt, line 2: .*3 values.*embed_dim is 4"):
        load_glove(bad, vocab, embed_dim=4)
    with pytest.raises(ValueError, match=r"glove.4d.txt, line 1: .*4 values.*embed_dim is 8"):
        load_glove(glove, vocab, embed_dim=8)


def test_gpcn_shapes_and_receptive_field():
    model = GlobalPoolingCNN(50, 8, 4, channels=16, hidden=16)
    assert model.receptive_field() == 1 + 3 * 4 + 2 * 4
    assert model(torch.randint(0, 50, (3, 40))).shape == (3, 4)
    with pytest.raises(ValueError, match="receptive field"):
        model(torch.randint(0, 50, (3, 10)))


def test_synthetic_corpus_layout_and_determinism(tmp_path):
    a = generate_synthetic_corpus(tmp_path / "a", num_train=4, num_test=2)
    b = generate_synthetic_corpus(tmp_path / "b", num_train=4, num_test=2)
    files = sorted(p.relative_to(a) for p in (a / "20news-bydate-train").rglob("*") if p.is_file())
    assert len(files) == 4 * len(TEXT_GROUPS)
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    split = twenty_news_paper_split(a, val_count=6, seed=0)
    assert split["classes"] == sorted(TEXT_GROUPS)
    assert all(">" not in t and "writes:" not in t for t in split["train"][0])


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("method", ["ce", "cals_alm"])
def test_two_epoch_run_of_embedded_config(tmp_path, method, capsys):
    overrides = [
        f"name=run_{method}", f"output_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}",
        "data.synthetic={num_train: 30, num_test: 10}", "data.val_count=30", "train.epochs=2",
        "train.batch_size=16", "train.progress=false", "train.threads=1",
        "train.amp=none",  # float32, like the per-sample recomputation below
    ]
    config = ROOT / "configs" / f"synthetic_text_{method}.yaml"
    code = load_tool("train_cls").main([str(config), "--set", *overrides])
    assert code == 0, capsys.readouterr().err
    run = tmp_path / "runs" / f"run_{method}"
    for name in ("config.yaml", "history.jsonl", "checkpoint_last.pt", "checkpoint_best.pt",
                 "test_metrics.json", "plots/reliability_pre_ts.png",
                 "plots/reliability_post_ts.png", "plots/training_curves.png"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [0, 1]
    if method == "cals_alm":
        assert all(len(h["lambda"]) == len(TEXT_GROUPS) for h in history)
    test = json.loads((run / "test_metrics.json").read_text())
    counts = test["pre_ts"]["class_counts"]
    assert sum(counts) == 6 * 30 - 30
    acc, n = recomputed_test_accuracy(run)
    assert test["pre_ts"]["acc"] == pytest.approx(acc, abs=1e-12)
    assert test["post_ts"]["acc"] == pytest.approx(acc, abs=1e-12)  # T never changes the argmax
    assert test["pre_ts"]["count"] == n  # validation posts come out of train
    for key in ("pre_ts", "post_ts"):
        assert {"acc", "ece", "aece", "cwce", "nll"} <= set(test[key])
        groups = test[key]["groups"]
        assert {name: g["classes"] for name, g in groups.items()} == shot_groups(counts)
        assert groups["many"]["count"] == 0  # no group has more than 100 training posts
        assert sum(g["count"] for g in groups.values()) == 60


def test_paper_config_builds_with_glove(tmp_path):
    train = {g: [f"{g.split('.')[1]} words here {i}" for i in range(4)] for g in ("a.x", "b.y")}
    root = _news_tree(tmp_path / "news", {"train": train, "test": train})
    glove = tmp_path / "glove.txt"
    glove.write_text("words " + " ".join(["0.5"] * 100) + "\nhere " + " ".join(["-1"] * 100) + "\n")
    cfg = load_config(ROOT / "configs" / "20news_gpcn_cals_alm.yaml", [
        f"data.root={root}", "data.num_classes=2", "data.val_count=2", f"model.glove_path={glove}"])
    assert cfg.loss.params["margin"] == 6.0 and cfg.data.text_strip == ["headers"]
    task = build_task(cfg)
    vocab, model = task.train_set.vocab, task.model
    assert torch.equal(model.embedding.weight[vocab.stoi["words"]], torch.full((100,), 0.5))
    assert model.trainable_rows[vocab.stoi["here"]] == 0  # freeze_glove: true
    assert model.trainable_rows[vocab.stoi["x"]] == 1
    ids, _ = task.val_set[0]
    assert ids.shape == (1000,) and model(ids[None]).shape == (1, 2)


def test_resume_continues_and_rewrites_groups(tmp_path, capsys):
    base = [
        "name=r", f"output_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}",
        "data.synthetic={num_train: 20, num_test: 5}", "data.val_count=20", "train.batch_size=16",
        "train.progress=false", "train.threads=1",
    ]
    config = str(ROOT / "configs" / "synthetic_text_cals_alm.yaml")
    tool = load_tool("train_cls")
    assert tool.main([config, "--set", *base, "train.epochs=1"]) == 0
    run = tmp_path / "runs" / "r"
    assert tool.main([config, "--set", *base, "train.epochs=1"]) == 2  # the run exists
    assert "--resume" in capsys.readouterr().err
    assert tool.main([config, "--resume", str(run), "--set", "train.epochs=2"]) == 0
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [0, 1]
    test = json.loads((run / "test_metrics.json").read_text())
    assert "groups" in test["pre_ts"] and len(test["pre_ts"]["class_counts"]) == len(TEXT_GROUPS)
