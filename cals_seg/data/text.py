"""Text classification data: 20 Newsgroups ("bydate" layout), tokenizer, vocabulary, GloVe.

Layout: ``<root>/20news-bydate-train/<group>/<doc>`` and ``<root>/20news-bydate-test/...``
(the unmodified ``20news-bydate.tar.gz``). Classes are the sorted group folders of the training
split; the test split must have the same groups.

Cleaning (:func:`clean_post`, each step switched by ``strip``):

- ``headers``: everything up to the first blank line (``From:``, ``Subject:``, ``Lines:`` ...)
  is dropped; a post without a blank line is all header and becomes empty.
- ``quotes``: lines starting with ``>`` or ``|`` (quoted text) and attribution lines (starting
  with ``In article`` or ending with ``writes:`` / ``wrote:``) are dropped.
- ``signature``: everything from the last line that is ``--`` (usually ``-- ``) to the end.

Tokenizer: lowercase, then the regular expression ``[a-z0-9]+(?:'[a-z]+)?`` (words, numbers and
contractions such as ``don't``); punctuation separates tokens and is dropped.

Vocabulary: built from the training split only (never validation or test): ``<pad> = 0``,
``<unk> = 1``, then the tokens seen at least ``min_freq`` times, most frequent first (ties in
alphabetical order), at most ``max_size`` entries in all. A document becomes its first
``max_len`` token ids, right-padded with ``<pad>``.

The paper's split (appendix: 15,098 / 900 / 3,999 documents) comes from Mukhoti et al.'s random
80 / 20 split of the 19,997-post ``20_newsgroups`` archive; the bydate layout read here has
11,314 training and 7,532 test posts, of which 900 random training posts (fixed seed) are the
validation set, leaving 10,414 for training.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from cals_seg.data.classification import class_subfolders
from cals_seg.errors import DataError, MissingPathError

PAD, UNK = "<pad>", "<unk>"
STRIP_STEPS = ("headers", "quotes", "signature")
TOKEN_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_ATTRIBUTION_RE = re.compile(r"^in article|(writes|wrote):\s*$", re.IGNORECASE)


# ----------------------------------------------------------------------------- cleaning
def clean_post(text: str, strip: Iterable[str] = STRIP_STEPS) -> str:
    """Remove headers, quoted lines and the signature of a news post (module docstring).

    Args:
        text: the raw post.
        strip: a subset of ``("headers", "quotes", "signature")``.

    Raises:
        ValueError: an unknown step name.
    """
    strip = tuple(strip)
    unknown = sorted(set(strip) - set(STRIP_STEPS))
    if unknown:
        raise DataError(f"Unknown text_strip step(s) {unknown}; valid steps are {STRIP_STEPS}.")
    lines = text.replace("\r\n", "\n").split("\n")
    if "headers" in strip:
        blank = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
        lines = lines[blank + 1:]
    if "signature" in strip:
        marks = [i for i, line in enumerate(lines) if line.rstrip() == "--"]
        if marks:
            lines = lines[: marks[-1]]
    if "quotes" in strip:
        lines = [
            line
            for line in lines
            if not line.lstrip().startswith((">", "|")) and not _ATTRIBUTION_RE.search(line.strip())
        ]
    return "\n".join(lines)


def tokenize(text: str) -> list[str]:
    """Lowercase word tokens: ``tokenize("Don't PANIC, 42!") == ["don't", "panic", "42"]``."""
    return TOKEN_RE.findall(text.lower())


# ----------------------------------------------------------------------------- reading
def _read_text(path: Path) -> str:
    # 20news posts are mostly ASCII with some Latin-1; latin-1 never fails to decode.
    return path.read_bytes().decode("latin-1")


def read_newsgroups(
    folder: str | os.PathLike,
    groups: Sequence[str] | None = None,
    strip: Iterable[str] = STRIP_STEPS,
) -> tuple[list[str], list[int], list[str]]:
    """Read ``folder/<group>/<doc>`` posts.

    Args:
        folder: e.g. ``<root>/20news-bydate-train``.
        groups: the groups expected (those of the training split); ``None``: the sorted
            sub-folders found.
        strip: cleaning steps (:func:`clean_post`).

    Returns:
        ``(texts, labels, groups)``: cleaned texts, labels indexing ``groups``.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ValueError: no document at all, or a group missing from / extra in this split (the
            message names the folder).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise MissingPathError(f"Newsgroups folder {folder} does not exist.")
    groups = class_subfolders(folder, groups, what="group")
    texts, labels = [], []
    for label, group in enumerate(groups):
        docs = sorted(
            (e for e in os.scandir(folder / group) if e.is_file() and not e.name.startswith(".")),
            key=lambda e: (len(e.name), e.name),  # numeric names in numeric order
        )
        for entry in docs:
            texts.append(clean_post(_read_text(Path(entry.path)), strip))
            labels.append(label)
    if not texts:
        raise DataError(f"{folder} holds no document (expected <group>/<doc> files).")
    return texts, labels, groups


def twenty_news_paper_split(
    root: str | os.PathLike,
    val_count: int = 900,
    seed: int = 0,
    strip: Iterable[str] = STRIP_STEPS,
) -> dict[str, object]:
    """Train / val / test of the 20news-bydate layout: ``val_count`` random training posts
    (fixed ``seed``) are the validation set, the bydate test split is the test set.

    Returns:
        ``{"train", "val", "test": (texts, labels), "classes": groups}``.

    Raises:
        ValueError: ``val_count`` not smaller than the number of training posts, or any error of
            :func:`read_newsgroups`.
    """
    root = Path(root)
    strip = tuple(strip)
    texts, labels, groups = read_newsgroups(root / "20news-bydate-train", None, strip)
    test = read_newsgroups(root / "20news-bydate-test", groups, strip)[:2]
    if not 0 < val_count < len(texts):
        raise DataError(
            f"data.val_count={val_count}: expected between 1 and {len(texts) - 1} "
            f"(the training split has {len(texts)} documents)."
        )
    held = np.zeros(len(texts), dtype=bool)
    held[np.random.default_rng(seed).choice(len(texts), size=val_count, replace=False)] = True
    keep = np.flatnonzero(~held)
    val = np.flatnonzero(held)
    return {
        "train": ([texts[i] for i in keep], [labels[i] for i in keep]),
        "val": ([texts[i] for i in val], [labels[i] for i in val]),
        "test": test,
        "classes": groups,
    }


# ----------------------------------------------------------------------------- vocabulary
class Vocabulary:
    """Token <-> id map with ``<pad> = 0`` and ``<unk> = 1`` (module docstring).

    Args:
        tokens: the vocabulary in id order, starting with ``<pad>``, ``<unk>``.
    """

    def __init__(self, tokens: Sequence[str]) -> None:
        if list(tokens[:2]) != [PAD, UNK]:
            raise ValueError(f"Expected the vocabulary to start with {PAD!r}, {UNK!r}.")
        self.itos = list(tokens)
        self.stoi = {t: i for i, t in enumerate(self.itos)}

    @classmethod
    def build(
        cls, documents: Iterable[Sequence[str]], min_freq: int = 1, max_size: int | None = None
    ) -> Vocabulary:
        """From tokenised training documents: tokens with count >= ``min_freq``, most frequent
        first (ties alphabetical), at most ``max_size`` entries including the two specials."""
        if min_freq < 1:
            raise ValueError(f"Expected `min_freq` >= 1, but got {min_freq}.")
        if max_size is not None and max_size < 2:
            raise ValueError(f"Expected `max_size` >= 2 (the specials), but got {max_size}.")
        counts = Counter(t for doc in documents for t in doc)
        counts.pop(PAD, None)
        counts.pop(UNK, None)
        kept = (t for t, c in counts.items() if c >= min_freq)
        ranked = sorted(kept, key=lambda t: (-counts[t], t))
        if max_size is not None:
            ranked = ranked[: max_size - 2]
        return cls([PAD, UNK, *ranked])

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, token: str) -> bool:
        return token in self.stoi

    def encode(self, tokens: Sequence[str], max_len: int) -> Tensor:
        """The first ``max_len`` ids (``<unk>`` for unknown tokens), right-padded with 0.

        Shape:
            output ``(max_len,)`` int64.
        """
        ids = [self.stoi.get(t, 1) for t in tokens[:max_len]]
        out = torch.zeros(max_len, dtype=torch.int64)
        out[: len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
        return out


class TextClassification(Dataset):
    """``(token ids, label)`` items; documents are encoded once, at construction.

    Args:
        texts: cleaned documents.
        labels: labels in ``[0, num_classes)``.
        vocab: the vocabulary of the training split.
        max_len: tokens per item.
        num_classes: K.
        class_names: display names.

    Shape:
        item: ``ids (max_len,)`` int64, ``label`` int.
    """

    def __init__(
        self,
        texts: Sequence[str],
        labels: Sequence[int],
        vocab: Vocabulary,
        max_len: int,
        num_classes: int,
        class_names: Sequence[str] | None = None,
    ) -> None:
        if len(texts) != len(labels):
            raise ValueError(f"Got {len(texts)} texts but {len(labels)} labels.")
        if max_len < 1:
            raise ValueError(f"Expected `max_len` >= 1, but got {max_len}.")
        bad = [y for y in labels if not 0 <= y < num_classes]
        if bad:
            raise DataError(f"Label {bad[0]} is outside [0, {num_classes}).")
        self.vocab = vocab
        self.ids = torch.stack([vocab.encode(tokenize(t), max_len) for t in texts])
        self.labels = list(labels)
        self.num_classes = num_classes
        self.class_names = list(class_names or [f"class {k}" for k in range(num_classes)])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.ids[index], self.labels[index]

    @property
    def targets(self) -> list[int]:
        return list(self.labels)

    def class_counts(self) -> list[int]:
        """Number of documents of each class (length K)."""
        return np.bincount(self.labels, minlength=self.num_classes).tolist()


# ----------------------------------------------------------------------------- GloVe
def load_glove(
    path: str | os.PathLike, vocab: Vocabulary, embed_dim: int, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """Embedding matrix for ``vocab`` from a GloVe ``.txt`` file (``word v1 ... vd`` per line).

    Rows of words found in the file are their GloVe vectors; other rows (``<unk>`` included)
    are drawn from ``N(0, s^2)`` with ``s`` the standard deviation of the loaded vectors (0.1
    when none was found), from a generator seeded with ``seed``; ``<pad>`` is zero. Every line
    must have exactly ``embed_dim`` values (words containing spaces, as in a few lines of
    ``glove.840B``, are not supported); only the vectors of vocabulary words are parsed.

    Returns:
        ``(weights, found)``: float32 ``(V, embed_dim)`` and bool ``(V,)``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line whose vector length is not ``embed_dim``, or an unparsable number
            (the message names the file and the line).
    """
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"GloVe file {path} does not exist (model.glove_path).")
    v = len(vocab)
    weights = torch.zeros(v, embed_dim, dtype=torch.float32)
    found = torch.zeros(v, dtype=torch.bool)
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip()
            if not line:
                continue
            values = line.count(" ")
            if values != embed_dim:
                raise DataError(
                    f"{path}, line {number}: the vector has {values} values but "
                    f"model.embed_dim is {embed_dim}."
                )
            word, rest = line.split(" ", 1)
            index = vocab.stoi.get(word)
            if index is None or index < 2:
                continue
            try:
                weights[index] = torch.tensor([float(x) for x in rest.split(" ")])
            except ValueError as err:
                raise DataError(f"{path}, line {number}: {err}") from err
            found[index] = True
    std = float(weights[found].std()) if int(found.sum()) > 1 else 0.1
    generator = torch.Generator().manual_seed(seed)
    random_rows = torch.randn(v, embed_dim, generator=generator) * std
    weights = torch.where(found.unsqueeze(1), weights, random_rows)
    weights[0] = 0.0
    return weights, found
