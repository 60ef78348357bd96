"""The options every merge shares are one pydantic model (lmdx.merge.options): the front
doors' keywords, the configuration file's keys and ``lmdx merge``'s flags all come from
its fields, so a value gets the same check and the same words wherever it is given.
"""

from __future__ import annotations

import hf_models as H
import pytest
from lmdx import MergeError
from lmdx.cli import main
from lmdx.merge import merge_models
from lmdx.merge.config import load_merge_config
from lmdx.merge.options import MergeOptions, SharedOptions
from lmdx.merge.registry import merge_options

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    _, models, _ = H.cached_family("bert")
    for i, m in enumerate(models):
        m.save_pretrained(root / f"m{i}")
    return root


def test_every_option_has_one_keyword_and_round_trips():
    paths = SharedOptions.keyword_paths()
    assert sorted(paths.values()) == sorted(SharedOptions.fields())  # one keyword each
    assert {"heads", "head_policy", "task_folders", "dtype", "n_threads"} <= set(paths)
    given = {
        "coefficients": [1, 2.5],
        "exclude": ("*.pooler.*",),
        "heads": "classifier.*",
        "head_policy": "drop",
        "dtype": "bfloat16",
        "max_shard_size": "8MB",
        "lora_rank": 4,
        "n_threads": 2,
        "solve_memory": "1GB",
        "alpha": 0.5,
    }
    options = merge_options(2, "regmean", given)
    assert options.heads.patterns == ["classifier.*"] and options.heads.policy == "drop"
    assert options.exclude == ["*.pooler.*"] and options.coefficients == (1.0, 2.5)
    assert (options.output.max_shard_size, options.solve_memory) == (8 * 10**6, 10**9)
    assert (options.output.dtype, options.output.lora_rank, options.threads) == ("bfloat16", 4, 2)
    again = merge_options(2, "regmean", options.keywords())
    assert again == options and isinstance(again, MergeOptions)


def test_a_value_is_refused_with_the_same_words_by_a_door_and_a_file(folders, tmp_path, capsys):
    models = [folders / "m0", folders / "m1"]
    for keyword, key, value, words in (
        ("n_threads", "threads", 0, "must be a whole number of threads in [1, 4096]"),
        ("exclude", "exclude", 3, "must be a list of name patterns"),
        ("solve_memory", "solve_memory", "lots", "must be a size such as '2GB'"),
    ):
        with pytest.raises(MergeError) as door:
            merge_models(models, "average", progress=False, **{keyword: value})
        assert str(door.value).startswith(f"{keyword}: {words}"), str(door.value)
        config = tmp_path / f"{key}.yaml"
        config.write_text(f"method: average\nmodels: [{models[0]}, {models[1]}]\n{key}: {value}\n")
        with pytest.raises(MergeError) as file:
            load_merge_config(config)
        assert f"{key} {words}" in str(file.value), str(file.value)
    config = tmp_path / "policy.yaml"
    config.write_text(
        f"method: average\nmodels: [{models[0]}, {models[1]}]\nheads: {{policy: first}}\n"
    )
    with pytest.raises(MergeError, match=r"heads\.policy must be keep or drop, got 'first'"):
        load_merge_config(config)
    with pytest.raises(MergeError, match=r"^head_policy: only for writing a folder"):
        merge_models(models, "average", head_policy="drop", progress=False)
    with pytest.raises(MergeError, match=r"^unknown option 'threads'; the options are \["):
        merge_models(models, "average", threads=2, progress=False)


def test_lmdx_merge_has_a_flag_for_every_option_marked_so(folders, tmp_path, capsys):
    flags = SharedOptions.flags()
    assert [path for path, _, _ in flags] == [
        "heads.per_task_folders",
        "solve_memory",
        "accept_flagged",
    ]
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for path, _, field in flags:
        flag = "--" + path.rsplit(".", 1)[-1].replace("_", "-")
        assert f"{flag}" in text and f"(as {path} in the config)" in text
        assert " ".join(str(field.description).split()) in text
    config = tmp_path / "merge.yaml"
    config.write_text(f"method: average\nmodels: [{folders / 'm0'}, {folders / 'm1'}]\n")
    cfg = load_merge_config(config)
    assert cfg.with_option("solve_memory", "3GB").options.solve_memory == 3 * 10**9
    assert cfg.options.solve_memory != 3 * 10**9  # the configuration is not changed
    argv = ["merge", str(config), "--out", str(tmp_path / "o"), "--solve-memory", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "lmdx merge: error: --solve-memory: must be a size such as '2GB' or a number of bytes, "
        "got '0'"
    ]
    assert not (tmp_path / "o").exists()
