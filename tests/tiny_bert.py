"""A tiny BERT with a word-piece tokenizer built from a vocabulary written here (nothing
is downloaded): the real Hugging Face encoder path on a model small enough for tests;
fine-tuned stand-ins of it saved as model folders, and random texts over its words."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

WORDS = (
    "the a cat dog sat on mat ran fast slow big small red blue green house tree and "
    "under over quickly bird sang"
).split()


def build_tiny_bert(folder: Path) -> Path:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s", "##ed", ".", "!", ";"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    wordpiece = Tokenizer(models.WordPiece.from_file(str(folder / "vocab.txt"), unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=wordpiece,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def random_texts(rng: Any, n: int, max_words: int = 14) -> list[str]:
    """``n`` texts of 2 to ``max_words - 1`` words drawn from :data:`WORDS` by ``rng``."""
    return [" ".join(rng.choice(WORDS, size=rng.integers(2, max_words))) for _ in range(n)]


def save_classifiers(root: Path, names: Sequence[str], *, scale: float = 0.05) -> None:
    """A tiny BERT sequence classifier (2 labels, seeded) saved as ``root/base`` and one
    copy per name, every parameter moved by seeded noise of ``scale``, saved as
    ``root/<name>``; every folder with the tokenizer."""
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, BertForSequenceClassification

    tiny = build_tiny_bert(root / "tokenizer-source")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    torch.manual_seed(1)
    base = BertForSequenceClassification.from_pretrained(str(tiny), num_labels=2)
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    gen = torch.Generator().manual_seed(2)
    for name in names:
        model = BertForSequenceClassification.from_pretrained(str(root / "base"))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=gen))
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
