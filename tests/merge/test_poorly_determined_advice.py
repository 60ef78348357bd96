"""What a poorly determined RegMean system's report says to do: lower alpha from the value
in use (never "lower it" to the value already in use), or, at alpha 0, nothing about alpha.
The systems: a tiny BERT's pooler with 20 statistics rows for its 16 inputs (fewer than
2 per input), poorly determined at every alpha."""

from __future__ import annotations

import hf_models as H
import pytest
from lmdx import merge_models


@pytest.mark.parametrize(
    ("alpha", "advice"),
    [
        (1.0, ", lower alpha from 1 (e.g. to 0.9: "),
        (0.9, ", lower alpha from 0.9 (e.g. to 0.8: "),
        (0.3, ", lower alpha from 0.3 (e.g. to 0.15: "),
        (0.0, " or exclude the module (alpha is 0 already: no off-diagonal to lower)"),
    ],
)
def test_the_advice_on_alpha_fits_the_alpha_in_use(alpha, advice):
    """20 rows for the pooler's 16 inputs: poorly determined at every alpha; the advice
    lowers alpha from the value in use, never to it, and not below 0."""
    _, models = H.family("bert", k=2)
    stats = [
        H.collect(m, H.random_batches("bert", 10 + i, n_sequences=20)) for i, m in enumerate(models)
    ]
    res = merge_models(
        models, "regmean", stats=stats, alpha=alpha, heads=H.HEADS["bert"], progress=False
    )
    notes = {n["module"]: n for n in res.report["poorly_determined"]}
    said = notes["bert.pooler.dense"]["advice"]
    assert said.startswith("collect statistics on more data (more texts or a longer max_length)")
    assert advice in said
    assert f"e.g. to {alpha:g}:" not in said
