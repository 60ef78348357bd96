"""Runtime dispatch between the per-instruction-set native modules.

Every variant this CPU can run is loaded and its raw functions are run on the same
inputs: each must match the float64 NumPy reference, and the variants must agree with
one another up to floating-point reassociation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lmdx
import lmdx._core as dispatch
import numpy as np
import pytest
import scipy.linalg

SUPPORTED = dispatch.supported_variants()
BUILT = dispatch.built_variants()
UNSUPPORTED = [v for v in BUILT if v not in SUPPORTED]


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(20240611)
    d, d_out = 101, 150
    x32 = (rng.standard_normal((700, d)) + 0.5).astype(np.float32)
    x64 = rng.standard_normal((700, d)) * 3.0
    weights = rng.uniform(0.0, 2.0, 700)
    weights[::5] = 0.0
    grams = [x.astype(np.float64).T @ x.astype(np.float64) for x in (x32, x64)]
    return {
        "d": d,
        "x32": x32,
        "x64": x64,
        "w": weights,
        "grams": grams,
        "counts": [700.0, 700.0],
        "W": [rng.standard_normal((d_out, d)).astype(np.float32), rng.standard_normal((d_out, d))],
        "b": rng.standard_normal((d, 3)),
        "avg": [
            rng.standard_normal(20_000).astype(np.float32),
            rng.standard_normal(20_000),
        ],
        "fisher": [rng.exponential(1.0, 20_000), rng.exponential(1.0, 20_000).astype(np.float32)],
    }


def run_variant(core, inp):
    """Run the raw module functions of one variant; returns a dict of results."""
    d = inp["d"]
    m32 = core.Moments(dim=d, chunk_rows=64)
    m32.update(x=inp["x32"], weights=None, n_threads=2, bfloat16=False)
    m64 = core.Moments(dim=d, chunk_rows=64)
    m64.update(x=inp["x64"], weights=inp["w"], n_threads=2, bfloat16=False)
    a = inp["grams"][1] / 700.0
    x, info = core.spd_solve(
        a=a, b=inp["b"], alpha=0.9, ridge=1e-3, allow_regularization=True, name="sys", n_threads=2
    )
    merged, rinfo = core.regmean_merge_layer(
        grams=inp["grams"],
        weights=inp["W"],
        counts=inp["counts"],
        alpha=0.9,
        coefficients=[1.0, 2.0],
        layout="linear",
        precision="float64",
        noise_floor=0.0,
        ridge=0.0,
        allow_regularization=True,
        name="layer",
        n_threads=2,
    )
    avg = core.weighted_average(tensors=inp["avg"], coefficients=[1.0, 3.0], n_threads=2)
    fisher = core.fisher_average(
        params=inp["avg"], fishers=inp["fisher"], coefficients=None, eps=0.0, n_threads=2
    )
    return {
        "gram32": m32.gram(),
        "sum32": np.asarray(m32.sum),
        "count32": m32.count,
        "gram64": m64.gram(),
        "sum64": np.asarray(m64.sum),
        "count64": m64.count,
        "solve": x,
        "solve_ridge": info.ridge,
        "merged": merged,
        "merge_escalated": rinfo.escalated,
        "avg": avg,
        "fisher": fisher,
    }


@pytest.fixture(scope="module")
def results(inputs):
    return {v: run_variant(dispatch.load(v), inputs) for v in SUPPORTED}


def test_baseline_is_always_built_and_supported():
    assert "baseline" in BUILT and "baseline" in SUPPORTED
    assert SUPPORTED == [v for v in dispatch.VARIANTS if v in SUPPORTED], "best first"


@pytest.mark.parametrize("variant", SUPPORTED)
def test_each_variant_loads_and_reports_its_isa(variant):
    core = dispatch.load(variant)
    assert core.isa() == variant
    assert core.__version__ == lmdx.__version__


@pytest.mark.parametrize("variant", SUPPORTED)
def test_each_variant_matches_numpy_reference(variant, inputs, results):
    r = results[variant]
    x32 = inputs["x32"].astype(np.float64)
    g32 = x32.T @ x32
    assert r["count32"] == 700.0
    np.testing.assert_allclose(r["sum32"], x32.sum(axis=0), rtol=1e-12)
    assert np.linalg.norm(r["gram32"] - g32) <= 1e-6 * np.linalg.norm(g32)

    w, x64 = inputs["w"], inputs["x64"]
    assert r["count64"] == pytest.approx(w.sum(), rel=1e-14)
    np.testing.assert_allclose(r["sum64"], w @ x64, rtol=1e-11, atol=1e-11)
    g64 = (x64 * w[:, None]).T @ x64
    np.testing.assert_allclose(r["gram64"], g64, rtol=1e-11, atol=1e-11 * np.abs(g64).max())

    a = inputs["grams"][1] / 700.0
    reduced = 0.9 * a + 0.1 * np.diag(np.diag(a)) + 1e-3 * np.mean(np.diag(a)) * np.eye(len(a))
    np.testing.assert_allclose(r["solve"], scipy.linalg.solve(reduced, inputs["b"]), rtol=1e-10)
    assert r["solve_ridge"] == 1e-3

    lhs, rhs = 0.0, 0.0
    for c, g, n, wt in zip(
        [1.0, 2.0], inputs["grams"], inputs["counts"], inputs["W"], strict=False
    ):
        gt = 0.9 * g / n + 0.1 * np.diag(np.diag(g / n))
        lhs = lhs + c * gt
        rhs = rhs + c * gt @ wt.astype(np.float64).T
    merged_ref = scipy.linalg.solve(lhs, rhs, assume_a="pos").T
    assert not r["merge_escalated"]
    np.testing.assert_allclose(r["merged"], merged_ref, rtol=1e-9, atol=1e-10)

    p = [t.astype(np.float64) for t in inputs["avg"]]
    np.testing.assert_allclose(r["avg"], (p[0] + 3.0 * p[1]) / 4.0, rtol=1e-14, atol=1e-15)
    f = [t.astype(np.float64) for t in inputs["fisher"]]
    np.testing.assert_allclose(
        r["fisher"], (f[0] * p[0] + f[1] * p[1]) / (f[0] + f[1]), rtol=1e-13, atol=1e-15
    )


@pytest.mark.skipif(len(SUPPORTED) < 2, reason="only one variant can run on this CPU")
def test_variants_agree(results):
    base = results["baseline"]
    for variant in SUPPORTED:
        r = results[variant]
        # float32 Grams: different SIMD widths reassociate float32 sums.
        np.testing.assert_allclose(
            r["gram32"], base["gram32"], rtol=1e-5, atol=1e-5 * np.abs(base["gram32"]).max()
        )
        for key in ("gram64", "sum32", "sum64", "solve", "merged"):
            scale = np.abs(base[key]).max()
            np.testing.assert_allclose(r[key], base[key], rtol=1e-10, atol=1e-10 * scale)
        assert r["count32"] == base["count32"]
        assert r["count64"] == pytest.approx(base["count64"], rel=1e-15)
        np.testing.assert_allclose(r["avg"], base["avg"], rtol=1e-15, atol=1e-15)
        np.testing.assert_allclose(r["fisher"], base["fisher"], rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("variant", SUPPORTED)
def test_each_variant_raises_the_python_error_classes(monkeypatch, variant):
    core = dispatch.load(variant)
    singular = np.diag([1.0, 0.0, 1.0])
    # The native module has its own exception type (it imports nothing from the package)...
    assert issubclass(core.NotPositiveDefiniteError, ValueError)
    assert not issubclass(core.NotPositiveDefiniteError, lmdx.LmdxError)
    with pytest.raises(
        core.NotPositiveDefiniteError, match=r"^probe: not numerically positive"
    ) as raw:
        core.spd_solve(
            a=singular,
            b=np.ones(3),
            alpha=1.0,
            ridge=0.0,
            allow_regularization=False,
            name="probe",
            n_threads=1,
        )
    # ... which the public API, run on this variant, raises as lmdx.NotPositiveDefiniteError
    # with the message unchanged.
    monkeypatch.setattr(dispatch, "core", core)
    with pytest.raises(lmdx.NotPositiveDefiniteError) as public:
        lmdx.spd_solve(singular, np.ones(3), allow_regularization=False, name="probe")
    assert str(public.value) == str(raw.value)
    assert isinstance(public.value, lmdx.LmdxError) and isinstance(public.value, ValueError)
    with pytest.raises(lmdx.NotPositiveDefiniteError, match=r"^probe: not numerically positive"):
        lmdx.regmean_merge_layer(
            [singular, singular],
            [np.ones((2, 3)), np.zeros((2, 3))],
            [1.0, 1.0],
            allow_regularization=False,
            name="probe",
        )
    with pytest.raises(ValueError, match=r"^x: expected 3 columns"):
        core.Moments(dim=3, chunk_rows=8).update(
            x=np.ones((2, 4)), weights=None, n_threads=1, bfloat16=False
        )


def test_baseline_runs_on_any_x86_64():
    # The baseline module must not have been compiled for the build machine's CPU.
    simd = dispatch.load("baseline").eigen_simd()
    assert "AVX" not in simd, simd


@pytest.mark.skipif("avx2" not in SUPPORTED, reason="the avx2 variant cannot run on this CPU")
def test_avx2_variant_uses_avx():
    assert "AVX" in dispatch.load("avx2").eigen_simd()


@pytest.mark.parametrize(
    ("variant", "f32", "f64"),
    [("avx512", (48, 8), (24, 8)), ("avx2", (24, 4), (12, 4)), ("baseline", (12, 4), (6, 2))],
)
def test_each_variant_has_its_own_gram_tile(variant, f32, f64):
    # The register tile follows the variant's vector width and register count: proof that
    # each module really carries its own compiled kernel.
    if variant not in SUPPORTED:
        pytest.skip(f"the {variant} variant cannot run on this CPU")
    tile = dispatch.load(variant).gram_tile()
    assert tile == {"float32": f32, "float64": f64}


def test_unknown_variant_is_a_value_error():
    with pytest.raises(ValueError, match=r"must be one of avx512, avx2, baseline; got 'nonsense'"):
        dispatch.load("nonsense")


@pytest.mark.skipif(not UNSUPPORTED, reason="every built variant runs on this CPU")
def test_built_but_unsupported_variant_is_a_runtime_error():
    variant = UNSUPPORTED[0]
    with pytest.raises(RuntimeError, match=rf"variant '{variant}' cannot run here"):
        dispatch.load(variant)


class _CpuWithout:
    """The baseline module, but reporting a CPU without the given feature levels."""

    def __init__(self, real, *missing: str) -> None:
        self._real, self._missing = real, missing

    def cpu_features(self):
        return {**self._real.cpu_features(), **dict.fromkeys(self._missing, False)}


@pytest.mark.parametrize(("missing", "refused", "chosen"), [
    (("x86-64-v4",), "avx512", "avx2"),
    # x86-64-v4 implies v3: a CPU without v3 has no AVX-512 either
    (("x86-64-v4", "x86-64-v3"), "avx2", "baseline"),
])  # fmt: skip
def test_choice_and_refusal_follow_the_cpu_features(monkeypatch, missing, refused, chosen):
    # Runs on every machine (the real refusal above needs a CPU that lacks a built level):
    # the same dispatch code, fed the feature set of an older CPU.
    if refused not in BUILT or chosen not in SUPPORTED:
        pytest.skip(f"{refused} not built or {chosen} not runnable here")
    real = dispatch._baseline()
    monkeypatch.setattr(dispatch, "_baseline", lambda: _CpuWithout(real, *missing))
    monkeypatch.delenv("LMDX_SIMD", raising=False)
    assert refused not in dispatch.supported_variants()
    assert dispatch.load().__name__.endswith(f"_core_{chosen}")
    with pytest.raises(RuntimeError, match=rf"variant '{refused}' cannot run here"):
        dispatch.load(refused)


def test_config_reports_the_running_variant():
    cfg = lmdx.config()
    assert cfg["simd_path"] == dispatch.core.isa()
    assert cfg["built_paths"] == BUILT and cfg["supported_paths"] == SUPPORTED
    forced = os.environ.get("LMDX_SIMD") or None
    assert cfg["simd_forced"] == forced
    assert cfg["simd_path"] == (forced or SUPPORTED[0])
    assert cfg["version"] == lmdx.__version__
    assert cfg["default_threads"] >= 1


PROBE = """
import json, numpy as np, lmdx
x = np.arange(12.0).reshape(4, 3)
m = lmdx.Moments(3).update(x)
print(json.dumps({"config": lmdx.config(), "gram": m.gram().tolist()}))
"""


def run_python(code: str, simd: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LMDX_SIMD": simd}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("variant", SUPPORTED)
def test_lmdx_simd_forces_a_variant(variant):
    proc = run_python(PROBE, variant)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["config"]["simd_path"] == variant
    assert out["config"]["simd_forced"] == variant
    x = np.arange(12.0).reshape(4, 3)
    np.testing.assert_allclose(out["gram"], x.T @ x, rtol=1e-15)


def test_lmdx_simd_rejects_unknown_value():
    proc = run_python("import lmdx", "sse9")
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and "got 'sse9'" in proc.stderr


@pytest.mark.skipif(not UNSUPPORTED, reason="every built variant runs on this CPU")
def test_lmdx_simd_rejects_a_variant_this_cpu_cannot_run():
    proc = run_python("import lmdx", UNSUPPORTED[0])
    assert proc.returncode != 0
    assert "RuntimeError" in proc.stderr and "cannot run here" in proc.stderr
