"""TSV-M, ISO-C, ISO-CTS and the SVC post-step against float64 references written in
tests/data_free_refs.py (SciPy's gesvd and polar; lmdx uses NumPy's gesdd).

Per task matrix (``[out, in]``, task vectors ``c_i τ_i``):

* TSV-M: each task's top ``k = max(1, ⌊r f⌋)`` singular triplets (``f`` default 1/K),
  concatenated; U and V replaced by their polar factors; ``α U_⊥ Σ V_⊥ᵀ``.
* ISO-C: ``α σ̄ polar(Σ c_i τ_i)``, ``σ̄`` the mean singular value.
* ISO-CTS: the common subspace (top ``r − K s`` of the sum) and each task's top ``s``
  outside it, whitened, spectrum flattened to its mean.
* SVC: the merged update's SVD; per direction the tasks' projection coefficients;
  ``γ_r = Σ c / Σ c max(α, s_ri)``.

Every other tensor: ``θ_0 + α × Σ c_i τ_i / Σ c_i``. Through the front doors on tiny
BERT and GPT-2 families in float64 (GPT-2's ``Conv1D`` weights transposed for ISO-CTS
and SVC, whose results depend on the orientation).
"""

from __future__ import annotations

import copy
import re

import hf_models as H
import numpy as np
import pytest
import torch
from data_free_refs import ref_iso_c, ref_iso_cts, ref_iso_cts_split, ref_svc, ref_tsv
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from lmdx import MergeError, merge_models
from lmdx.merge import stream_merge
from lmdx.merge.builtin.isotropic import iso_c_merge, iso_cts_merge
from lmdx.merge.builtin.svc import svc_calibrate
from lmdx.merge.builtin.tsv import tsv_merge
from safetensors.torch import load_file
from task_vectors import ref_merge
from transformers.pytorch_utils import Conv1D

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@st.composite
def _task_matrices(draw, min_k=2):
    out = draw(st.integers(1, 9))
    inp = draw(st.integers(1, 9))
    k = draw(st.integers(min_k, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-4, 1.0, 30.0]))
    rng = np.random.default_rng(seed)
    taus = [scale * rng.standard_normal((out, inp)) for _ in range(k)]
    return taus


def _close(got, ref, rtol=1e-9):
    assert got.shape == ref.shape
    assert np.linalg.norm(got - ref) <= rtol * max(np.linalg.norm(ref), 1e-300)


def _gapped(taus, k):
    """The truncation at k is well posed: a relative gap after the k-th singular value."""
    for t in taus:
        s = np.linalg.svd(t, compute_uv=False)
        if k < len(s) and s[k - 1] - s[k] < 1e-6 * s[0]:
            return False
    return True


@given(taus=_task_matrices(), fraction=st.sampled_from([None, 0.2, 0.5, 1.0]))
@settings(deadline=None)
def test_tsv_merge_equals_the_reference(taus, fraction):
    r = min(taus[0].shape)
    k = max(1, int(r * (fraction if fraction is not None else 1 / len(taus))))
    assume(_gapped(taus, k))
    concat = np.hstack([np.linalg.svd(t)[0][:, :k] for t in taus])
    assume(np.linalg.svd(concat, compute_uv=False).min() > 1e-6)  # whitening well posed
    _close(tsv_merge(taus, fraction), ref_tsv(taus, fraction), 1e-7)


@given(taus=_task_matrices())
@settings(deadline=None)
def test_iso_c_merge_equals_the_reference(taus):
    assume(np.linalg.svd(sum(taus), compute_uv=False).min() > 1e-8 * np.abs(sum(taus)).max())
    _close(iso_c_merge(taus), ref_iso_c(taus), 1e-7)


@given(taus=_task_matrices(), fraction=st.sampled_from([0.0, 0.5, 0.8, 1.0]))
@settings(deadline=None)
def test_iso_cts_merge_equals_the_reference(taus, fraction):
    r = min(taus[0].shape)
    total = np.linalg.svd(sum(taus), compute_uv=False)
    common, _ = ref_iso_cts_split(r, len(taus), fraction)
    assume(common == 0 or common == r or total[common - 1] - total[common] > 1e-6 * total[0])
    got = iso_cts_merge(taus, fraction)
    assume(np.isfinite(got).all())
    _close(got, ref_iso_cts(taus, fraction), 1e-6)


@given(
    taus=_task_matrices(),
    alpha=st.sampled_from([0.1, 0.5, 1.0, 2.0]),
    coefficients=st.sampled_from([None, (1.0, 2.0, 0.5, 3.0)]),
)
@settings(deadline=None)
def test_svc_calibrate_equals_the_reference(taus, alpha, coefficients):
    c = [1.0] * len(taus) if coefficients is None else list(coefficients[: len(taus)])
    delta = sum(taus)  # task arithmetic at λ 1: the over-counted case
    s = np.linalg.svd(delta, compute_uv=False)
    assume(len(s) < 2 or np.diff(s).max() < -1e-6 * s[0])  # distinct singular values
    _close(svc_calibrate(delta, taus, c, alpha), ref_svc(delta, taus, c, alpha), 1e-7)


def test_svc_leaves_a_single_task_as_it_is_and_scales_a_repeated_one():
    rng = np.random.default_rng(0)
    tau = rng.standard_normal((6, 4))
    # one task merged as itself: s = 1 in every direction, γ = 1 for α <= 1
    np.testing.assert_allclose(svc_calibrate(tau, [tau], [1.0], 0.5), tau, rtol=1e-12)
    # the same task K times summed: s = K, γ = K / (K · K) = 1/K: back to one copy
    np.testing.assert_allclose(svc_calibrate(3 * tau, [tau] * 3, [1.0] * 3, 0.1), tau, rtol=1e-12)


def test_tsv_keeps_one_task_and_leaves_out_zero_task_matrices():
    rng = np.random.default_rng(1)
    tau = rng.standard_normal((5, 7))
    np.testing.assert_allclose(tsv_merge([tau], 1.0), tau, rtol=1e-12, atol=1e-12)
    # a task matrix of zeros adds nothing (its arbitrary singular vectors are left out)
    np.testing.assert_allclose(
        tsv_merge([tau, np.zeros_like(tau)], 1.0), tsv_merge([tau], 1.0), rtol=1e-12
    )


# --------------------------------------------------------------------------- models


def _conv1d(model):
    return {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Conv1D)}


def _ref_model(method, options, base, models, arch, coefficients=None):
    """Every body tensor of the reference merge."""
    theta0 = H.state_arrays(base)
    states = [H.state_arrays(m) for m in models]
    conv1d = _conv1d(models[0])
    c = [1.0] * len(models) if coefficients is None else list(coefficients)
    alpha = options.get("scaling", 1.0)
    out = {}
    for name, t0 in theta0.items():
        if H.is_head(name, arch) or not models[0].state_dict()[name].is_floating_point():
            continue
        thetas = [s[name] for s in states]
        if t0.ndim != 2:
            mean = sum(ci * (t - t0) for ci, t in zip(c, thetas, strict=True)) / sum(c)
            out[name] = t0 + alpha * mean
            continue
        turn = name in conv1d and method == "iso_cts"
        taus = [ci * (t - t0) for ci, t in zip(c, thetas, strict=True) if ci > 0]
        taus = [t.T for t in taus] if turn else taus
        if method == "tsv_m":
            delta = ref_tsv(taus, options.get("rank_fraction"))
        elif method == "iso_c":
            delta = ref_iso_c(taus)
        else:
            delta = ref_iso_cts(taus, options.get("common_space_fraction", 0.8))
        out[name] = t0 + alpha * (delta.T if turn else delta)
    return out


CASES = [
    ("tsv_m", {}),
    ("tsv_m", {"scaling": 0.7, "rank_fraction": 0.5, "coefficients": (1.0, 0.5, 2.0)}),
    ("iso_c", {}),
    ("iso_c", {"scaling": 1.5, "coefficients": (1.0, 0.0, 2.0)}),
    ("iso_cts", {}),
    ("iso_cts", {"scaling": 0.5, "common_space_fraction": 0.5}),
]


@pytest.mark.parametrize(("method", "options"), CASES)
@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_models_equal_the_reference(arch, method, options):
    base, models, _ = H.cached_family(arch, "float64")
    result = merge_models(models, method, base=base, heads=H.HEADS[arch], progress=False, **options)
    expected = _ref_model(method, options, base, models, arch, options.get("coefficients"))
    assert set(result.state_dict) >= set(expected)
    for name, ref in expected.items():
        assert H.rel_err(result.state_dict[name], ref) <= 1e-9, name
    own = {k: v for k, v in options.items() if k != "coefficients"}
    assert {k: result.report[k] for k in own} == own


@pytest.mark.parametrize("method", ["tsv_m", "iso_c", "iso_cts", "wudi", "ties+svc"])
def test_a_tensor_no_model_changed_stays_at_the_base(method):
    """A frozen layer (every model's tensor equal to the base's) is the base's, bit for bit,
    and the tensors beside it are merged as without it."""
    base, models, _ = H.cached_family("bert", "float64")
    frozen = "bert.encoder.layer.0.attention.self.query.weight"
    kw = {"base": base, "heads": H.HEADS["bert"], "progress": False}
    moved = merge_models(models, method, **kw).state_dict
    still = [copy.deepcopy(m) for m in models]
    for m in still:
        m.state_dict()[frozen].copy_(base.state_dict()[frozen])
    result = merge_models(still, method, **kw).state_dict
    assert torch.equal(result[frozen], base.state_dict()[frozen])
    other = "bert.encoder.layer.1.attention.self.query.weight"
    assert torch.equal(result[other], moved[other])
    assert not torch.equal(moved[frozen], base.state_dict()[frozen])


def test_streaming_equals_in_memory(tmp_path):
    base, models, _ = H.cached_family("bert")
    paths = []
    for i, m in enumerate(models):
        m.save_pretrained(tmp_path / f"m{i}")
        paths.append(tmp_path / f"m{i}")
    base.save_pretrained(tmp_path / "base")
    for method in ("tsv_m", "iso_c", "iso_cts", "ties+svc"):
        kw = {"base": tmp_path / "base", "heads": H.HEADS["bert"], "progress": False}
        stream_merge(paths, tmp_path / method, method, **kw)
        on_disk = load_file(str(tmp_path / method / "model.safetensors"))
        memory = merge_models(models, method, base=base, heads=H.HEADS["bert"], progress=False)
        for name, t in memory.state_dict.items():
            assert torch.equal(on_disk[name], t), (method, name)


# --------------------------------------------------------------------------- SVC


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_ties_then_svc_equals_the_reference(arch):
    base, models, _ = H.cached_family(arch, "float64")
    coefficients = (1.0, 2.0, 0.5)
    kw = {"base": base, "heads": H.HEADS[arch], "progress": False, "coefficients": coefficients}
    result = merge_models(models, "ties+svc", density=0.5, svc_alpha=0.3, **kw)
    theta0 = H.state_arrays(base)
    states = [H.state_arrays(m) for m in models]
    conv1d = _conv1d(models[0])
    for name, got in result.state_dict.items():
        t0 = theta0[name]
        thetas = [s[name] for s in states]
        ties = ref_merge("ties", name, t0, thetas, coefficients, 0.5, 1.0)
        if t0.ndim == 2:
            turn = (lambda x: x.T) if name in conv1d else (lambda x: x)
            tasks = [turn(t - t0) for t in thetas]
            ties = t0 + turn(ref_svc(turn(ties - t0), tasks, list(coefficients), 0.3))
        assert H.rel_err(got, ties) <= 1e-9, name
    assert result.report["method"] == "ties+svc"
    assert result.report["svc_alpha"] == 0.3 and result.report["density"] == 0.5


def test_svc_follows_methods_without_a_base_of_their_own():
    base, models, _ = H.cached_family("bert", "float64")
    heads = H.HEADS["bert"]
    plain = merge_models(models, "average", heads=heads, progress=False)
    calibrated = merge_models(models, "average+svc", base=base, heads=heads, progress=False)
    name = "bert.encoder.layer.0.attention.self.query.weight"
    theta0 = H.state_arrays(base)[name]
    tasks = [H.state_arrays(m)[name] - theta0 for m in models]
    avg = plain.state_dict[name].numpy()
    ref = theta0 + ref_svc(avg - theta0, tasks, [1.0] * 3, 0.1)
    assert H.rel_err(calibrated.state_dict[name], ref) <= 1e-9
    bias = "bert.encoder.layer.0.attention.self.query.bias"  # not a matrix: as averaged
    assert torch.equal(calibrated.state_dict[bias], plain.state_dict[bias])


def test_svc_errors_are_one_line():
    base, models, _ = H.cached_family("bert")
    kw = {"heads": H.HEADS["bert"], "progress": False}
    with pytest.raises(MergeError, match=r"base: method average\+svc needs the pre-trained"):
        merge_models(models, "average+svc", **kw)
    with pytest.raises(MergeError, match=r"no post-step 'svd'.*ties\+svc"):
        merge_models(models, "ties+svd", base=base, **kw)
    with pytest.raises(
        MergeError, match=r"svc_alpha: only used by method ties\+svc, not ties; leave it out"
    ):
        merge_models(models, "ties", base=base, svc_alpha=0.5, **kw)
    with pytest.raises(MergeError, match=r"svc_alpha: must be a number > 0, got 0"):
        merge_models(models, "ties+svc", base=base, svc_alpha=0, **kw)


def test_matrix_method_options_are_checked():
    base, models, _ = H.cached_family("bert")
    kw = {"base": base, "heads": H.HEADS["bert"], "progress": False}
    with pytest.raises(MergeError, match=r"rank_fraction: must be in \(0, 1\]"):
        merge_models(models, "tsv_m", rank_fraction=0.0, **kw)
    with pytest.raises(MergeError, match=r"common_space_fraction: must be in \[0, 1\]"):
        merge_models(models, "iso_cts", common_space_fraction=1.5, **kw)
    with pytest.raises(MergeError, match=r"rank_fraction: only used by method tsv_m, not iso_c"):
        merge_models(models, "iso_c", rank_fraction=0.5, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["ties+svc", "task_arithmetic+svc", "tsv_m+svc", "iso_c+svc"])
def test_svc_on_16_bit_models_rounds_once(method, dtype):
    """SVC calibrates the method's float64 values and the result is cast once: a 16-bit
    merge is the float32 merge of the same (upcast) values, rounded once, bit for bit. It
    once calibrated values already rounded to the input dtype: off by several roundings
    (up to 34 % of the largest update entry here, where one rounding is 4–11 %)."""
    from lmdx import merge_state_dicts

    gen = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(48, 32, generator=gen), "b": torch.randn(32, generator=gen)}
    models = {"base": base}
    for i in range(3):
        models[i] = {n: t + 0.02 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
    narrow = {k: {n: t.to(dtype) for n, t in m.items()} for k, m in models.items()}
    upcast = {k: {n: t.float() for n, t in m.items()} for k, m in narrow.items()}
    merged = merge_state_dicts(narrow, method, base="base")
    reference = merge_state_dicts(upcast, method, base="base")
    for name in ("w", "b"):
        assert merged[name].dtype == dtype
        assert torch.equal(merged[name], reference[name].to(dtype)), name


@pytest.mark.parametrize("method", ["tsv_m", "tsv_m+svc", "iso_c", "iso_cts", "wudi"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("where", ["base", 1])
def test_a_non_finite_task_vector_is_refused_by_name(method, bad, where):
    """An Inf in one model once became "no update" through TSV-M (LAPACK's NaN singular
    values made its floor NaN, so nothing was kept: exit 0, the base's weight); a NaN was
    LAPACK's "SVD did not converge", and WUDI's a ValueError naming no model. Now every
    method that factors task matrices refuses it in one line naming tensor and model (a
    model's values as they are read, for every method; the base's through the task
    vectors)."""
    from lmdx import merge_state_dicts

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=gen)
    models = {"base": {"w": w.clone()}, 0: {"w": w + 0.1}, 1: {"w": w - 0.1}}
    models[where]["w"][0, 0] = bad
    said = (
        r"^tensor 'w' of the base holds NaN or Inf"  # the base's values, as read
        if where == "base"
        else r"^tensor 'w'( of 1 holds NaN or Inf|: the task vector of model 1 )"  # as read
    )
    with pytest.raises(MergeError, match=said):
        merge_state_dicts(models, method, base="base")


@pytest.mark.parametrize("method", ["tsv_m", "iso_c", "iso_cts", "ties+svc"])
def test_a_factorization_lapack_refuses_is_one_line_naming_the_tensor(method, monkeypatch):
    """An SVD that does not converge on finite inputs (LAPACK's LinAlgError, rare but
    possible) is one MergeError naming the tensor and the method, with what to do."""
    from lmdx import merge_state_dicts

    def refuses(*args, **kwargs):
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr(np.linalg, "svd", refuses)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=gen)
    models = {"base": {"w": w}, 0: {"w": w + 0.1}, 1: {"w": w - 0.2}}
    name = method.split("+")[-1]
    said = rf"^tensor 'w': {re.escape(name)}: the factorization of its task matrices failed"
    with pytest.raises(MergeError, match=said):
        merge_state_dicts(models, method, base="base")


def test_the_conv1d_probe_never_misses_a_conv1d_layer():
    """``may_hold_conv1d`` reads transformers' modeling files as text so that TSV-M, WUDI
    and SVC need not import torch and build the model class for models that have no
    ``Conv1D``: for every family the tests build, a model with such a layer is never
    declared free of them, and BERT and Llama (no Conv1D) are."""
    import hf_families
    import transformers
    from lmdx.files.hf import may_hold_conv1d
    from transformers.pytorch_utils import Conv1D

    told_free = []
    for family in hf_families.FAMILIES.values():
        config = family.config()
        model = getattr(transformers, family.cls)(config)
        has = any(isinstance(m, Conv1D) for m in model.modules())
        if has:
            assert may_hold_conv1d(config.to_dict()), family.name
        elif not may_hold_conv1d(config.to_dict()):
            told_free.append(config.model_type)
    assert {"bert", "llama"} <= set(told_free), told_free
    assert may_hold_conv1d({"model_type": "gpt2"})
    assert may_hold_conv1d({"model_type": "no-such-type"}) and may_hold_conv1d({})
    assert may_hold_conv1d({"model_type": "bert", "auto_map": {"AutoModel": "mine.Model"}})
