"""A merge method defined here, in the test, and registered as an outside package would:
it runs through a configuration file, ``lmdx merge --dry-run``, a real merge, the report,
``lmdx_merge.json`` and the model card with no lmdx source file changed. The reference is
NumPy in float64 on the tensors as saved.

Also: every built-in method is registered, described in the card and ``lmdx methods``,
and its options are checked by its own model.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar

import hf_models as H
import numpy as np
import pytest
from lmdx import MergeError
from lmdx.cli import main
from lmdx.merge import (
    MergeMethod,
    NoOptions,
    merge_models,
    register_method,
    stream_merge,
)
from lmdx.merge.builtin.regmean_plusplus import RegMeanPlusPlusOptions
from lmdx.merge.builtin.regmean_solve import SolveOptions
from lmdx.merge.card import model_card
from lmdx.merge.method import COPY, MergeInputs, tensor_step
from lmdx.merge.registry import merge_options, method_named, methods
from lmdx.merge.source import StateDictSource
from pydantic import Field
from safetensors.numpy import load_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUILT_IN = (
    "regmean",
    "average",
    "fisher",
    "task_arithmetic",
    "ties",
    "dare",
    "dare_ties",
    "regmean_plusplus",
)


class KeepOptions(NoOptions):
    keep: Annotated[
        list[str],
        Field(
            min_length=1,
            description="name patterns of the tensors taken from the first model",
            json_schema_extra={"label": "must be a list of name patterns"},
        ),
    ] = ["*.bias"]  # noqa: RUF012  (pydantic copies defaults)


class KeepFirst(MergeMethod):
    """The first model's tensors where ``keep`` matches, the mean of all models elsewhere."""

    name: ClassVar[str] = "keep_first"
    summary: ClassVar[str] = "the first model's tensors matching keep, the mean elsewhere"
    options: ClassVar[type[NoOptions]] = KeepOptions
    headline: ClassVar[tuple[str, ...]] = ("keep",)

    def tensor(self, name: str, tensors: Sequence[Any], inputs: Any) -> np.ndarray:
        arrays = [np.asarray(t, dtype=np.float64) for t in tensors]
        if any(fnmatch.fnmatchcase(name, p) for p in inputs.options.own(KeepOptions).keep):
            return arrays[0]
        return sum(arrays[1:], arrays[0]) / len(arrays)


register_method(KeepFirst())


def _reference(models: list[Path], keep: list[str], heads: tuple[str, ...]) -> dict[str, Any]:
    """The expected merged body in float64, from the saved tensors."""
    states = [load_file(str(m / "model.safetensors")) for m in models]
    out = {}
    for name, first in states[0].items():
        if any(fnmatch.fnmatchcase(name, p) for p in heads):
            continue
        if not np.issubdtype(first.dtype, np.floating):
            out[name] = first
        elif any(fnmatch.fnmatchcase(name, p) for p in keep):
            out[name] = first.astype(np.float64)
        else:
            out[name] = np.mean(np.stack([s[name].astype(np.float64) for s in states]), axis=0)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("toy-method")
    _, models, _ = H.cached_family("bert")
    paths = []
    for i, m in enumerate(models):
        m.save_pretrained(root / f"m{i}")
        paths.append(root / f"m{i}")
    return paths


def test_a_method_registered_in_a_test_runs_through_every_door(
    folders: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = ["*.bias", "*LayerNorm.weight"]
    config = tmp_path / "toy.yaml"
    models = "\n".join(f"  - {p}" for p in folders)
    config.write_text(
        f"method: keep_first\nkeep: {json.dumps(keep)}\n"
        "heads: {patterns: ['classifier.*'], policy: keep}\n"
        f"models:\n{models}\n"
    )
    out = tmp_path / "merged"
    assert main(["merge", str(config), "--out", str(out), "--dry-run"]) == 0
    shown = capsys.readouterr().out
    assert "method:   keep_first of 3 models" in shown
    assert " keep_first" in shown.split("steps:")[1].splitlines()[0] and not out.exists()

    assert main(["merge", str(config), "--out", str(out), "--no-progress"]) == 0
    assert f"lmdx merge: keep_first (keep {keep}) of 3 models" in capsys.readouterr().out
    merged = load_file(str(out / "model.safetensors"))
    ref = _reference(folders, keep, H.HEADS["bert"])
    assert set(merged) == set(ref) | {"classifier.weight", "classifier.bias"}
    for name, expected in ref.items():
        np.testing.assert_allclose(merged[name], expected, rtol=1e-6, atol=1e-7, err_msg=name)
    first = load_file(str(folders[0] / "model.safetensors"))
    assert np.array_equal(
        merged["bert.embeddings.LayerNorm.bias"], first["bert.embeddings.LayerNorm.bias"]
    )

    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["report"]["method"] == "keep_first"
    assert record["report"]["keep"] == keep and record["config"]["keep"] == keep
    card = (out / "README.md").read_text()
    assert "**keep_first** of 3 models — the first model's tensors matching keep" in card
    assert f"- `keep`: {keep}" in card

    # the Python doors take the method's option as a keyword, bit-identical to the CLI's
    res = merge_models(folders, "keep_first", keep=keep, heads=H.HEADS["bert"], progress=False)
    for name, value in res.state_dict.items():
        assert np.array_equal(value.numpy(), merged[name]), name
    again = stream_merge(
        folders, tmp_path / "again", "keep_first", keep=keep, heads=H.HEADS["bert"], progress=False
    )
    assert again.report["keep"] == keep


def test_a_registered_methods_options_are_checked_by_its_model(
    folders: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(MergeError, match=r"^keep: must be a list of name patterns, got \[\]"):
        merge_models(folders, "keep_first", keep=[], progress=False)
    with pytest.raises(MergeError, match="keep: only used by method keep_first, not average"):
        merge_models(folders, "average", keep=["*"], progress=False)
    with pytest.raises(MergeError, match="unknown option 'kepe'"):
        merge_models(folders, "keep_first", kepe=["*"], progress=False)
    config = tmp_path / "bad.yaml"
    config.write_text(f"method: keep_first\nkeep: 3\nmodels: [{folders[0]}, {folders[1]}]\n")
    assert main(["merge", str(config), "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "keep must be a list of name patterns, got 3" in err and "\n" == err[-1]
    assert not (tmp_path / "no").exists()


def test_help_and_card_describe_every_method(capsys: pytest.CaptureFixture[str]) -> None:
    registered = methods()
    assert tuple(registered)[: len(BUILT_IN)] == BUILT_IN
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    for name in (*BUILT_IN, "keep_first"):
        method = registered[name]
        assert method.summary and f"  {name}: " in text
        for key in method.options.model_fields:
            assert f"      {key} (default " in text, (name, key)
        card = model_card({"report": {"method": name}, "inputs": {}})
        assert method.summary in card, name
    assert method_named("ties").options().model_dump() == {"scaling": 1.0, "density": 0.2}
    with pytest.raises(MergeError, match=r"method: expected one of .*'keep_first'"):
        method_named("keep_frist")


def test_the_development_pages_example_method(folders: list[Path], tmp_path: Path) -> None:
    """docs/development.md's "Adding a merge method" block, run as written: its method
    merges through a config file and matches its formula in NumPy."""
    page = Path(__file__).resolve().parents[2] / "docs" / "development.md"
    text = page.read_text(encoding="utf-8")
    section = text[text.index("## Adding a merge method") :]
    (block,) = re.findall(r"```python\n(.*?)```", section.split("\n## ")[0], flags=re.S)
    exec(compile(block, str(page), "exec", dont_inherit=True), {"__name__": "power_mean"})
    config = tmp_path / "power.yaml"
    models = "\n".join(f"  - {p}" for p in folders)
    config.write_text(
        f"method: power_mean\npower: 3\nheads: {{patterns: ['classifier.*']}}\nmodels:\n{models}\n"
    )
    assert main(["merge", str(config), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    states = [load_file(str(m / "model.safetensors")) for m in folders]
    name = "bert.encoder.layer.0.attention.self.query.weight"
    x = np.stack([s[name].astype(np.float64) for s in states])
    expected = np.sign(x.sum(axis=0)) * np.cbrt((np.abs(x) ** 3).sum(axis=0) / len(states))
    np.testing.assert_allclose(merged[name], expected, rtol=1e-6, atol=1e-7)
    record = json.loads((tmp_path / "out" / "lmdx_merge.json").read_text())
    assert record["report"]["power"] == 3.0
    with pytest.raises(MergeError, match=r"^power: input should be greater than 0, got -1"):
        merge_models(folders, "power_mean", power=-1, progress=False)


def test_where_a_method_runs_is_its_own_declaration(folders: list[Path], tmp_path: Path) -> None:
    """RegMean++ merges its blocks in order in one process (``ray = "refused"``): Ray
    workers are refused before any output, naming the method."""
    assert method_named("regmean_plusplus").ray == "refused"
    assert method_named("regmean").ray == "groups" and KeepFirst.ray == "local"
    with pytest.raises(MergeError, match=r"^ray_workers: regmean_plusplus merges in this process"):
        stream_merge(folders, tmp_path / "o", "regmean_plusplus", data=[["a"]] * 3, ray_workers=2)
    assert not (tmp_path / "o").exists()


def test_copying_tensors_not_floating_point_is_no_method_to_choose(
    folders: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan's steps for tensors that are not floating point run ``COPY``: it is not
    among the methods, the help or the card's methods, a user cannot choose it, and a
    method cannot be registered under its name."""
    import torch

    states = [{"w": torch.full((2,), float(i)), "ids": torch.arange(3) + i} for i in range(2)]
    sources = [StateDictSource(s, f"m{i}") for i, s in enumerate(states)]
    average = methods()["average"]
    inputs = MergeInputs(average, merge_options(2, "average", {}), sources, ["m0", "m1"])
    assert tensor_step(inputs, "ids").method is COPY and tensor_step(inputs, "ids").kind == "copy"
    assert tensor_step(inputs, "w").method is average
    merged = merge_models(states, "average", progress=False).state_dict
    assert merged["ids"].tolist() == [0, 1, 2] and merged["w"].tolist() == [0.5, 0.5]
    assert "copy" not in methods()
    with pytest.raises(MergeError, match=r"^method: expected one of .*, got 'copy'"):
        merge_models(folders, "copy", progress=False)
    config = tmp_path / "copy.yaml"
    config.write_text(f"method: copy\nmodels: [{folders[0]}, {folders[1]}]\n")
    assert main(["merge", str(config), "--out", str(tmp_path / "no")]) == 2
    assert "method must be one of regmean, average" in capsys.readouterr().err
    assert main(["methods"]) == 0
    assert "  copy: " not in capsys.readouterr().out

    class Clash(MergeMethod):
        name: ClassVar[str] = "copy"

    with pytest.raises(MergeError, match=r"^register_method: name 'copy' is taken by the copies"):
        register_method(Clash())
    assert "copy" not in methods()


def test_a_method_reads_its_own_options_typed() -> None:
    """``MergeOptions.own(model)``: the method's options as its pydantic model (or a base
    of it), the same values as the attribute reads; another model is refused by name."""
    options = merge_options(2, "regmean_plusplus", {"alpha": 0.5, "max_length": 7})
    own = options.own(RegMeanPlusPlusOptions)
    assert own is options.method_options and (own.max_length, own.alpha) == (7, 0.5)
    assert options.own(SolveOptions).alpha == 0.5
    keep = merge_options(2, "keep_first", {"keep": ["*.weight"]})
    assert keep.own(KeepOptions).keep == ["*.weight"]
    with pytest.raises(
        MergeError,
        match=r"^method 'keep_first' takes no SolveOptions \(its options are KeepOptions\)",
    ):
        keep.own(SolveOptions)
