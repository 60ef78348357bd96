"""What a RegMean merge says about its systems: the poorly determined ones with what to do
(too few statistics rows per input, a large condition estimate, directions below the
statistics' noise floor that keep the average), none where the weights are equal, and the
precision option reaching every solve."""

from __future__ import annotations

import hf_models as H
import pytest
from lmdx import MergeError, merge_models
from lmdx.merge.builtin.regmean_solve import noise_floor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_poorly_determined_systems_are_reported_with_what_to_do():
    # The pooler sees one row per sequence ([CLS]): 20 sequences give 20 rows for its 16
    # inputs, fewer than 2 per input; the encoder's layers see every real token.
    _, models = H.family("bert", k=2)
    stats = [
        H.collect(m, H.random_batches("bert", 10 + i, n_sequences=20)) for i, m in enumerate(models)
    ]
    res = merge_models(models, "regmean", stats=stats, heads=H.HEADS["bert"], progress=False)
    notes = {n["module"]: n for n in res.report["poorly_determined"]}
    pooler = notes["bert.pooler.dense"]
    assert pooler["rows"] == 20 and pooler["dim"] == H.HIDDEN
    assert f"20 statistics rows for {H.HIDDEN} inputs" in pooler["why"]
    assert "more data" in pooler["advice"] and "lower alpha" in pooler["advice"]
    layers = res.report["layers"]
    for module, info in layers.items():
        if info["shared_with"] is not None:
            continue
        few_rows = info["rows"] < 2 * info["dim"]
        condition = info["condition_estimate"] or 1 / info["rcond_estimate"]
        expected = few_rows or condition >= 1e6 or info["attempts"] > 1
        assert (module in notes) == expected, module
    assert any(not n.startswith("bert.pooler") for n in layers)  # the encoder was solved
    assert len(notes) < len([m for m, v in layers.items() if v["shared_with"] is None])


def test_a_model_merged_with_itself_reports_no_poorly_determined_system():
    """Nothing is solved where the weights are equal in every model: whatever the
    statistics (here 20 rows for the pooler's 16 inputs), no system is reported."""
    _, models = H.family("bert", k=2)
    stats = H.collect(models[0], H.random_batches("bert", 10, n_sequences=20))
    res = merge_models(
        [models[0], models[0]], stats=[stats, stats], heads=H.HEADS["bert"], progress=False
    )
    assert {v["precision"] for v in res.report["layers"].values()} == {"identical"}
    assert res.report["poorly_determined"] == []


def test_precision_option_reaches_every_solve_and_is_checked():
    _, models = H.family("bert", k=2)
    stats = [H.collect(m, H.random_batches("bert", 10 + i)) for i, m in enumerate(models)]
    res = merge_models(
        models, "regmean", stats=stats, heads=H.HEADS["bert"], precision="float64", progress=False
    )
    assert {v["precision"] for v in res.report["layers"].values()} == {"float64"}
    assert {v["output_error_estimate"] for v in res.report["layers"].values()} == {0.0}
    forced = merge_models(
        models, "regmean", stats=stats, heads=H.HEADS["bert"], precision="float32", progress=False
    )
    layers = forced.report["layers"].values()
    assert {v["precision"] for v in layers} == {"float32"}
    assert all(v["output_error_estimate"] > 0.0 for v in layers)
    with pytest.raises(MergeError, match=r"^precision: must be one of auto, .*got 'half'"):
        merge_models(models, "regmean", stats=stats, precision="half", progress=False)


def test_pooler_directions_no_statistics_row_reached_keep_the_average_at_alpha_1():
    # 5 sequences per model: the pooler's statistics hold 10 rows for its 16 inputs, so 6
    # input directions lie below the (mixed) statistics' noise floor.
    _, models = H.family("bert", k=2)
    stats = [
        H.collect(m, H.random_batches("bert", 30 + i, n_sequences=5)) for i, m in enumerate(models)
    ]
    assert noise_floor(stats) == 2.0**-24
    res = merge_models(
        models, "regmean", stats=stats, alpha=1.0, heads=H.HEADS["bert"], progress=False
    )
    layer = res.report["layers"]["bert.pooler.dense"]
    assert layer["precision"] == "float64" and layer["unseen_directions"] == H.HIDDEN - 10
    notes = {n["module"]: n for n in res.report["poorly_determined"]}
    assert (
        "6 input directions below the statistics' noise floor" in notes["bert.pooler.dense"]["why"]
    )
