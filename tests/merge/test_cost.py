"""What each task pays (lmdx.merge.cost) against float64 NumPy references written here.

For model i and a linear layer with statistics (G_i over n_i rows), Ĝ_i = G_i/n_i and the
merged weight W ([out, in]):

    cost_i  = sqrt(tr((W − W_i) Ĝ_i (W − W_i)ᵀ) / tr(W_i Ĝ_i W_iᵀ))
    pull_i  = ⟨W − W̄, W_i − W̄⟩ / ‖W_i − W̄‖²      (W̄: the coefficient-weighted average)
    share_i = tr(Ĝ_i) / Σ_j tr(Ĝ_j)

computed here with explicit products (E Ĝ Eᵀ), not lmdx's ⟨Ĝ, EᵀE⟩. A forged statistics
file (a contributor's Gram and sum ×100, row count unchanged, re-hashed so every file
check passes) must be flagged in every case; honest ones never.
"""

from __future__ import annotations

import json

import hf_models as H
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lmdx import MergeError, merge_models
from lmdx.cli.main import main as cli_main
from lmdx.merge import merge_cost, stream_merge
from lmdx.merge.card import model_card
from lmdx.merge.cost import cost_lines, measure_cost
from lmdx.merge.layer_cost import layer_cost
from lmdx.stats import Statistics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RTOL = 1e-9


def reference_layer(merged, weights, grams, counts, coefficients=None):
    """(cost, pull, share) per model, float64, by explicit products."""
    k = len(weights)
    c = np.ones(k) if coefficients is None else np.asarray(coefficients, dtype=np.float64)
    mean = sum(ci * w for ci, w in zip(c, weights, strict=True)) / c.sum()
    costs, pulls = [], []
    for w, g, n in zip(weights, grams, counts, strict=True):
        gh = g / n
        e = merged - w
        num = np.trace(e @ gh @ e.T)
        den = np.trace(w @ gh @ w.T)
        if not np.any(e):
            costs.append(0.0)  # the layer as model i had it
        else:
            costs.append(np.sqrt(num / den) if den > 0 else None)
        d = w - mean
        spread = np.sum(d * d)
        pulls.append(np.sum((merged - mean) * d) / spread if spread > 0 else 0.0)
    traces = np.array([np.trace(g) / n for g, n in zip(grams, counts, strict=True)])
    return costs, pulls, list(traces / traces.sum())


def assert_close(got, expected, what, scale=0.0):
    """Each value within 1e-9 of the reference, relative to itself or ``scale`` (the
    pull is a fraction of the way, of scale 1: where the merge barely moved from the
    average, as an average does up to rounding, it is a ratio of rounding errors)."""
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if b is None:
            assert a is None, (what, i)
            continue
        assert abs(a - b) <= RTOL * max(abs(b), scale, 1e-300), (what, i, a, b)


@settings(max_examples=60, deadline=None)
@given(
    out=st.integers(1, 7),
    dim=st.integers(1, 7),
    k=st.integers(2, 4),
    rows=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
    weighted=st.booleans(),
)
def test_layer_cost_equals_the_reference(out, dim, k, rows, seed, weighted):
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal((out, dim)) * rng.uniform(0.1, 10) for _ in range(k)]
    xs = [rng.standard_normal((rows, dim)) * rng.uniform(0.1, 10) for _ in range(k)]
    grams = [x.T @ x for x in xs]
    counts = [float(rows + i) for i in range(k)]
    merged = rng.standard_normal((out, dim))
    coef = list(rng.uniform(0.2, 3.0, k)) if weighted else None
    got = layer_cost(merged, weights, grams, counts, coef)
    costs, pulls, shares = reference_layer(merged, weights, grams, counts, coef)
    assert_close(got.cost, costs, "cost")
    assert_close(got.pull, pulls, "pull", scale=1.0)
    assert_close(got.share, shares, "share")


def test_layer_cost_of_a_model_merged_with_itself_is_zero():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 4))
    x = rng.standard_normal((9, 4))
    got = layer_cost(w.copy(), [w, w], [x.T @ x, x.T @ x], [9.0, 9.0])
    assert got.cost == [0.0, 0.0]
    assert got.pull == [0.0, 0.0]
    zero = layer_cost(w, [np.zeros_like(w)], [x.T @ x], [9.0])
    assert zero.cost == [None]
    one = layer_cost(w + 1.0, [w], [x.T @ x], [9.0], [0.3])  # W_i is the average
    assert one.pull == [0.0] and one.share == [1.0]


# --------------------------------------------------------------------------- the estimate

#: The estimate's stated accuracy (docs/guide/merging.md), on activations like these: each
#: layer's cost within 10 % of the exact one, 95 % of layers within 4 %, the mean over
#: layers within 1 % (measured here: 6.9 %, 3.0 % and 0.3 %; median 0.25 %).
LAYER_RTOL, LAYER_P95, MEAN_RTOL = 0.10, 0.04, 0.01


def realistic_layer(rng, out, dim, k, rank, outliers, correlation):
    """K fine-tunes' weights (task vectors of ``rank``, 0: dense, about 2 % of the base),
    their Grams and sums from correlated activations with a mean and a few outlier
    features ``outliers`` times the others' scale, and RegMean-like merged weights."""
    mix = np.eye(dim) + rng.standard_normal((dim, dim)) * correlation / np.sqrt(dim)
    loud = np.where(rng.random(dim) < 0.03, outliers, 1.0)
    base = rng.standard_normal((out, dim)) * 0.05
    weights, grams, sums, counts = [], [], [], []
    for _ in range(k):
        x = (rng.standard_normal((3 * dim, dim)) @ mix + rng.standard_normal(dim) * 0.5) * loud
        grams.append(x.T @ x)
        sums.append(x.sum(axis=0))
        counts.append(float(len(x)))
        if rank:
            tv = rng.standard_normal((out, rank)) @ rng.standard_normal((rank, dim))
        else:
            tv = rng.standard_normal((out, dim))
        weights.append(base + tv * 0.02 * np.abs(base).mean() / np.abs(tv).mean())
    mean = sum(weights) / k
    merged = mean + 0.3 * (weights[0] - mean) + 0.1 * (weights[1] - mean)
    return merged, weights, grams, sums, counts


def test_the_estimate_is_within_its_stated_bound_and_unbiased():
    """On 90 layers of several shapes, ranks and activation statistics: every layer's
    estimated cost within LAYER_RTOL of the exact one, 95 % within LAYER_P95, the mean
    over layers within MEAN_RTOL, the signed errors centred on 0 (unbiased) and the
    reported standard errors of the right size (few errors beyond 3 of them)."""
    rng = np.random.default_rng(20261207)
    signed, z, exact_all, estimate_all = [], [], [], []
    for case in range(90):
        out, dim = [(96, 64), (64, 160), (200, 48)][case % 3]
        rank = [0, 4, 24][(case // 3) % 3]
        outliers, correlation = [(1.0, 0.5), (20.0, 2.0), (60.0, 6.0)][(case // 9) % 3]
        merged, weights, grams, sums, counts = realistic_layer(
            rng, out, dim, 3, rank, outliers, correlation
        )
        exact = layer_cost(merged, weights, grams, counts, mode="exact")
        packed = [g[np.triu_indices(dim)] for g in grams]
        est = layer_cost(merged, weights, packed, counts, mode="estimate", sums=sums)
        assert est.share == pytest.approx(exact.share, rel=1e-12)
        assert est.pull == exact.pull
        for a, b, e in zip(est.cost, exact.cost, est.error, strict=True):
            assert abs(a - b) <= LAYER_RTOL * b, (case, a, b)
            signed.append((a - b) / b)
            z.append(abs(a - b) / e)
        exact_all += exact.cost
        estimate_all += est.cost
    assert np.quantile(np.abs(signed), 0.95) <= LAYER_P95
    assert abs(np.mean(estimate_all) / np.mean(exact_all) - 1) <= MEAN_RTOL
    assert abs(np.mean(signed)) <= 3 * np.std(signed) / np.sqrt(len(signed))
    assert np.mean(np.array(z) > 3.0) <= 0.05


@settings(max_examples=40, deadline=None)
@given(
    out=st.integers(17, 60),
    dim=st.integers(2, 40),
    rank=st.integers(0, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_estimate_is_exact_for_updates_of_low_rank(out, dim, rank, seed):
    """Changes of rank <= SKETCH (8) lie in the estimate's exact part: the cost equals the
    exact one to rounding, with standard error 0 to rounding; layers of at most 16
    outputs are computed exactly whatever their rank."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((dim + 5, dim)) * rng.uniform(0.1, 10.0, dim) + 1.0
    g = x.T @ x
    w = rng.standard_normal((out, dim))
    low = rng.standard_normal((out, rank)) @ rng.standard_normal((rank, dim))
    merged = w + low
    # W_i itself is of full rank: only its change is of low rank; its norm is then
    # estimated, so compare the numerator through a W_i of rank <= 8 too.
    w_low = rng.standard_normal((out, 3)) @ rng.standard_normal((3, dim))
    for model, m in ((w_low, w_low + low), (w[:16], merged[:16])):
        est = layer_cost(m, [model], [g], [float(len(x))], mode="estimate", sums=[x.sum(0)])
        exact = layer_cost(m, [model], [g], [float(len(x))], mode="exact")
        if exact.cost[0] is None:
            assert est.cost[0] is None
            continue
        assert est.cost[0] == pytest.approx(exact.cost[0], rel=1e-7, abs=1e-12)
        assert est.error[0] <= 1e-6 * max(exact.cost[0], 1e-12)


def test_the_estimate_refuses_a_nan_anywhere_in_a_packed_gram():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 30))
    g = x.T @ x
    g[3, 17] = g[17, 3] = np.nan  # off the diagonal: found through the products
    packed = g[np.triu_indices(30)]
    w = rng.standard_normal((40, 30))
    with pytest.raises(MergeError, match=r"model 0.*is not finite"):
        layer_cost(w + 0.01, [w], [packed], [40.0], mode="estimate")


# --------------------------------------------------------------------------- merges


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Per architecture: model folders, the models, honest statistics files."""
    root = tmp_path_factory.mktemp("cost")
    out = {}
    for arch in ("bert", "gpt2"):
        saved = H.saved_family(root, arch)
        out[arch] = {**saved, "base": saved["base_path"]}
    return out


def check_against_reference(report, state, models, stats_files, arch, coefficients=None):
    """Every layer of ``report["cost"]`` against :func:`reference_layer` on the merged
    ``state`` (as returned), the models' weights and the statistics' Grams."""
    stats = [Statistics.load(p) for p in stats_files]
    arrays = [H.state_arrays(m) for m in models]
    layers = report["cost"]["layers"]
    assert layers and set(layers) == {
        m for m in stats[0].modules if not H.is_head(stats[0].modules[m]["weight"], arch)
    }
    for module, got in layers.items():
        info = stats[0].modules[module]
        w = info["weight"]

        def lin(a, layout=info["layout"]):
            a = np.asarray(a, dtype=np.float64)
            return a.T if layout == "conv1d" else a

        merged = lin(_np(state[w]))
        costs, pulls, shares = reference_layer(
            merged,
            [lin(a[w]) for a in arrays],
            [s.gram(module) for s in stats],
            [s.count(module) for s in stats],
            coefficients,
        )
        assert_close(got["cost"], costs, module)
        assert_close(got["pull"], pulls, module, scale=1.0)
        assert_close(got["share"], shares, module)


def _np(t):
    return t.detach().double().numpy() if hasattr(t, "detach") else np.asarray(t, np.float64)


@pytest.mark.parametrize(
    "arch,method,options",
    [
        ("bert", "regmean", {"alpha": 0.9}),
        ("gpt2", "regmean", {}),
        ("bert", "average", {"coefficients": [0.5, 2.0, 1.0]}),
        ("gpt2", "ties", {"density": 0.5}),
    ],
)
def test_merge_reports_the_cost_equal_to_the_reference(family, arch, method, options):
    f = family[arch]
    base = f["base"] if method == "ties" else None
    result = merge_models(
        f["paths"],
        method,
        stats=f["stats"],
        base=base,
        heads=list(H.HEADS[arch]),
        progress=False,
        cost="exact",
        **options,
    )
    check_against_reference(
        result.report,
        result.state_dict,
        f["models"],
        f["stats"],
        arch,
        options.get("coefficients"),
    )
    cost = result.report["cost"]
    assert cost["flagged"] == [] and cost["scale_disagreement"] is None
    assert cost["statistics"] == (
        "the merge's" if method == "regmean" else "given for the cost only"
    )
    for i, t in enumerate(cost["tasks"].values()):
        per_layer = {m: layer["cost"][i] for m, layer in cost["layers"].items()}
        assert t["max"] == max(per_layer.values())
        assert t["mean"] == pytest.approx(np.mean(list(per_layer.values())), rel=1e-12)
        worst = sorted(per_layer.items(), key=lambda mc: -mc[1])[:3]
        assert [tuple(x) for x in t["worst_layers"]] == worst


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_the_default_estimate_agrees_with_the_exact_cost(family, arch):
    """A default merge (the cost estimated) against cost="exact": the same merged weights,
    flags and shares, the pulls to float32 rounding (the estimate works in the weights'
    float32); every layer's cost within LAYER_RTOL (and its standard error reported), each
    task's mean within MEAN_RTOL; the CLI line says which was measured."""
    f = family[arch]
    heads = list(H.HEADS[arch])
    est = merge_models(f["paths"], "regmean", stats=f["stats"], heads=heads, progress=False)
    exact = merge_models(
        f["paths"], "regmean", stats=f["stats"], heads=heads, progress=False, cost="exact"
    )
    for w, v in est.state_dict.items():
        assert np.array_equal(_np(v), _np(exact.state_dict[w]))
    a, b = est.report["cost"], exact.report["cost"]
    assert (a["mode"], b["mode"]) == ("estimate", "exact")
    assert a["flagged"] == b["flagged"] == [] and a["checked"] is True
    for m, layer in b["layers"].items():
        got = a["layers"][m]
        assert got["share"] == pytest.approx(layer["share"], rel=1e-12)
        assert got["pull"] == pytest.approx(layer["pull"], rel=1e-4, abs=1e-5)
        assert layer["error"] == [0.0] * len(layer["cost"])
        for x, y in zip(got["cost"], layer["cost"], strict=True):
            assert abs(x - y) <= LAYER_RTOL * y, (m, x, y)
    for lab, t in b["tasks"].items():
        assert a["tasks"][lab]["mean"] == pytest.approx(t["mean"], rel=MEAN_RTOL)
        assert a["tasks"][lab]["mean_error"] >= 0.0 and t["mean_error"] == 0.0
    assert "estimated" in cost_lines(a)[0] and "exact" in cost_lines(b)[0]


def test_cost_takes_only_its_modes(family):
    f = family["bert"]
    with pytest.raises(MergeError, match="cost: expected True, False, None, 'estimate' or"):
        merge_models(f["paths"], "regmean", stats=f["stats"], progress=False, cost="fast")


def assert_same_report(a, b):
    """Two reports of the same estimate: equal to rounding (its NumPy products are BLAS's,
    whose order of sums is BLAS's affair), flags the same."""
    assert a["layers"].keys() == b["layers"].keys() and a["tasks"].keys() == b["tasks"].keys()
    for m, layer in b["layers"].items():
        for key, values in layer.items():
            assert a["layers"][m][key] == pytest.approx(values, rel=1e-9, abs=1e-15), (m, key)
    for t, task in b["tasks"].items():
        got = a["tasks"][t]
        assert got["flagged"] == task["flagged"] and got["surrogate"] == task["surrogate"]
        for key in ("mean", "max", "mean_error", "pull_median", "share_median", "share_ratio"):
            assert got[key] == pytest.approx(task[key], rel=1e-9, abs=1e-15), (t, key)


def test_a_method_without_statistics_is_unchanged_by_the_cost(family):
    f = family["bert"]
    heads = list(H.HEADS["bert"])
    plain = merge_models(f["paths"], "average", heads=heads, progress=False)
    measured = merge_models(
        f["paths"], "average", stats=f["stats"], heads=heads, progress=False, cost=True
    )
    for name, t in plain.state_dict.items():
        assert np.array_equal(_np(t), _np(measured.state_dict[name])), name
    assert "cost" not in plain.report
    # the same numbers for the merged state dict measured afterwards
    after = measure_cost(plain.state_dict, f["paths"], f["stats"], labels=plain.report["models"])
    assert_same_report(after, measured.report["cost"])
    exact = measure_cost(
        plain.state_dict, f["paths"], f["stats"], labels=plain.report["models"], mode="exact"
    )
    assert exact["mode"] == "exact" and after["mode"] == "estimate"
    with pytest.raises(MergeError, match=r"^stats: method average takes no statistics"):
        merge_models(f["paths"], "average", stats=f["stats"], heads=heads, progress=False)
    with pytest.raises(MergeError, match=r"^cost: what each task pays needs Gram statistics"):
        merge_models(f["paths"], "average", heads=heads, progress=False, cost=True)


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
@pytest.mark.parametrize("method", ["regmean", "average", "task_arithmetic"])
@pytest.mark.parametrize("victim", [0, 1, 2])
def test_forged_statistics_are_flagged(family, tmp_path, arch, method, victim):
    f = family[arch]
    stats = list(f["stats"])
    stats[victim] = H.forged_stats(stats[victim], tmp_path / "forged.safetensors")
    base = f["base"] if method == "task_arithmetic" else None
    report = merge_cost(
        f["paths"], method, stats=stats, base=base, heads=list(H.HEADS[arch]), progress=False
    )
    flagged = report["cost"]["flagged"]
    labels = report["models"]
    assert [x["model"] for x in flagged] == [labels[victim]]
    task = report["cost"]["tasks"][labels[victim]]
    assert task["flagged"] and task["share_ratio"] > 50
    if method == "regmean":  # the forged Gram pulls the merge toward its model
        assert task["pull_median"] > 0.5
        assert "median pull" in flagged[0]["why"]


def _partly_frozen(root, arch):
    """The family with every model's second block set to the base's (frozen while
    fine-tuning), saved, with statistics collected on each."""
    import copy

    base, models, batches = H.cached_family(arch)
    frozen = {n: t for n, t in base.state_dict().items() if ".1." in n}
    paths, stats = [], []
    for i, (m, b) in enumerate(zip(models, batches, strict=True)):
        m = copy.deepcopy(m)
        state = m.state_dict()
        prefixed = {n: t for n, t in state.items() if any(n.endswith(f) for f in frozen)}
        assert prefixed, "no frozen block found"
        for n in prefixed:
            key = next(f for f in frozen if n.endswith(f))
            state[n].copy_(frozen[key])
        m.save_pretrained(root / f"{arch}{i}")
        paths.append(root / f"{arch}{i}")
        stats.append(H.collect(m, b).save(root / f"{arch}{i}.safetensors"))
    return paths, stats


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
@pytest.mark.parametrize("kind", ["one layer", "two of three", "partly frozen"])
def test_partial_collusive_and_frozen_forgeries_are_reported(family, tmp_path, arch, kind):
    """×100 on one layer's groups only, on two files of three (each compared with a median
    that held the other forged file), and on models whose second block was frozen (its
    zero costs and pulls once diluted the medians): every time the forged files are
    flagged and named high, the honest ones low and never flagged."""
    f = family[arch]
    paths, stats = list(f["paths"]), list(f["stats"])
    if kind == "partly frozen":
        paths, stats = _partly_frozen(tmp_path, arch)
    first = Statistics.load(stats[0])
    layer0 = [g for g in first.groups if ".0." in g]
    assert layer0 and len(layer0) < len(first.groups)
    victims = [0, 2] if kind == "two of three" else [1]
    for v in victims:
        stats[v] = H.forged_stats(
            stats[v], tmp_path / f"forged{v}.safetensors", layer0 if kind == "one layer" else None
        )
    report = merge_cost(paths, "regmean", stats=stats, heads=list(H.HEADS[arch]), progress=False)
    cost, labels = report["cost"], report["models"]
    assert sorted(x["model"] for x in cost["flagged"]) == sorted(labels[v] for v in victims)
    disagree = cost["scale_disagreement"]
    assert disagree["high"] == [labels[v] for v in victims]
    assert disagree["low"] == [labels[i] for i in range(3) if i not in victims]
    assert disagree["largest"] > 50
    if kind == "one layer":
        assert set(disagree["layers"]) == {m for m in first.modules if first.group_of(m) in layer0}
    if kind == "partly frozen":  # the medians leave the frozen block out: the pull shows
        assert cost["tasks"][labels[1]]["pull_median"] > 0.5
        assert "median pull" in cost["flagged"][0]["why"]


def test_streaming_merge_records_the_cost_in_its_record_and_card(family, tmp_path):
    f = family["bert"]
    heads = list(H.HEADS["bert"])
    out = tmp_path / "merged"
    res = stream_merge(f["paths"], out, "regmean", stats=f["stats"], heads=heads, progress=False)
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["report"]["cost"] == json.loads(json.dumps(res.report["cost"]))
    in_memory = merge_models(f["paths"], "regmean", stats=f["stats"], heads=heads, progress=False)
    # the same estimate (compared to rounding: its NumPy products are BLAS's)
    written = record["report"]["cost"]["layers"]
    assert written.keys() == in_memory.report["cost"]["layers"].keys()
    for m, layer in in_memory.report["cost"]["layers"].items():
        for key in ("cost", "pull", "share", "error"):
            assert written[m][key] == pytest.approx(layer[key], rel=1e-9, abs=1e-15), (m, key)
    card = (out / "README.md").read_text()
    assert "## What each task pays" in card and "Estimated (randomized, unbiased)" in card
    assert card == model_card(record, json.loads((out / "config.json").read_text()))
    for label in record["report"]["models"]:
        assert f"| {label} |" in card
    none = stream_merge(
        f["paths"],
        tmp_path / "off",
        "regmean",
        stats=f["stats"],
        heads=heads,
        progress=False,
        cost=False,
    )
    assert "cost" not in none.report


def _config(tmp_path, f, method, stats):
    lines = [f"method: {method}", "heads: {patterns: ['classifier.*']}", "models:"]
    for p, s in zip(f["paths"], stats, strict=True):
        lines.append(f"  - {{path: {p}, stats: {s}}}")
    cfg = tmp_path / "merge.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def test_cli_cost_prints_the_cost_and_writes_nothing(family, tmp_path, capsys):
    f = family["bert"]
    stats = list(f["stats"])
    stats[1] = H.forged_stats(stats[1], tmp_path / "forged.safetensors")
    cfg = _config(tmp_path, f, "average", stats)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli_main(["merge", str(cfg), "--cost", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "what each task pays" in captured.out and "estimated" in captured.out
    assert "nothing written" in captured.out
    assert f"the statistics of {f['paths'][1]} pull far harder" in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert cli_main(["merge", str(cfg), "--cost", "exact", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "outputs on its own statistics, exact)" in captured.out
    assert f"the statistics of {f['paths'][1]} pull far harder" in captured.err
    assert cli_main(["merge", str(cfg), "--cost", "--exact-cost"]) == 2
    assert "--exact-cost: with --cost, say --cost exact" in capsys.readouterr().err
    # without --cost, a method that takes no statistics refuses them in the file
    assert cli_main(["merge", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert "takes no statistics" in capsys.readouterr().err
    assert cli_main(["merge", str(cfg), "--cost", "--out", str(tmp_path / "o")]) == 2
    assert "--out: --cost writes nothing" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_merge_summary_shows_the_cost(family, tmp_path, capsys):
    f = family["bert"]
    cfg = _config(tmp_path, f, "regmean", f["stats"])
    assert cli_main(["merge", str(cfg), "--out", str(tmp_path / "m"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "lmdx merge: what each task pays" in out
    assert "pull far harder" not in out
    # --no-cost: the same merge, bit for bit, with no cost measured or shown
    assert (
        cli_main(["merge", str(cfg), "--out", str(tmp_path / "n"), "--no-progress", "--no-cost"])
        == 0
    )
    assert "what each task pays" not in capsys.readouterr().out
    assert "cost" not in json.loads((tmp_path / "n" / "lmdx_merge.json").read_text())["report"]
    shards = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))
    assert shards == sorted(p.name for p in (tmp_path / "n").glob("*.safetensors")) != []
    for name in shards:
        assert (tmp_path / "n" / name).read_bytes() == (tmp_path / "m" / name).read_bytes()
    assert cli_main(["merge", str(cfg), "--cost", "--no-cost"]) == 2
    assert "--no-cost: not with --cost" in capsys.readouterr().err


def test_a_flagged_merge_writes_nothing_unless_accepted(family, tmp_path, capsys):
    """A forged file is flagged and the merge refused in one line, nothing written;
    ``--accept-flagged`` writes it, and the record and the card say it was accepted."""
    f = family["bert"]
    stats = list(f["stats"])
    stats[1] = H.forged_stats(stats[1], tmp_path / "forged.safetensors")
    cfg = _config(tmp_path, f, "regmean", stats)
    out = tmp_path / "merged"
    assert cli_main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmdx merge: error: merge refused, nothing written")
    assert str(f["paths"][1]) in err[0] and "--accept-flagged" in err[0]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    argv = ["merge", str(cfg), "--out", str(out), "--no-progress", "--accept-flagged"]
    assert cli_main(argv) == 0
    assert "merged although flagged" in capsys.readouterr().out
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["report"]["cost"]["accepted"] is True
    assert [x["model"] for x in record["report"]["cost"]["flagged"]] == [str(f["paths"][1])]
    assert "**Merged although flagged**" in (out / "README.md").read_text()
    # measuring alone (--cost) reports the flag and refuses nothing
    assert cli_main(["merge", str(cfg), "--cost", "--no-progress"]) == 0
