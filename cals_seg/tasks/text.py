"""Text classification: ``data.name`` ``20news`` (the 20 Newsgroups layout) and
``synthetic_text`` (the embedded topic corpus), with the Global Pooling CNN."""

from __future__ import annotations

from cals_seg.config.rules import check_model_names
from cals_seg.config.schema import Config
from cals_seg.data.synthetic_cls import TEXT_GROUPS, generate_synthetic_corpus
from cals_seg.data.text import (
    TextClassification,
    Vocabulary,
    load_glove,
    tokenize,
    twenty_news_paper_split,
)
from cals_seg.errors import ConfigError
from cals_seg.models.text import GlobalPoolingCNN
from cals_seg.tasks.base import ClassificationTask, generate_embedded, register_dataset
from cals_seg.tasks.classification import check_classification_config


def text_task(cfg: Config) -> ClassificationTask:
    """20news-layout datasets at ``data.root`` (vocabulary from the training split) and the GPCN.

    ``model.params`` go to :class:`GlobalPoolingCNN`, except ``freeze_glove`` (default false):
    keep the rows found in ``model.glove_path`` fixed and train only the others.
    """
    d, m = cfg.data, cfg.model
    check_model_names(cfg)  # model.arch gpcn, model.params of its constructor
    splits = twenty_news_paper_split(d.root, d.val_count, d.split_seed, d.text_strip)
    classes = splits["classes"]
    check_classification_config(cfg, classes)
    train_texts = splits["train"][0]
    vocab = Vocabulary.build((tokenize(t) for t in train_texts), d.min_freq, d.vocab_size)
    k = d.num_classes
    sets = {
        split: TextClassification(*splits[split], vocab, d.max_len, k, classes)
        for split in ("train", "val", "test")
    }
    params = dict(m.params)
    freeze_glove = bool(params.pop("freeze_glove", False))
    embedding = found = None
    if m.glove_path is not None:
        embedding, found = load_glove(m.glove_path, vocab, m.embed_dim, seed=cfg.train.seed)
    try:
        model = GlobalPoolingCNN(
            len(vocab), m.embed_dim, k, embedding=embedding,
            freeze=found if freeze_glove else None, **params,
        )
    except TypeError as err:
        raise ConfigError(f"model.params: {err}") from err
    if d.max_len < model.receptive_field():
        raise ConfigError(
            f"data.max_len={d.max_len} is shorter than the GPCN's receptive field "
            f"({model.receptive_field()} tokens, from model.params kernel_sizes and pool_size); "
            "raise data.max_len or lower those."
        )
    return ClassificationTask(
        sets["train"], sets["val"], sets["test"], model, k, d.ignore_index, list(classes)
    )


register_dataset("20news", family="classification", kind="text")(text_task)


@register_dataset("synthetic_text", family="classification", kind="text")
def synthetic_text(cfg: Config) -> ClassificationTask:
    """The embedded topic corpus, generated at ``data.root`` when missing."""
    generate_embedded(cfg, generate_synthetic_corpus, len(TEXT_GROUPS), "the synthetic corpus")
    return text_task(cfg)
