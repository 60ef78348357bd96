"""lmdx.merge_state_dicts: mergekit's in-memory door (the arguments sentence-transformers
passes) with lmdx's methods, RegMean included. Checked against float64 NumPy references
written here and in tests/task_vectors.py, and against lmdx's own merge_models."""

from __future__ import annotations

import copy
import re

import hf_models as H
import numpy as np
import pytest
import torch
from lmdx import MergeError, merge_models, merge_state_dicts
from lmdx.merge.registry import method_named, methods
from task_vectors import ref_merge

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def states(k: int = 3) -> tuple[dict, list[dict]]:
    base, models, _ = H.cached_family("bert", k=k)
    return base.state_dict(), [m.state_dict() for m in models]


def as64(t) -> np.ndarray:
    return t.detach().double().numpy()


def test_linear_is_lmdx_average_with_weights_and_keeps_keys_order_and_buffers():
    _, sds = states()
    weights = [1.0, 2.0, 0.5]
    out = merge_state_dicts(sds, "linear", parameters={"weight": weights})
    assert list(out) == list(sds[0])
    for name, t in out.items():
        if not t.is_floating_point():  # position ids, token type ids: copied
            assert torch.equal(t, sds[0][name]), name
            continue
        ref = sum(w * as64(sd[name]) for w, sd in zip(weights, sds, strict=True)) / sum(weights)
        assert H.rel_err(t, ref) <= 1e-6, name  # float32 output of a float64 average
        assert t.dtype == sds[0][name].dtype


def test_base_is_one_of_the_ids_and_task_vectors_follow_the_papers():
    base_sd, sds = states()
    models = {"base": base_sd, "a": sds[0], "b": sds[1], "c": sds[2]}
    out = merge_state_dicts(
        models, "ties", base="base", parameters={"density": 0.4, "scaling": 0.8}
    )
    direct = merge_models(sds, "ties", base=base_sd, density=0.4, scaling=0.8, progress=False)
    for name, t in out.items():
        if not t.is_floating_point():
            continue
        assert torch.equal(t, direct.state_dict[name]), name
        ref = ref_merge(
            "ties", name, as64(base_sd[name]), [as64(sd[name]) for sd in sds], [1.0] * 3, 0.4, 0.8
        )
        assert H.rel_err(t, ref) <= 1e-6, name


def test_per_input_weights_by_id_or_in_input_order_skip_the_base():
    base_sd, sds = states(2)
    ids = {"base": base_sd, "x": sds[0], "y": sds[1]}
    by_id = merge_state_dicts(
        ids, "task_arithmetic", base="base", parameters={"weight": {"x": 1.0, "y": 3.0}}
    )
    in_order = merge_state_dicts(
        [base_sd, *sds], "task_arithmetic", base=0, parameters={"weight": [9.0, 1.0, 3.0]}
    )
    direct = merge_models(
        sds, "task_arithmetic", base=base_sd, coefficients=[1.0, 3.0], progress=False
    )
    for name in direct.state_dict:
        assert torch.equal(by_id[name], direct.state_dict[name]), name
        assert torch.equal(in_order[name], direct.state_dict[name]), name


def test_dtype_casts_the_inputs_and_out_dtype_the_result():
    _, sds = states(2)
    out = merge_state_dicts(sds, "average", dtype=torch.bfloat16, out_dtype=torch.float16)
    for name, t in out.items():
        if not sds[0][name].is_floating_point():
            continue
        assert t.dtype == torch.float16, name
        rounded = [as64(sd[name].to(torch.bfloat16)) for sd in sds]
        ref = torch.from_numpy((rounded[0] + rounded[1]) / 2).to(torch.bfloat16).half()
        assert torch.equal(t, ref), name


def test_regmean_with_statistics_equals_merge_models():
    _, models, batches = H.cached_family("bert")
    stats = [H.collect(m, list(b)) for m, b in zip(models, batches, strict=True)]
    out = merge_state_dicts(
        models, "regmean", statistics=stats, parameters={"alpha": 0.9, "heads": H.HEADS["bert"]}
    )
    direct = merge_models(
        models, "regmean", stats=stats, alpha=0.9, heads=H.HEADS["bert"], progress=False
    )
    for name, t in direct.model_state(0).items():
        assert torch.equal(out[name], t), name


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # sentence-transformers' own
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sentence_transformers_models_with_statistics(tmp_path):
    from sentence_transformers import SentenceTransformer, models
    from tiny_bert import build_tiny_bert

    tiny = build_tiny_bert(tmp_path / "tiny")
    transformer = models.Transformer(str(tiny), max_seq_length=16)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), "mean")
    template = SentenceTransformer(modules=[transformer, pooling], device="cpu")
    encoders = []
    for seed in range(2):
        m = copy.deepcopy(template)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        encoders.append(m)
    tok = transformer.tokenizer
    texts = [["alpha beta gamma", "delta"], ["beta beta", "gamma delta alpha beta"]]
    from lmdx import collect_regmean_stats

    stats = [
        collect_regmean_stats(m, [dict(tok(t, padding=True, return_tensors="pt"))], progress=False)
        for m, t in zip(encoders, texts, strict=True)
    ]
    out = merge_state_dicts(encoders, "regmean", statistics=stats)
    assert list(out) == list(encoders[0].state_dict())
    inner = [e[0].auto_model for e in encoders]
    direct = merge_models(inner, "regmean", stats=stats, progress=False)
    prefix = next(n for n in out if n.endswith("encoder.layer.0.attention.self.query.weight"))
    prefix = prefix[: -len("encoder.layer.0.attention.self.query.weight")]
    for name, t in direct.state_dict.items():
        assert torch.equal(out[prefix + name], t), name
    merged = copy.deepcopy(encoders[0])
    merged.load_state_dict(out)  # the result loads as the model's own state dict
    assert merged.encode(["alpha gamma"]).shape == (1, template.get_sentence_embedding_dimension())


def test_errors_name_what_to_do():
    _, sds = states(2)
    with pytest.raises(MergeError, match=r"^merge_state_dicts: base 'nope' is not one of"):
        merge_state_dicts(sds, "average", base="nope")
    fewer = dict(sds[1])
    dropped = next(iter(fewer))
    del fewer[dropped]
    with pytest.raises(MergeError, match=r"hold different tensors .*strict=False"):
        merge_state_dicts([sds[0], fewer], "average")
    out = merge_state_dicts([sds[0], fewer], "average", strict=False)
    assert dropped not in out and len(out) == len(sds[0]) - 1
    one, other = dict(sds[0]), dict(sds[1])
    one["steps"], other["steps"] = torch.tensor([3]), torch.tensor([4])
    with pytest.raises(MergeError, match=r"tensor 'steps' \(torch.int64, not merged\) differs"):
        merge_state_dicts([one, other], "average")
    other["steps"] = torch.tensor([3])
    assert torch.equal(merge_state_dicts([one, other], "average")["steps"], one["steps"])
    with pytest.raises(MergeError, match=r"statistics has 1 entries for 2 merged models"):
        merge_state_dicts(sds, "regmean", statistics=[H.collect(*_first_bert())])
    with pytest.raises(MergeError, match=r"model 1 is a str"):
        merge_state_dicts([sds[0], "no"], "average")


def _first_bert():
    _, models, batches = H.cached_family("bert")
    return models[0], list(batches[0])


def _data_free_methods() -> list[str]:
    return [n for n, m in methods().items() if not m.stats and not m.takes_data]


@pytest.mark.parametrize("method", _data_free_methods())
def test_zero_dim_tensors_keep_their_shape(method):
    """CLIP's ``logit_scale`` (a float scalar) and BatchNorm's ``num_batches_tracked`` (an
    integer one) come back 0-dim, whatever the method (NumPy's ascontiguousarray once made
    them shape (1,)). The scalar is what every method makes of a tensor of one entry."""
    gen = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(4, 6, generator=gen), "logit_scale": torch.tensor(2.5)}
    models = {"base": {**base, "steps": torch.tensor(7)}}
    for i in range(2):
        models[i] = {
            "w": base["w"] + 0.1 * torch.randn(4, 6, generator=gen),
            "logit_scale": torch.tensor(2.5 + 0.25 * (i + 1)),
            "steps": torch.tensor(7),
        }
    needs_base = method_named(method).needs_base
    inputs = models if needs_base else {i: models[i] for i in (0, 1)}
    out = merge_state_dicts(inputs, method, base="base" if needs_base else None)
    assert out["logit_scale"].shape == () and out["logit_scale"].dtype == torch.float32
    assert out["steps"].shape == () and int(out["steps"]) == 7
    assert out["w"].shape == (4, 6)
    as_vector = {
        k: {n: t.reshape(1) if n == "logit_scale" else t for n, t in m.items()}
        for k, m in inputs.items()
    }
    vector = merge_state_dicts(as_vector, method, base="base" if needs_base else None)
    assert torch.equal(out["logit_scale"].reshape(1), vector["logit_scale"])


def test_zero_dim_tensors_merge_through_folders(tmp_path, capsys):
    from lmdx.cli import main
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    for i in range(2):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        tensors = {
            "w": torch.full((2, 3), float(i)),
            "logit_scale": torch.tensor(1.0 + i),
            "bn.num_batches_tracked": torch.tensor(5),
        }
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "m.yaml").write_text("method: average\nmodels: [m0, m1]\n")
    assert main(["merge", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "out")]) == 0
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert merged["logit_scale"].shape == () and merged["logit_scale"] == 1.5
    assert merged["bn.num_batches_tracked"].shape == () and merged["bn.num_batches_tracked"] == 5


@pytest.mark.parametrize("method", _data_free_methods())
@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0,)])
def test_empty_tensors_come_back_empty(method, shape):
    """A tensor with no entries (a vocabulary of zero added tokens) merges to itself with
    every method (DELLA's ranking once failed to reshape it)."""
    gen = torch.Generator().manual_seed(1)
    models = {
        key: {"empty": torch.zeros(shape), "v": torch.randn(5, generator=gen)}
        for key in ("base", 0, 1)
    }
    needs_base = method_named(method).needs_base
    inputs = models if needs_base else {i: models[i] for i in (0, 1)}
    out = merge_state_dicts(inputs, method, base="base" if needs_base else None)
    assert out["empty"].shape == shape and out["v"].shape == (5,)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("bfloat16", torch.bfloat16),
        ("torch.float16", torch.float16),
        (np.float32, torch.float32),
        (np.dtype("float64"), torch.float64),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_a_dtype_is_a_torch_dtype_its_name_or_a_numpy_float_type(given, expected):
    _, sds = states(2)
    direct = merge_state_dicts(sds, "average", dtype=expected, out_dtype=expected)
    named = merge_state_dicts(sds, "average", dtype=given, out_dtype=given)
    for name, t in named.items():
        assert t.dtype == direct[name].dtype and torch.equal(t, direct[name]), name


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"dtype": torch.int8}, "dtype must be a floating-point dtype"),
        ({"dtype": torch.bool}, "dtype must be a floating-point dtype"),
        ({"dtype": torch.complex64}, "dtype must be a floating-point dtype"),
        ({"dtype": torch.float8_e4m3fn}, "dtype must be a floating-point dtype"),
        ({"dtype": "float33"}, "got 'float33'"),
        ({"out_dtype": "x"}, "out_dtype must be a floating-point dtype"),
        ({"method": None}, "method must be a method's name"),
        ({"models": None}, "models must be a list of state dicts"),
    ],
    ids=["int8", "bool", "complex64", "float8", "float33", "out x", "method None", "models None"],
)
def test_arguments_a_merge_cannot_use_are_one_lmdx_error(kwargs, said):
    """Never the first model's tensors unmerged (an integer dtype once did that), never a
    library's exception: a MergeError that says what is accepted."""
    _, sds = states(2)
    call = {"models": sds, "method": "average", **kwargs}
    with pytest.raises(MergeError, match=rf"^merge_state_dicts: .*{re.escape(said)}"):
        merge_state_dicts(**call)


def test_meta_device_tensors_are_refused_by_name():
    _, sds = states(2)
    meta = {n: torch.empty_like(t, device="meta") for n, t in sds[1].items()}
    with pytest.raises(MergeError, match=r"model 1: tensor '.*' is on the meta device"):
        merge_state_dicts([sds[0], meta], "average")


@pytest.mark.parametrize("method", ["model_stock", "karcher", "slerp", "average", "breadcrumbs"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_weight_is_named_before_any_method_sees_it(method, bad):
    """Model Stock once blamed the task vectors' cosine and Karcher advised a larger
    max_iter for an Inf weight: a model's tensor with NaN or Inf is refused as it is read,
    naming the tensor and the model, whatever the method."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=gen)
    models = {"base": {"w": w.clone()}, "a": {"w": w + 0.1}, "b": {"w": w - 0.1}}
    models["b"]["w"][0, 0] = bad
    needs_base = method_named(method).needs_base
    inputs = models if needs_base else {k: models[k] for k in ("a", "b")}
    with pytest.raises(MergeError, match=r"^tensor 'w' of b holds NaN or Inf; lmdx merges"):
        merge_state_dicts(inputs, method, base="base" if needs_base else None)
