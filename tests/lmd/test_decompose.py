"""The LMD front door (lmdx.Decomposition): what each fit needs, warnings and errors."""

from __future__ import annotations

import lmdx
import numpy as np
import pytest
from lmd_reference import decomposition, three_splits


def test_test_split_is_optional_and_validation_only_needed_for_a_grid(rng):
    data = three_splits(rng, [100, 30, 30], [2, 2])
    dec = decomposition(["a", "b"], {"train": data["train"]})
    res = dec.fit(ridge=0.1)
    assert set(res.pairwise[0].r2) == {"train"}
    assert np.isnan(res.r2_target_by_basis("test")).all()
    with pytest.raises(ValueError, match=r"split 'validation' is empty.*ridge="):
        dec.fit()


def test_warns_when_train_rows_are_few_per_basis_dimension(rng):
    data = three_splits(rng, [30, 20, 20], [2, 4, 4])
    dec = decomposition(["a", "b", "c"], data)
    with pytest.warns(lmdx.SampleSizeWarning, match=r"n_train = 30 .* D_z = 8"):
        fit = dec.fit_one("a", ["b", "c"], ridge=0.1)
    assert fit.r2["train"] > fit.r2["test"]  # the optimism the warning is about
    with pytest.warns(lmdx.SampleSizeWarning) as record:
        res = dec.fit(ridge=0.1)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert "pairwise" in messages[0] and "D_z = 4" in messages[0]
    assert "group" in messages[1] and "D_z = 8" in messages[1]
    assert list(res.warnings) == messages
    dec.fit_one("b", "a", ridge=0.1)  # 30 rows for D_z = 2: no warning (warnings are errors)


@pytest.mark.filterwarnings("ignore::lmdx.SampleSizeWarning")
def test_bad_inputs_give_clear_errors(rng):
    dec = lmdx.Decomposition(["bert", "gpt2"], [3, 2])
    good = [rng.standard_normal((5, 3)), rng.standard_normal((5, 2))]
    with pytest.raises(ValueError, match=r"model 'gpt2' has 4 rows but model 'bert' has 5"):
        dec.add("train", [good[0], good[1][:4]])
    nan = good[1].copy()
    nan[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"split 'train', model 'gpt2'.*NaN or Inf.*row 2"):
        dec.add("train", [good[0], nan])
    with pytest.raises(ValueError, match=r"unknown split 'dev'"):
        dec.add("dev", good)
    with pytest.raises(ValueError, match=r"model 'bert': expected embeddings of shape \(n, 3\)"):
        dec.add("test", [good[0][:, :2], good[1]])
    with pytest.raises(ValueError, match=r"expected 2 arrays \(one per model: bert, gpt2\)"):
        dec.add("train", good[:1])
    with pytest.raises(ValueError, match=r"missing \['gpt2'\]"):
        dec.add("train", {"bert": good[0]})
    with pytest.raises(ValueError, match=r"split 'train' is empty"):
        dec.fit(ridge=0.1)
    assert dec.counts == {"train": 0, "validation": 0, "test": 0}  # nothing partial was added

    dec.add("train", [g[:1] for g in good])
    with pytest.raises(ValueError, match=r"split 'train' has 1 row"):
        dec.fit(ridge=0.1)
    dec.add("train", good)
    with pytest.raises(ValueError, match=r"unknown model 'gpt3'"):
        dec.fit_one("gpt3", "bert", ridge=0.1)
    with pytest.raises(ValueError, match=r"in both target and basis"):
        dec.fit_one("bert", ["bert", "gpt2"], ridge=0.1)
    with pytest.raises(ValueError, match=r"either ridge .* or ridge_grid"):
        dec.fit(ridge=0.1, ridge_grid=[0.1])
    with pytest.raises(ValueError, match=r"mode='compat' uses the reference's absolute alpha"):
        dec.fit(mode="compat", ridge=0.1)
    with pytest.raises(ValueError, match=r"ridge_grid: is empty"):
        dec.fit(ridge_grid=[])
    with pytest.raises(ValueError, match=r"ridge values must be finite and >= 0"):
        dec.fit(ridge=-1.0)
    with pytest.raises(ValueError, match=r"unknown split 'dev'"):
        dec.fit(ridge=0.1).r2_target_by_basis("dev")
    with pytest.raises(ValueError, match=r"model 'bert' is listed twice"):
        lmdx.Decomposition(["bert", "bert"], [3, 3])
    with pytest.raises(ValueError, match=r"need at least two models"):
        lmdx.Decomposition(["bert"], [3]).fit()
