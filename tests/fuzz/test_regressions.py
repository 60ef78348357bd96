"""One regression test per class of hostile or unlucky input found by fuzzing (issue 13),
on the fuzz workspace's tiny checkpoints and statistics."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import fuzz_cases as F
import numpy as np
import pytest
from lmdx import MergeError, ModelMismatchError, StatisticsFileError
from lmdx.cli import main
from lmdx.cli.common import Claimed, report_errors
from lmdx.files.identity import model_identity
from lmdx.merge import load_merge_config, plan_merge, run_merge
from lmdx.stats import Statistics
from safetensors.numpy import load_file, save_file


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return F.Workspace(tmp_path_factory.mktemp("regressions")).clean


@pytest.fixture
def ws(clean: Path, tmp_path: Path) -> Path:
    """A private copy of the clean inputs."""
    return Path(shutil.copytree(clean, tmp_path / "in"))


def _config(ws: Path, text: str, name: str = "c.yaml") -> Path:
    (ws / name).write_text(text)
    return ws / name


def _merge_error(ws: Path, text: str, error: type[Exception] = MergeError) -> str:
    cfg = _config(ws, text)
    with pytest.raises(error) as info:
        run_merge(load_merge_config(cfg), ws / "out", progress=False)
    assert not (ws / "out").exists()
    assert not [p for p in ws.iterdir() if p.name.startswith(".")]
    assert "\n" not in str(info.value)
    return str(info.value)


def _header(raw: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def _edit_meta(path: Path, edit) -> None:
    header, data = _header(path.read_bytes())
    meta = json.loads(header["__metadata__"]["lmdx"])
    edit(meta)
    header["__metadata__"]["lmdx"] = json.dumps(meta)
    path.write_bytes(_join(header, data))


# ---------------------------------------------------------------- 1. parsing


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("threads: .inf", "threads must be a whole number"),
        (f"threads: {2**63}", "threads must be a whole number"),
        ("threads: 1.5", "threads must be a whole number"),
        ("threads: true", "threads must be a whole number"),
        ("alpha: " + "9" * 400, r"alpha must be in \[0, 1\]"),
        ("alpha: .nan", r"alpha must be in \[0, 1\]"),
        ("scaling: .inf", "scaling input should be a finite number"),
        ("output: {max_shard_size: infGB}", "output.max_shard_size must be a size"),
        ("output: {max_shard_size: -2GB}", "output.max_shard_size must be a size"),
        ("models: [{path: m0, stats: s0.safetensors, coefficient: [1]}, m1]", "coefficient"),
    ],
)
def test_config_numbers_out_of_range_or_of_the_wrong_type(ws: Path, line: str, match: str) -> None:
    text = F.CONFIG + line + "\n" if not line.startswith("models") else line + "\nmethod: average\n"
    if line.startswith("models"):
        text = "method: average\n" + line + "\n"
    cfg = _config(ws, text)
    with pytest.raises(MergeError, match=match) as info:
        load_merge_config(cfg)
    assert str(cfg) in str(info.value) and "\n" not in str(info.value)


def test_config_yaml_alias_bomb_and_bytes_not_utf8(ws: Path) -> None:
    bomb = 'a: &a ["x","x","x","x","x","x","x","x","x"]\nb: [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
    with pytest.raises(MergeError, match="aliases"):
        load_merge_config(_config(ws, F.CONFIG + bomb))
    (ws / "c.yaml").write_bytes(F.CONFIG.encode() + b"# caf\xe9\n")
    with pytest.raises(MergeError, match=rf"config {ws / 'c.yaml'} is not UTF-8"):
        load_merge_config(ws / "c.yaml")


def test_deeply_nested_checkpoint_index(ws: Path) -> None:
    index = ws / "m1" / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    msg = _merge_error(ws, F.CONFIG)
    assert f"model index {index} is not valid JSON (nested too deeply)" in msg


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: next(iter(m["model"]["parameters"].values())).pop("blake3"), "blake3"),
        (lambda m: m["model"].pop("architecture"), "architecture"),
        (lambda m: next(iter(m["modules"].values())).pop("weight"), "weight"),
        (lambda m: next(iter(m["model"]["parameters"].values())).pop("shape"), "shape"),
        (lambda m: m.update(extra="a string"), "extra"),
        (lambda m: next(iter(m["groups"].values())).update(count=-1.0), "count"),
        (lambda m: next(iter(m["groups"].values())).update(dim=[6]), "dim"),
    ],
)
def test_statistics_metadata_of_the_wrong_shape(ws: Path, edit, match: str) -> None:
    _edit_meta(ws / "s0.safetensors", edit)
    with pytest.raises(StatisticsFileError, match=str(ws / "s0.safetensors")) as info:
        Statistics.load(ws / "s0.safetensors")
    assert match in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- 3. content hashes


def test_statistics_content_is_verified(ws: Path) -> None:
    path = ws / "s0.safetensors"
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, _ = _header(bytes(raw))[0][f"gram/{F.MODULES[0]}"]["data_offsets"]
    raw[8 + n + begin] ^= 0x01  # one bit of a Gram
    path.write_bytes(bytes(raw))
    assert "does not match its content hash" in _merge_error(ws, F.CONFIG, StatisticsFileError)


def test_statistics_with_swapped_ranges_or_changed_counts_are_refused(ws: Path) -> None:
    path = ws / "s0.safetensors"
    good = path.read_bytes()
    header, data = _header(good)
    a, b = (f"gram/{m}" for m in F.MODULES)
    header[a]["data_offsets"], header[b]["data_offsets"] = (
        header[b]["data_offsets"],
        header[a]["data_offsets"],
    )
    path.write_bytes(_join(header, data))
    assert "does not match its content hash" in _merge_error(ws, F.CONFIG, StatisticsFileError)
    path.write_bytes(good)
    _edit_meta(path, lambda m: next(iter(m["groups"].values())).update(count=41.0))
    msg = _merge_error(ws, F.CONFIG, StatisticsFileError)
    assert "metadata (counts, shapes, identity) does not match its content hash" in msg


def test_version_1_statistics_get_a_clear_message(ws: Path) -> None:
    path = ws / "s0.safetensors"

    def v1(meta: dict) -> None:
        meta["format_version"] = 1
        meta.pop("blake3")

    _edit_meta(path, v1)
    with pytest.raises(StatisticsFileError, match=r"format version 1 .* collect the statistics"):
        Statistics.load(path)


# ---------------------------------------------------------------- 4. finite after the cast


def test_finiteness_is_checked_after_the_cast(ws: Path) -> None:
    for file in [*ws.glob("m0/model*.safetensors"), *ws.glob("m1/model*.safetensors")]:
        state = load_file(str(file))
        if "norm.weight" in state:  # a LayerNorm weight finite in float32, not in float16
            state["norm.weight"] = np.full(F.D_IN, 1e5, np.float32)
            save_file(state, str(file), metadata={"format": "pt"})
    avg = "method: average\nmodels: [m0, m1]\noutput: {dtype: float16}\n"
    msg = _merge_error(ws, avg)
    assert "merged tensor 'norm.weight' is not finite in float16" in msg
    ta = "method: task_arithmetic\nbase: m0\nmodels: [m0, m1]\nscaling: 1.0e+300\n"
    msg = _merge_error(ws, ta)  # the option that did it is named among the causes
    assert "is not finite in float32" in msg and "a scaling option too large?" in msg


# ---------------------------------------------------------------- 5. symlinks


def test_symlinked_model_files_are_refused(ws: Path, tmp_path: Path) -> None:
    private = tmp_path / "private.json"
    private.write_text('{"secret": 1}')
    link = ws / "m0" / "special_tokens_map.json"
    link.unlink()
    link.symlink_to(private)
    msg = _merge_error(ws, F.CONFIG)
    assert "special_tokens_map.json is a symbolic link" in msg and str(private) in msg
    with pytest.raises(MergeError, match="is a symbolic link"):  # the plan refuses it already
        plan_merge(load_merge_config(ws / "c.yaml"))


# ---------------------------------------------------------------- 6. sharded statistics


def test_config_takes_a_sharded_statistics_folder(ws: Path) -> None:
    cfg = load_merge_config(ws / "config.yaml")
    assert Path(str(cfg.models[1].stats)).is_dir()
    run_merge(cfg, ws / "out", progress=False)
    assert (ws / "out" / "model.safetensors").is_file()


# ---------------------------------------------------------------- 7. which file


def _fisher(folder: Path, path: Path, drop: str | None) -> None:
    state = load_file(str(folder / "model.safetensors"))
    params = {n: a for n, a in state.items() if a.dtype == np.float32 and n != drop}
    Statistics(
        kind="fisher",
        model=model_identity(state),
        parameters={n: {"shape": list(a.shape)} for n, a in params.items()},
        count=3.0,
        tensors={f"fisher/{n}": np.ones(a.shape) for n, a in params.items()},
    ).save(path)


def test_fisher_file_missing_a_parameter_is_one_line_naming_the_file(
    ws: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.rmtree(ws / "m1")
    shutil.copytree(ws / "m0", ws / "m1")
    _fisher(ws / "m0", ws / "f0.safetensors", None)
    _fisher(ws / "m1", ws / "f1.safetensors", "enc.b.bias")
    cfg = _config(
        ws,
        "method: fisher\nmodels:\n  - {path: m0, stats: f0.safetensors}\n"
        "  - {path: m1, stats: f1.safetensors}\n",
    )
    assert main(["merge", str(cfg), "--out", str(ws / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert str(ws / "f1.safetensors") in err and "'enc.b.bias'" in err
    assert not (ws / "out").exists()


# ---------------------------------------------------------------- 8. Ctrl-C after the rename


def test_interrupt_after_the_output_is_complete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.txt"

    def body(claimed: Claimed, write: bool) -> int:
        claimed.claim(out)
        if write:
            out.write_text("complete")
        raise KeyboardInterrupt

    claimed = Claimed()
    assert report_errors("x", lambda: body(claimed, False), (), claimed) == 130
    assert "nothing was written" in capsys.readouterr().err
    claimed = Claimed()
    assert report_errors("x", lambda: body(claimed, True), (), claimed) == 130
    err = capsys.readouterr().err
    assert f"interrupted after {out} was written" in err and "nothing" not in err


# ---------------------------------------------------------------- 9. terminal and modes


def test_stats_show_escapes_stored_text(ws: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stats = Statistics.load(ws / "s0.safetensors")
    evil = Statistics(
        kind=stats.kind,
        model=stats.model,
        data="\x1b]0;owned\x07\x1b[2J\nfake line",
        padding=stats.padding,
        modules=stats.modules,
        groups=stats.groups,
        tensors={s.name: stats.packed(s.name) for s in stats.specs()},
    )
    evil.save(ws / "evil.safetensors")
    assert main(["stats", "show", str(ws / "evil.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b[2J\\nfake line" in out


def test_outputs_get_the_mode_of_new_files(ws: Path) -> None:
    old = os.umask(0o027)
    try:
        run_merge(load_merge_config(ws / "config.yaml"), ws / "out", progress=False)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (ws / "out").rglob("*")}
    assert modes and set(modes.values()) == {0o640}, modes
    assert stat.S_IMODE((ws / "out").stat().st_mode) == 0o750


# ---------------------------------------------------------------- 10. dtypes mixed


def test_models_of_different_dtypes_are_refused(ws: Path) -> None:
    file = ws / "m0" / "model.safetensors"
    state = load_file(str(file))
    state["norm.weight"] = state["norm.weight"].astype(np.float16)
    save_file(state, str(file), metadata={"format": "pt"})
    msg = _merge_error(ws, "method: average\nmodels: [m0, m1]\n")
    assert "tensor 'norm.weight': dtype float16 in" in msg and "float32 in" in msg


def test_statistics_of_other_weights_are_still_refused(ws: Path) -> None:
    """A checkpoint changed after its statistics were collected (unlucky, not hostile)."""
    file = ws / "m0" / "model.safetensors"
    state = load_file(str(file))
    state["enc.a.weight"][0, 0] += 1.0
    save_file(state, str(file), metadata={"format": "pt"})
    assert "has different values" in _merge_error(ws, F.CONFIG, ModelMismatchError)


def _rewritten(ws: Path, value: float) -> None:
    """s0.safetensors rewritten (and so re-hashed, as a forger would) with ``value`` as the
    first diagonal entry of its first Gram."""
    stats = Statistics.load(ws / "s0.safetensors")
    tensors = {s.name: stats.packed(s.name).copy() for s in stats.specs()}
    first = next(n for n in tensors if n.startswith("gram/"))
    tensors[first].reshape(-1)[0] = value
    forged = Statistics(
        kind=stats.kind,
        model=stats.model,
        padding=stats.padding,
        modules=stats.modules,
        groups=stats.groups,
        tensors=tensors,
    )
    (ws / "s0.safetensors").unlink()
    forged.save(ws / "s0.safetensors")


@pytest.mark.parametrize(
    ("value", "said"),
    [(float("nan"), "is not finite"), (float("inf"), "is not finite"), (-1.0, "negative diagonal")],
)
def test_an_impossible_gram_is_refused_by_the_cost_meter(ws: Path, value: float, said: str) -> None:
    """What each task pays for a data-free merge, from statistics no data can give (a NaN,
    an Inf, a negative sum of squares) rewritten with valid hashes: one line naming whose
    statistics, not ``nan`` costs with exit 0."""
    from lmdx.merge.config import cost_merge

    _rewritten(ws, value)
    cfg = _config(ws, F.CONFIG.replace("method: regmean", "method: average"))
    with pytest.raises(MergeError, match=rf"^statistics of .*m0: the Gram of .* {said}"):
        cost_merge(load_merge_config(cfg, cost=True), progress=False)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_gram_is_a_merge_error_naming_the_model(ws: Path, value: float) -> None:
    """RegMean through the Python door: the core's check of a non-finite Gram was a raw
    ValueError naming ``grams[0]``; now a MergeError naming the model."""
    _rewritten(ws, value)
    msg = _merge_error(ws, F.CONFIG)
    assert "the Gram of " in msg and "m0" in msg and "grams[" not in msg, msg


def _saw_no_rows(ws: Path) -> None:
    """s0.safetensors rewritten as statistics whose every module saw no rows."""
    stats = Statistics.load(ws / "s0.safetensors")
    groups = {g: {**v, "count": 0.0} for g, v in stats.groups.items()}
    empty = Statistics(
        kind=stats.kind,
        model=stats.model,
        padding=stats.padding,
        modules=stats.modules,
        groups=groups,
        tensors={s.name: stats.packed(s.name) for s in stats.specs()},
    )
    (ws / "s0.safetensors").unlink()
    empty.save(ws / "s0.safetensors")


def test_statistics_that_saw_no_rows_are_named_by_file(ws: Path) -> None:
    _saw_no_rows(ws)
    msg = _merge_error(ws, F.CONFIG)
    assert f"statistics {ws / 's0.safetensors'} (of " in msg and "saw no rows" in msg


def test_statistics_that_saw_no_rows_are_named_when_a_data_free_merge_is_costed(ws: Path) -> None:
    """``lmdx merge --cost`` of a method that takes no statistics weighs each task's cost
    by its Grams' rows: none is the same one line as RegMean's, not a ZeroDivisionError."""
    from lmdx.merge.config import cost_merge

    _saw_no_rows(ws)
    cfg = _config(ws, F.CONFIG.replace("method: regmean", "method: average"))
    with pytest.raises(MergeError) as info:
        cost_merge(load_merge_config(cfg, cost=True), progress=False)
    msg = str(info.value)
    assert f"statistics {ws / 's0.safetensors'} (of " in msg and "saw no rows" in msg
    assert "\n" not in msg
