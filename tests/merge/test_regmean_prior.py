"""RegMean with a prior mean (lmdx.merge.builtin.regmean_prior), against float64 NumPy
references written here::

    W_Mᵀ = (Σ c_i G̃_i + Λ)⁻¹ (Σ c_i G̃_i W_iᵀ + Λ W_aᵀ),   Λ = λ t I,  t = tr(Σ c_i G̃_i) / d

``W_a`` the anchor (a data-free merge of the same models); the limits λ = 0 (RegMean, bit
for bit) and λ → ∞ (the anchor); the prior toward the average is RegMean's ridge; the
tensors without statistics of a module with a prior are the anchor's; errors name the
option.
"""

from __future__ import annotations

import hashlib
import json

import hf_models as H
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lmdx import MergeError, merge_models, regmean_merge_layer
from lmdx.merge import stream_merge
from lmdx.merge.builtin.regmean_prior import prior_system
from lmdx.stats import Statistics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_prior(grams, counts, weights, alpha, coefficients, strength, anchor):
    """The formula in float64, weights ``[out, in]`` (tests/hf_models.py)."""
    return H.reference_regmean(
        grams, counts, weights, alpha, coefficients, "linear", prior=(strength, anchor)
    )


def packed(g):
    return g[np.triu_indices(g.shape[0])]


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 4),
    d=st.integers(1, 9),
    out=st.integers(1, 7),
    alpha=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    strength=st.sampled_from([1e-3, 0.1, 1.0, 30.0]),
    weighted=st.booleans(),
    pack=st.booleans(),
    rows=st.integers(1, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_prior_system_solves_the_formula(
    k, d, out, alpha, strength, weighted, pack, rows, seed
):
    """The anchor as a (K + 1)-th model of the core's solve is the formula, for any K,
    shape, α, weights, packing and rank of the statistics (fewer rows than inputs too:
    the prior makes the system definite)."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((rows, d)) * rng.uniform(0.1, 3.0, d) for _ in range(k)]
    grams = [x.T @ x + 1e-3 * np.eye(d) for x in xs]
    counts = [float(rows + i) for i in range(k)]
    base = rng.standard_normal((out, d))
    weights = [base + 0.02 * rng.standard_normal((out, d)) for _ in range(k)]
    anchor = base + 0.02 * rng.standard_normal((out, d))
    coef = [float(c) for c in rng.uniform(0.2, 2.0, k)] if weighted else None
    stored = [packed(g) if pack else g for g in grams]
    system = prior_system(stored, counts, coef, d, strength, anchor)
    got = regmean_merge_layer(
        [*stored, system.gram],
        [*weights, system.weight],
        [*counts, 1.0],
        alpha=alpha,
        coefficients=None if coef is None else [*coef, 1.0],
        precision="float64",
        allow_regularization=False,
    ).weight
    ref = reference_prior(grams, counts, weights, alpha, coef, strength, anchor)
    assert H.rel_err(got, ref) < 1e-9


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("prior")
    return {arch: H.saved_family(root, arch) for arch in ("bert", "gpt2")}


def _merge(f, arch, **kw):
    kw = {"alpha": 0.9, "precision": "float64", "progress": False, **kw}
    return merge_models(
        f["paths"], "regmean", stats=f["stats"], heads=list(H.HEADS[arch]), **kw
    ).state_dict


def _digest(state):
    return {
        n: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()
        for n, t in state.items()
    }


def _solved(f):
    """Module -> (weight name, layout) of every solved (non-head) module."""
    first = Statistics.load(f["stats"][0])
    return {m: (i["weight"], i["layout"]) for m, i in first.modules.items()}


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
@pytest.mark.parametrize(
    "anchor,anchor_options",
    [
        ("task_arithmetic", {"scaling": 1.0}),
        ("ties", {"density": 0.5}),
        ("tsv_m", {}),
    ],
)
@pytest.mark.parametrize("strength", [0.05, 1.0])
def test_merge_with_a_prior_equals_the_reference(family, arch, anchor, anchor_options, strength):
    """Every solved weight of a real model is the formula with the anchor's own merge
    (lmdx's, checked against its references elsewhere); every tensor without statistics
    is the anchor's, bit for bit."""
    f = family[arch]
    got = _merge(
        f,
        arch,
        base=f["base_path"],
        prior=anchor,
        prior_strength=strength,
        prior_options=anchor_options,
    )
    want = merge_models(
        f["paths"],
        anchor,
        base=f["base_path"],
        heads=list(H.HEADS[arch]),
        progress=False,
        **anchor_options,
    ).state_dict
    stats = [Statistics.load(p) for p in f["stats"]]
    arrays = [H.state_arrays(m) for m in f["models"]]
    solved = _solved(f)
    for module, (w, layout) in solved.items():
        if H.is_head(w, arch):
            continue

        def lin(a, layout=layout):
            a = np.asarray(a, dtype=np.float64)
            return a.T if layout == "conv1d" else a

        ref = reference_prior(
            [s.gram(module) for s in stats],
            [s.count(module) for s in stats],
            [lin(a[w]) for a in arrays],
            0.9,
            None,
            strength,
            lin(want[w].detach().double().numpy()),
        )
        assert H.rel_err(lin(got[w].detach().double().numpy()), ref.astype(np.float32)) < 1e-6, w
    weights = {w for w, _ in solved.values()}
    others = [n for n in got if n not in weights and not H.is_head(n, arch)]
    assert others
    for n in others:
        assert np.array_equal(got[n].numpy(), want[n].numpy()), n


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_strength_zero_is_regmean_bit_for_bit(family, arch):
    f = family[arch]
    plain = _merge(f, arch, precision="auto")
    zero = _merge(f, arch, precision="auto", base=f["base_path"], prior="ties", prior_strength=0.0)
    assert _digest(zero) == _digest(plain)
    patterns = _merge(
        f,
        arch,
        precision="auto",
        base=f["base_path"],
        prior="ties",
        prior_strength={"no.such.module": 5.0},
    )
    assert _digest(patterns) == _digest(plain)


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_a_strong_prior_is_the_anchor(family, arch):
    f = family[arch]
    anchor = merge_models(
        f["paths"], "tsv_m", base=f["base_path"], heads=list(H.HEADS[arch]), progress=False
    ).state_dict
    strong = _merge(f, arch, base=f["base_path"], prior="tsv_m", prior_strength=1e9)
    for n, t in anchor.items():
        if not H.is_head(n, arch):
            assert H.rel_err(strong[n].double().numpy(), t.double().numpy()) < 1e-6, n


def test_the_prior_toward_the_average_is_the_ridge(family):
    """RegMean's core solves for the deviation from the average, so its ridge λ is a
    prior toward the average of strength λ (t: the same mean diagonal)."""
    f = family["bert"]
    ridge = _merge(f, "bert", ridge=0.3, allow_regularization=False)
    prior = _merge(
        f,
        "bert",
        base=f["base_path"],
        prior="average",
        prior_strength=0.3,
        allow_regularization=False,
    )
    for n, t in ridge.items():
        assert H.rel_err(prior[n].double().numpy(), t.double().numpy()) < 1e-6, n


def test_strength_per_module_pattern(family):
    """Patterns to strengths: the first that matches; a module none matches is RegMean's
    (bit for bit) and reported without a strength."""
    f = family["bert"]
    kw = {"base": f["base_path"], "prior": "ties"}
    res = merge_models(
        f["paths"],
        "regmean",
        stats=f["stats"],
        heads=list(H.HEADS["bert"]),
        alpha=0.9,
        progress=False,
        prior_strength={"*.attention.self.*": 2.0, "*.output.dense": 0.5},
        **kw,
    )
    plain = _merge(f, "bert", precision="auto")
    layers = res.report["layers"]
    for module, info in layers.items():
        if ".attention.self." in module:
            assert info["prior_strength"] == 2.0, module
        elif module.endswith(".output.dense"):
            assert info["prior_strength"] == 0.5, module
        else:
            assert "prior_strength" not in info, module
            w = f"{module}.weight"
            assert np.array_equal(res.state_dict[w].numpy(), plain[w].numpy()), module
    assert res.report["prior"] == "ties"
    assert res.report["prior_options"] == {"scaling": 1.0, "density": 0.2}


def test_the_folder_and_card_name_the_anchor(family, tmp_path):
    f = family["bert"]
    strengths = {"*.attention.*": 0.5, "*": 2.0}
    stream_merge(
        f["paths"],
        tmp_path / "out",
        stats=f["stats"],
        base=f["base_path"],
        prior="tsv_m",
        prior_strength=strengths,
        heads=list(H.HEADS["bert"]),
        progress=False,
    )
    report = json.loads((tmp_path / "out" / "lmdx_merge.json").read_text())["report"]
    assert report["prior"] == "tsv_m" and report["prior_strength"] == strengths
    assert report["prior_options"] == {"scaling": 1.0, "rank_fraction": None, "precision": "auto"}
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- `prior`: tsv_m" in card
    assert "- `prior_strength`: {'*.attention.*': 0.5, '*': 2.0}" in card


def test_output_blocks_with_a_prior_equal_the_whole(family, tmp_path):
    f = family["bert"]
    kw = {
        "stats": f["stats"],
        "base": f["base_path"],
        "prior": "ties",
        "prior_strength": 0.7,
        "precision": "float64",
        "progress": False,
        "heads": list(H.HEADS["bert"]),
    }
    whole = stream_merge(f["paths"], tmp_path / "whole", **kw)
    blocked = stream_merge(f["paths"], tmp_path / "blocked", solve_memory="1B", **kw)
    assert any(v.get("output_blocks", 1) > 1 for v in blocked.report["layers"].values())
    assert "output_blocks" not in next(iter(whole.report["layers"].values()))
    from lmdx.files import Checkpoint

    a, b = Checkpoint(tmp_path / "whole"), Checkpoint(tmp_path / "blocked")
    for n in a.names():
        x, y = np.asarray(a.read(n), np.float64), np.asarray(b.read(n), np.float64)
        assert np.abs(x - y).max() <= 1e-6 * max(np.abs(x).max(), 1e-30), n


@pytest.mark.parametrize(
    "options,message",
    [
        ({"prior": "tiess"}, r"^prior: no method 'tiess'; did you mean ties\?"),
        ({"prior": "fisher"}, r"^prior: fisher needs statistics or data"),
        ({"prior": "regmean"}, r"^prior: regmean needs statistics or data"),
        ({"prior_options": {"density": 0.5}}, r"^prior_options: given without prior"),
        (
            {"prior": "ties", "prior_options": {"densty": 0.5}},
            r"^prior_options: ties takes no option 'densty'; its options are \['density', ",
        ),
        (
            {"prior": "ties", "prior_options": {"density": 2.0}},
            r"^prior_options\.density: must be in \(0, 1\]",
        ),
        ({"prior": "ties", "prior_strength": -1.0}, r"^prior_strength: must be a number >= 0"),
        (
            {"prior": "ties", "prior_strength": {"*": -1.0}},
            r"^prior_strength: must be a number >= 0",
        ),
    ],
)
def test_errors_name_the_option(family, options, message):
    f = family["bert"]
    base = f["base_path"] if "prior" in options else None
    with pytest.raises(MergeError, match=message):
        merge_models(f["paths"], "regmean", stats=f["stats"], base=base, progress=False, **options)


def test_a_prior_needs_the_base(family):
    f = family["bert"]
    with pytest.raises(MergeError, match=r"^base: prior ties merges task vectors .*give base"):
        merge_models(f["paths"], "regmean", stats=f["stats"], prior="ties", progress=False)


def test_groups_with_a_prior_run_here(family):
    """Ray workers open no base: a merge with a prior solves its groups in this process."""
    f = family["bert"]
    res = stream_merge(
        f["paths"], "unused", stats=f["stats"], base=f["base_path"], prior="ties", dry_run=True
    )
    groups = [s for s in res.plan.steps if s.kind == "regmean"]
    assert groups and all(s.method.ray == "local" for s in groups)
    plain = stream_merge(f["paths"], "unused", stats=f["stats"], dry_run=True)
    assert all(s.method.ray == "groups" for s in plain.plan.steps if s.kind == "regmean")
