"""The shared helpers of lmdx._util."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lmdx._util import matches, parse_size, split_in_order


@given(st.lists(st.integers(0, 50), max_size=40), st.integers(1, 100))
def test_split_in_order_is_greedy_consecutive_and_bounded(sizes, limit):
    parts = split_in_order(sizes, limit)
    assert [i for p in parts for i in p] == list(range(len(sizes)))
    for j, part in enumerate(parts):
        total = sum(sizes[i] for i in part)
        assert total <= limit or len(part) == 1
        if j + 1 < len(parts):  # the next part's first item did not fit here
            assert part and total + sizes[parts[j + 1][0]] > limit


def test_parse_size_and_matches():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("64KB") == 64_000 and parse_size(7) == 7
    with pytest.raises(ValueError, match=r"expected e\.g\. '2GB'"):
        parse_size("big")
    assert matches("bert.pooler.dense", ["*.pooler.*"]) and not matches("x", None)
