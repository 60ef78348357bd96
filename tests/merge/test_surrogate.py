"""RegMean of models with and without statistics in one merge (``surrogate: true``,
lmdx.merge.surrogate), against float64 NumPy references written here.

A model without statistics stands in with, per input group of the real statistics,

    Ĝ_sur = t̄ · T / tr T,   T = Σ_m τ_mᵀ τ_m,   τ_m = W_m − W_base ([out, in]),
    t̄ = median over the models with statistics of tr(G_j / n_j)

((t̄ / d) I where every τ_m is zero), over n̄ rows (the real models' mean row count); the
merge is then RegMean's closed form over real and surrogate Grams alike.
"""

from __future__ import annotations

import json
import re

import hf_models as H
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lmdx import MergeError, merge_models
from lmdx.cli.main import main as cli_main
from lmdx.merge import stream_merge
from lmdx.merge.surrogate import SURROGATE_SOURCE, scaled_surrogate, surrogates_line
from lmdx.stats import Statistics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@settings(max_examples=60, deadline=None)
@given(
    outs=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    dim=st.integers(1, 7),
    trace=st.floats(1e-3, 1e3),
    zero=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_scaled_surrogate_equals_the_reference(outs, dim, trace, zero, seed):
    rng = np.random.default_rng(seed)
    taus = [rng.standard_normal((o, dim)) * rng.uniform(0.01, 10) * (not zero) for o in outs]
    got = scaled_surrogate(taus, trace)
    total = np.zeros((dim, dim))
    for t in taus:
        for row in t:  # the rows of the task vectors as inputs: Σ x xᵀ
            total += np.outer(row, row)
    ref = total * trace / np.trace(total) if np.trace(total) > 0 else np.eye(dim) * trace / dim
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * trace)
    assert np.trace(got) == pytest.approx(trace, rel=1e-12)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Per architecture: model folders, the models, the base and its folder, statistics."""
    root = tmp_path_factory.mktemp("surrogate")
    return {arch: H.saved_family(root, arch) for arch in ("bert", "gpt2")}


def reference_merge(f, arch, real, alpha):
    """Per solved weight: RegMean's closed form (float64) over the real Grams of the
    models in ``real`` and the surrogate ones of the others, by this module's formula."""
    stats = {i: Statistics.load(f["stats"][i]) for i in real}
    first = stats[real[0]]
    arrays = [H.state_arrays(m) for m in f["models"]]
    base = H.state_arrays(f["base"])
    by_group = {}
    for module, info in first.modules.items():
        by_group.setdefault(info["group"], []).append(module)
    out = {}
    for members in by_group.values():
        layout = first.modules[members[0]]["layout"]

        def lin(a, layout=layout):
            a = np.asarray(a, dtype=np.float64)
            return a.T if layout == "conv1d" else a

        traces = [np.trace(s.gram(members[0])) / s.count(members[0]) for s in stats.values()]
        counts = [s.count(members[0]) for s in stats.values()]
        t_bar, n_bar = float(np.median(traces)), float(np.mean(counts))
        grams, ns = [], []
        for i in range(len(arrays)):
            if i in stats:
                grams.append(stats[i].gram(members[0]))
                ns.append(stats[i].count(members[0]))
                continue
            total = 0.0
            for m in members:
                w = first.modules[m]["weight"]
                tau = lin(arrays[i][w]) - lin(base[w])
                total = total + tau.T @ tau
            size, dim = np.trace(total), total.shape[0]
            g_hat = total * t_bar / size if size > 0 else np.eye(dim) * t_bar / dim
            grams.append(g_hat * n_bar)
            ns.append(n_bar)
        for m in members:
            w = first.modules[m]["weight"]
            if H.is_head(w, arch):
                continue
            weights = [lin(a[w]) for a in arrays]
            out[w] = lin(H.reference_regmean(grams, ns, weights, alpha, None, "linear"))
    return out


@pytest.mark.parametrize(
    "arch,real", [("bert", [0]), ("bert", [1, 2]), ("gpt2", [2]), ("gpt2", [0, 1])]
)
def test_mixed_merge_equals_the_reference(family, arch, real):
    f = family[arch]
    stats = [f["stats"][i] if i in real else None for i in range(3)]
    result = merge_models(
        f["paths"],
        "regmean",
        stats=stats,
        base=f["base_path"],
        surrogate=True,
        alpha=0.9,
        precision="float64",
        heads=list(H.HEADS[arch]),
        progress=False,
        labels=["a", "b", "c"],
    )
    ref = reference_merge(f, arch, real, 0.9)
    assert ref
    for w, expected in ref.items():
        got = result.state_dict[w].detach().double().numpy()
        # stored in float32: the reference rounded to float32 is what can be expected
        assert H.rel_err(got, expected.astype(np.float32)) < 1e-6, w
    assert result.report["surrogate_stats"] == [x for i, x in enumerate("abc") if i not in real]
    for i, (label, entry) in enumerate(result.inputs.items()):
        assert (entry["stats"] == SURROGATE_SOURCE) == (i not in real), label
        assert entry["stats_sha256"] is None or i in real
    cost = result.report["cost"]  # what each task pays, the surrogates' on their own Grams
    assert [t["surrogate"] for t in cost["tasks"].values()] == [i not in real for i in range(3)]
    assert cost["flagged"] == []  # honest statistics; a surrogate is never flagged
    assert cost["checked"] == (len(real) > 1)


def test_surrogate_with_every_statistics_given_changes_nothing(family):
    f = family["bert"]
    common = dict(stats=f["stats"], alpha=0.9, heads=list(H.HEADS["bert"]), progress=False)
    plain = merge_models(f["paths"], "regmean", **common)
    opted = merge_models(f["paths"], "regmean", surrogate=True, base=f["base_path"], **common)
    for name, value in plain.state_dict.items():
        assert bool((value == opted.state_dict[name]).all()), name
    assert "surrogate_stats" not in opted.report


def test_streaming_merge_records_which_model_used_which(family, tmp_path):
    f = family["bert"]
    out = tmp_path / "merged"
    stream_merge(
        f["paths"],
        out,
        "regmean",
        stats=[f["stats"][0], None, f["stats"][2]],
        base=f["base_path"],
        surrogate=True,
        heads=list(H.HEADS["bert"]),
        progress=False,
    )
    record = json.loads((out / "lmdx_merge.json").read_text())
    sources = [entry["stats"] for entry in record["inputs"].values()]
    assert sources[1] == SURROGATE_SOURCE and sources[0] != SURROGATE_SOURCE
    assert record["report"]["surrogate_stats"] == [str(f["paths"][1])]
    assert f"- {surrogates_line([str(f['paths'][1])])}" in (out / "README.md").read_text()
    assert not H.leftovers(out)


@pytest.mark.parametrize(
    "stats,base,options,message",
    [
        (
            [0, None, 2],
            True,
            {},
            r"^stats: method regmean needs regmean-gram statistics, one per model \(or set "
            r"surrogate to true and give base",
        ),
        ([0, None, 2], False, {"surrogate": True}, r"^base: surrogate statistics .* \(base\)$"),
        ([None, None, None], True, {"surrogate": True}, r"^stats: surrogate statistics need at"),
    ],
)
def test_surrogate_errors_say_what_to_do(family, stats, base, options, message):
    f = family["bert"]
    with pytest.raises(MergeError, match=message):
        merge_models(
            f["paths"],
            "regmean",
            stats=[None if i is None else f["stats"][i] for i in stats],
            base=f["base_path"] if base else None,
            progress=False,
            **options,
        )


def test_surrogate_is_an_option_of_regmean_only(family):
    f = family["bert"]
    with pytest.raises(MergeError, match="surrogate"):
        merge_models(f["paths"], "average", surrogate=True, progress=False)


def test_cli_merges_a_model_without_statistics(family, tmp_path, capsys):
    f = family["bert"]
    models = "\n".join(
        [
            f"  - {{path: {f['paths'][0]}, stats: {f['stats'][0]}}}",
            f"  - {{path: {f['paths'][1]}}}",
            f"  - {{path: {f['paths'][2]}, stats: {f['stats'][2]}}}",
        ]
    )
    cfg = tmp_path / "mixed.yaml"
    cfg.write_text(
        f"method: regmean\nsurrogate: true\nbase: {f['base_path']}\nmodels:\n{models}\n"
        "heads: {patterns: ['classifier.*'], policy: keep}\n"
    )
    out = tmp_path / "merged"
    assert cli_main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    assert f"lmdx merge: {surrogates_line([str(f['paths'][1])])}\n" in capsys.readouterr().out
    assert cli_main(["merge", str(cfg), "--out", str(tmp_path / "plan"), "--dry-run"]) == 0
    assert surrogates_line([str(f["paths"][1])]) in capsys.readouterr().out
    assert cli_main(["merge", str(cfg), "--cost", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert f"lmdx merge: {surrogates_line([str(f['paths'][1])])}\n" in said
    assert f"  {f['paths'][1]} (on its surrogate Gram): " in said
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["config"]["surrogate"] is True
    assert record["report"]["surrogate_stats"]


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_a_forged_file_is_flagged_beside_surrogates_and_a_surrogate_never(family, tmp_path, arch):
    """A contributor's Gram and sum ×100 (the file re-hashed) among two honest files and a
    model without statistics: the forged one is flagged, the surrogate is not (its scale is
    the real files' median, not the forged one's). With one real file nothing can be
    compared, and the report says so."""
    f = family[arch]
    paths = [*f["paths"], f["paths"][0]]  # a fourth model: the first again, no statistics
    forged = H.forged_stats(f["stats"][1], tmp_path / "forged.safetensors")
    common = dict(base=f["base_path"], surrogate=True, progress=False, labels=list("abcd"))
    common["heads"] = list(H.HEADS[arch])
    stats = [f["stats"][0], forged, f["stats"][2], None]
    with pytest.raises(MergeError, match=r"^merge refused, nothing written: the statistics of b "):
        merge_models(paths, "regmean", stats=stats, **common)
    result = merge_models(paths, "regmean", stats=stats, accept_flagged=True, **common)
    cost = result.report["cost"]
    assert cost["accepted"] is True
    assert [x["model"] for x in cost["flagged"]] == ["b"], cost["flagged"]
    assert cost["tasks"]["d"]["surrogate"] and not cost["tasks"]["d"]["flagged"]
    alone = merge_models(paths, "regmean", stats=[None, forged, None, None], **common)
    assert alone.report["cost"]["checked"] is False and alone.report["cost"]["flagged"] == []


def test_a_refused_option_beside_surrogate_says_what_is_wrong(family, tmp_path, capsys):
    f = family["bert"]
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        f"method: regmean\nsurrogate: true\nbase: {f['base_path']}\nalpha: 7\nmodels:\n"
        f"  - {{path: {f['paths'][0]}, stats: {f['stats'][0]}}}\n  - {{path: {f['paths'][1]}}}\n"
    )
    assert cli_main(["merge", str(cfg), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "alpha" in err and "needs regmean-gram statistics" not in err, err


@pytest.mark.parametrize("where", ["base", "model"])
def test_a_non_finite_weight_is_named_not_taken_for_a_zero_task_vector(family, tmp_path, where):
    """A NaN in the base (or in the model without statistics) made the surrogate Gram's
    trace NaN, which failed ``trace > 0`` and silently gave the isotropic Gram meant for a
    zero task vector: now one line naming the tensor and the model."""
    f = family["bert"]
    base_state = {n: t.clone() for n, t in f["base"].state_dict().items()}
    states = [{n: t.clone() for n, t in m.state_dict().items()} for m in f["models"]]
    first = Statistics.load(f["stats"][0])
    weight = str(next(iter(first.modules.values()))["weight"])
    (base_state if where == "base" else states[1])[weight][0, 0] = float("nan")
    with pytest.raises(MergeError, match=rf"tensor '{re.escape(weight)}' of .* holds NaN or Inf"):
        merge_models(
            states,
            "regmean",
            stats=[f["stats"][0], None, f["stats"][2]],
            base=base_state,
            surrogate=True,
            progress=False,
        )


def test_regmean_svc_keeps_surrogate(family):
    """``regmean+svc`` forwards ``surrogate: true`` to RegMean: a model without statistics
    takes a surrogate Gram, as with plain ``regmean``, then SVC calibrates."""
    f = family["bert"]
    kw = {"base": f["base_path"], "surrogate": True, "alpha": 0.9, "progress": False}
    kw["heads"] = list(H.HEADS["bert"])
    stats = [f["stats"][0], None, f["stats"][2]]
    res = merge_models(f["paths"], "regmean+svc", stats=stats, labels=["a", "b", "c"], **kw)
    assert res.report["surrogate_stats"] == ["b"]
    plain = merge_models(f["paths"], "regmean", stats=stats, labels=["a", "b", "c"], **kw)
    assert plain.report["surrogate_stats"] == ["b"]
    moved = [n for n, t in res.state_dict.items() if not np.array_equal(t, plain.state_dict[n])]
    assert moved  # SVC changed the task matrices
