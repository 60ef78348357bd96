"""Statistics files: contents read back by this suite's own parser, adding shards, bad files.

Every file here is checked byte-level with a reader written in the test (8-byte header
length, JSON header, raw little-endian tensors), not only with lmdx's own loader.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import blake3
import hf_models as H
import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy
import transformers  # noqa: F401
from hypothesis import given
from hypothesis import strategies as st
from lmdx import ModelMismatchError, StatisticsFileError
from lmdx.cli import main
from lmdx.files.atomic import atomic_directory
from lmdx.files.identity import describe_mismatch, model_identity
from lmdx.files.safetensors import TensorSpec, write_safetensors
from lmdx.merge import merge_models
from lmdx.stats import Statistics, add_statistics
from lmdx.stats.fisher import collect_fisher
from lmdx.stats.packing import pack_upper, packed_diagonal, packed_times, unpack_upper

pytestmark = pytest.mark.usefixtures("one_torch_thread")


_collect = H.collect


def read_file(path):
    """(metadata dict, {name: float64 array}) of a safetensors file, parsed by hand."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n :]
    tensors = {}
    for name, info in header.items():
        assert info["dtype"] == "F64", name
        lo, hi = info["data_offsets"]
        tensors[name] = np.frombuffer(data[lo:hi], dtype="<f8").reshape(info["shape"])
    return meta, tensors


def unpack_by_hand(packed, d):
    """Symmetric matrix from its upper triangle stored row by row."""
    g = np.zeros((d, d))
    g[np.triu_indices(d)] = packed
    return g + np.triu(g, 1).T


# --------------------------------------------------------------------------- packing


@given(d=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_pack_upper_is_the_row_major_upper_triangle(d, seed):
    a = np.random.default_rng(seed).standard_normal((d, d))
    s = a + a.T
    packed = pack_upper(s)
    assert packed.shape == (d * (d + 1) // 2,) and packed.dtype == np.float64
    assert np.array_equal(packed, s[np.triu_indices(d)])
    assert np.array_equal(unpack_upper(packed, d), s)
    assert np.array_equal(
        unpack_upper(a[np.triu_indices(d)], d), unpack_by_hand(a[np.triu_indices(d)], d)
    )


def test_unpack_upper_rejects_a_wrong_length():
    with pytest.raises(ValueError, match="dimension 4: expected 10 values"):
        unpack_upper(np.zeros(9), 4)


# --------------------------------------------------------------------------- metadata


def blake3_of(t):
    return blake3.blake3(t.detach().contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("include_padding", [False, True])
@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_regmean_file_holds_metadata_and_the_reference_statistics(arch, include_padding, tmp_path):
    _, models, batches = H.cached_family(arch, "float64")
    model, data = models[0], list(batches[0])
    stats = _collect(model, data, include_padding=include_padding, description="40 random seqs")
    path = stats.save(tmp_path / "s.safetensors")
    meta_raw, tensors = read_file(path)
    meta = json.loads(meta_raw["lmdx"])

    assert meta["format"] == "lmdx-stats" and meta["format_version"] == 3
    assert meta["kind"] == "regmean-gram" and meta["dtype"] == "float64"
    assert meta["data"] == "40 random seqs"
    assert meta["padding"] == ("included" if include_padding else "excluded")
    identity = meta["model"]
    assert identity["architecture"] == type(model).__name__
    assert identity["model_type"] == arch
    assert re.fullmatch("[0-9a-f]{64}", identity["weights_sha256"])
    state = model.state_dict()
    assert set(identity["parameters"]) == set(state)
    for name, t in state.items():
        entry = identity["parameters"][name]
        assert entry == {"shape": list(t.shape), "dtype": "float64", "blake3": blake3_of(t)}

    ref = H.reference_grams(model, data, include_padding)
    layouts = {n: lay for n, (_, lay) in H.linear_modules(model).items()}
    assert set(meta["modules"]) == set(ref)
    for name, info in meta["modules"].items():
        assert info["layout"] == layouts[name] and info["weight"] == f"{name}.weight"
        group = info["group"]
        d = ref[name]["gram"].shape[0]
        assert info["dim"] == meta["groups"][group]["dim"] == d
        assert meta["groups"][group]["count"] == ref[name]["count"]
        assert tensors[f"gram/{group}"].shape == (d * (d + 1) // 2,)
        assert H.rel_err(unpack_by_hand(tensors[f"gram/{group}"], d), ref[name]["gram"]) <= 1e-12
        assert H.rel_err(tensors[f"sum/{group}"], ref[name]["sum"]) <= 1e-12
    assert set(tensors) == {f"{k}/{g}" for g in meta["groups"] for k in ("gram", "sum")}
    # content hashes (BLAKE3): every tensor's little-endian float64 bytes, and the metadata
    # without its hashes as canonical JSON
    assert "sha256" not in meta
    for name, arr in tensors.items():
        digest = blake3.blake3(arr.astype("<f8").tobytes()).hexdigest()
        assert meta["blake3"]["tensors"][name] == digest
    body = {k: v for k, v in meta.items() if k != "blake3"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert meta["blake3"]["metadata"] == blake3.blake3(canonical.encode()).hexdigest()


def test_weights_hash_follows_the_weights_not_the_container():
    _, models, _ = H.cached_family("bert")
    a = model_identity(models[0])
    assert model_identity(dict(models[0].state_dict()))["weights_sha256"] == a["weights_sha256"]
    assert model_identity(models[1])["weights_sha256"] != a["weights_sha256"]
    changed = {n: t.clone() for n, t in models[0].state_dict().items()}
    changed["classifier.bias"][0] += 1e-6
    b = model_identity(changed)
    assert b["weights_sha256"] != a["weights_sha256"]
    differing = [n for n in a["parameters"] if a["parameters"][n] != b["parameters"][n]]
    assert differing == ["classifier.bias"]


def test_fisher_file_holds_metadata_and_sums(tmp_path):
    _, models, _ = H.cached_family("bert")
    model = models[1]
    data = H.random_batches("bert", 4, n_sequences=6, batch_size=3, labels=True)
    stats = collect_fisher(model, data, labels="gold", include=["*.layer.0.*"], progress=False)
    path = stats.save(tmp_path / "f.safetensors")
    meta_raw, tensors = read_file(path)
    meta = json.loads(meta_raw["lmdx"])
    assert meta["kind"] == "fisher" and meta["count"] == 6
    assert meta["extra"]["labels"] == "gold"
    assert meta["model"]["architecture"] == "BertForSequenceClassification"
    params = dict(model.named_parameters())
    assert set(meta["parameters"]) == {n for n in params if ".layer.0." in n}
    for name, info in meta["parameters"].items():
        assert info["shape"] == list(params[name].shape)
        assert tensors[f"fisher/{name}"].shape == tuple(params[name].shape)
    ref, _ = H.reference_fisher(model, data, gold=True)
    loaded = Statistics.load(path)
    H.assert_fisher_close(loaded, ref)
    assert loaded.count() == 6
    for name in meta["parameters"]:
        assert np.array_equal(loaded.fisher(name), tensors[f"fisher/{name}"])


def test_save_load_round_trip_is_exact(tmp_path):
    _, models, batches = H.cached_family("llama")
    stats = _collect(models[1], batches[1], description="d")
    loaded = Statistics.load(stats.save(tmp_path / "s.safetensors"))
    assert loaded.source == str(tmp_path / "s.safetensors")
    assert (loaded.kind, loaded.padding, loaded.data) == ("regmean-gram", "excluded", "d")
    assert loaded.modules == stats.modules and loaded.model == stats.model
    for name in stats.modules:
        assert loaded.count(name) == stats.count(name)
        assert np.array_equal(loaded.gram(name), stats.gram(name))
        assert np.array_equal(loaded.sum(name), stats.sum(name))


def identity_by_hand(meta):
    """SHA-256 over a statistics file's own content hashes: its metadata's, then every
    tensor's ``name:hash;`` in name order (recomputed here from the tensors themselves)."""
    key = {2: "sha256", 3: "blake3"}[meta["format_version"]]
    total = hashlib.sha256(f"metadata:{meta[key]['metadata']};".encode())
    for name in sorted(meta[key]["tensors"]):
        total.update(f"{name}:{meta[key]['tensors'][name]};".encode())
    return total.hexdigest()


def test_content_hash_is_the_statistics_identity_in_a_file_or_folder(tmp_path):
    """Loaded statistics carry SHA-256 over the content hashes their file holds, each of
    which hashes what it names; a sharded folder of the same statistics has the same one,
    other statistics another; statistics in memory none."""
    _, models, batches = H.cached_family("llama")
    stats = _collect(models[1], batches[1], description="d")
    assert stats.content_sha256 is None
    path = stats.save(tmp_path / "s.safetensors")
    meta, tensors = read_file(path)
    meta = json.loads(meta["lmdx"])
    for name, arr in tensors.items():
        assert meta["blake3"]["tensors"][name] == blake3.blake3(arr.tobytes()).hexdigest()
    loaded = Statistics.load(path)
    assert loaded.content_sha256 == identity_by_hand(meta)
    folder = Statistics.load(path).save(tmp_path / "sharded", max_shard_size=5000)
    assert len(list(folder.glob("*.safetensors"))) > 1
    assert Statistics.load(folder).content_sha256 == loaded.content_sha256
    other = _collect(models[1], batches[1], description="e").save(tmp_path / "e.safetensors")
    assert Statistics.load(other).content_sha256 != loaded.content_sha256  # metadata differs


# --------------------------------------------------------------------------- adding


@pytest.mark.parametrize("arch", ["roberta", "gpt2"])
def test_statistics_of_shards_add_up_to_statistics_of_all_data(arch, tmp_path):
    _, models, batches = H.cached_family(arch)
    model, data = models[0], list(batches[0])
    full = _collect(model, data)
    first = _collect(model, data[:2], description="shard 1")
    second = _collect(model, data[2:], description="shard 2")
    ref = H.reference_grams(model, data, False)

    in_memory = add_statistics([first, second])
    p1, p2 = first.save(tmp_path / "1.safetensors"), second.save(tmp_path / "2.safetensors")
    from_files = add_statistics([Statistics.load(p1), Statistics.load(p2)], data="both")
    resaved = Statistics.load(from_files.save(tmp_path / "sum.safetensors"))
    assert in_memory.data == "shard 1 + shard 2" and resaved.data == "both"
    for added in (in_memory, from_files, resaved):
        assert added.padding == "excluded" and added.modules == full.modules
        for name in full.modules:
            assert first.count(name) < full.count(name)
            assert added.count(name) == full.count(name) == ref[name]["count"]
            assert H.rel_err(added.gram(name), full.gram(name)) <= 1e-12, name
            assert H.rel_err(added.sum(name), full.sum(name)) <= 1e-12, name
            assert H.rel_err(added.gram(name), ref[name]["gram"]) <= 1e-6, name


def test_fisher_statistics_add(tmp_path):
    _, models, _ = H.cached_family("gpt2")
    data = H.random_batches("gpt2", 9, n_sequences=6, batch_size=3)
    kw = {"include": ["transformer.h.1.*"], "progress": False}
    full = collect_fisher(models[0], data, **kw)
    parts = [collect_fisher(models[0], data[:1], **kw), collect_fisher(models[0], data[1:], **kw)]
    paths = [p.save(tmp_path / f"{i}.safetensors") for i, p in enumerate(parts)]
    added = add_statistics([Statistics.load(p) for p in paths])
    assert added.count() == full.count() == 6
    for name in full.parameters:
        assert H.rel_err(added.fisher(name), full.fisher(name)) <= 1e-12, name


def test_adding_mismatched_statistics_is_an_error():
    _, models, batches = H.cached_family("bert")
    a = _collect(models[0], batches[0][:1])
    other_model = _collect(models[1], batches[0][:1])
    padded = _collect(models[0], batches[0][1:2], include_padding=True)
    fisher = collect_fisher(models[0], batches[0][:1], progress=False)
    with pytest.raises(ModelMismatchError, match="cannot add statistics of different models"):
        add_statistics([a, other_model])
    with pytest.raises(ValueError, match="padding policy differs"):
        add_statistics([a, padded])
    with pytest.raises(ValueError, match="kind differs"):
        add_statistics([a, fisher])
    with pytest.raises(ValueError, match="nothing to add"):
        add_statistics([])


# --------------------------------------------------------------------------- sharing


@pytest.mark.parametrize(
    ("arch", "groups_shared", "groups_separate"), [("bert", 10, 14), ("llama", 9, 15)]
)
def test_shared_inputs_make_the_file_smaller(arch, groups_shared, groups_separate, tmp_path):
    _, models, batches = H.cached_family(arch)
    shared = _collect(models[0], batches[0], share_inputs=True)
    separate = _collect(models[0], batches[0], share_inputs=False)
    p_shared = shared.save(tmp_path / "shared.safetensors")
    p_separate = separate.save(tmp_path / "separate.safetensors")
    _, t_shared = read_file(p_shared)
    _, t_separate = read_file(p_separate)
    assert sum(k.startswith("gram/") for k in t_shared) == groups_shared
    assert sum(k.startswith("gram/") for k in t_separate) == groups_separate
    assert os.path.getsize(p_shared) < os.path.getsize(p_separate)
    # the Gram payload shrinks by the duplicated triangles exactly
    saved = sum(v.nbytes for v in t_separate.values()) - sum(v.nbytes for v in t_shared.values())
    dup = sum(
        8 * (d * (d + 1) // 2 + d)
        for n, d in ((n, separate.modules[n]["dim"]) for n in separate.modules)
        if shared.group_of(n) != n
    )
    assert saved == dup


# --------------------------------------------------------------------------- bad files


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    _, models, batches = H.cached_family("bert")
    path = tmp_path_factory.mktemp("good") / "stats.safetensors"
    _collect(models[0], batches[0][:2]).save(path)
    return path


def _variant(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _header(raw):
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8 : 8 + n])


def _rewrite(raw, header):
    """The same file with a new JSON header (tensor bytes unchanged)."""
    n = int.from_bytes(raw[:8], "little")
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + raw[8 + n :]


def _with_meta(raw, edit):
    _, header = _header(raw)
    meta = json.loads(header["__metadata__"]["lmdx"])
    edit(meta)
    header["__metadata__"]["lmdx"] = json.dumps(meta)
    return _rewrite(raw, header)


def _bad_files(raw):
    n, header = _header(raw)
    first = next(k for k in header if k != "__metadata__")
    wrong_shape = json.loads(json.dumps(header))
    wrong_shape[first]["shape"] = [wrong_shape[first]["shape"][0] // 2, 2]
    bad_json = json.loads(json.dumps(header))
    bad_json["__metadata__"]["lmdx"] = "{not json"
    return {
        "truncated-1": (raw[:-1], "truncated"),
        "truncated-half": (raw[: len(raw) // 2], "truncated"),
        "header-only": (raw[: 8 + n], "truncated"),
        "corrupt-header": (raw[:8] + b"#" + raw[9:], "corrupted"),
        "huge-header-length": ((1 << 40).to_bytes(8, "little") + raw[8:], "corrupted"),
        "not-safetensors": (b"hello, I am a text file\n" * 10, "another format"),
        "empty": (b"", "truncated"),
        "lmdx-json-broken": (_rewrite(raw, bad_json), "metadata is not valid JSON"),
        "foreign-format": (
            _with_meta(raw, lambda m: m.update(format="other")),
            "not an lmdx statistics file",
        ),
        "future-version": (
            _with_meta(raw, lambda m: m.update(format_version=99)),
            "format version 99 is not supported",
        ),
        "unknown-kind": (_with_meta(raw, lambda m: m.update(kind="lmd")), "kind 'lmd'"),
        "no-identity": (_with_meta(raw, lambda m: m.pop("model")), "model identity"),
        "bad-padding": (
            _with_meta(raw, lambda m: m.update(padding="sometimes")),
            "padding policy 'sometimes'",
        ),
        "dim-mismatch": (
            _with_meta(raw, lambda m: next(iter(m["groups"].values())).update(dim=3)),
            "has shape",
        ),
        "tensor-reshaped": (_rewrite(raw, wrong_shape), "has shape"),
    }


BAD_FILE_CASES = (
    "truncated-1",
    "truncated-half",
    "header-only",
    "corrupt-header",
    "huge-header-length",
    "not-safetensors",
    "empty",
    "lmdx-json-broken",
    "foreign-format",
    "future-version",
    "unknown-kind",
    "no-identity",
    "bad-padding",
    "dim-mismatch",
    "tensor-reshaped",
)


@pytest.mark.parametrize("case", BAD_FILE_CASES)
def test_bad_statistics_file_is_a_clear_error(case, good_file, tmp_path):
    cases = _bad_files(good_file.read_bytes())
    assert set(cases) == set(BAD_FILE_CASES)
    data, what = cases[case]
    path = _variant(tmp_path, f"{case}.safetensors", data)
    with pytest.raises(StatisticsFileError, match=re.escape(str(path))) as info:
        Statistics.load(path)
    assert what in str(info.value)


def _as_version_2(raw, state):
    """A file as lmdx wrote format 2: the same tensors, their content hashes and the
    metadata's SHA-256 (computed here from the bytes) under ``sha256``, and a model
    identity of SHA-256 hashes of the model's tensors ``state``."""
    n, header = _header(raw)
    meta = json.loads(header["__metadata__"]["lmdx"])
    del meta["blake3"]
    meta["format_version"] = 2
    total = hashlib.sha256()
    for name, entry in sorted(meta["model"]["parameters"].items()):
        del entry["blake3"]
        t = state[name].detach().contiguous()
        entry["sha256"] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
        total.update(f"{name}:{entry['dtype']}:{entry['shape']}:{entry['sha256']};".encode())
    meta["model"]["weights_sha256"] = total.hexdigest()
    tensors = {}
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            tensors[name] = hashlib.sha256(raw[8 + n + begin : 8 + n + end]).hexdigest()
    canonical = json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    meta["sha256"] = {
        "tensors": tensors,
        "metadata": hashlib.sha256(canonical.encode()).hexdigest(),
    }
    header["__metadata__"]["lmdx"] = json.dumps(meta)
    return _rewrite(raw, header), meta


def test_format_2_files_are_read_and_checked_with_sha256(good_file, tmp_path, capsys):
    """Statistics written by an lmdx of format 2 (SHA-256 content hashes and model
    identity) read as before: the same tensors, their identity over the hashes they hold,
    a changed byte refused, a merge checks the model with SHA-256;
    ``lmdx stats add OLD --out NEW`` rewrites them in format 3 (BLAKE3 content hashes,
    the identity as it was); they do not add to statistics with a BLAKE3 identity; the
    hashes of one format in the other's entry, or both entries, are refused."""
    _, models, _ = H.cached_family("bert")
    raw = good_file.read_bytes()
    data, meta = _as_version_2(raw, models[0].state_dict())
    old = _variant(tmp_path, "v2.safetensors", data)
    new, loaded = Statistics.load(good_file), Statistics.load(old)
    assert loaded.content_sha256 == identity_by_hand(meta) != new.content_sha256
    merged = merge_models([models[0], models[0]], method="regmean", stats=[loaded, loaded])
    reference = merge_models([models[0], models[0]], method="regmean", stats=[new, new])
    for name, value in reference.state_dict.items():
        assert np.array_equal(np.asarray(merged.state_dict[name]), np.asarray(value)), name
    with pytest.raises(ModelMismatchError, match=r"has different values \(sha256 "):
        merge_models([models[1], models[0]], method="regmean", stats=[loaded, new])
    with pytest.raises(ModelMismatchError) as info:
        add_statistics([loaded, new])
    assert str(info.value).startswith(
        f"cannot add {old} and {good_file}: their model identities hold different content "
        "hashes (sha256 there, blake3 here"
    )
    loaded.check_model(model_identity(models[0], "sha256"))
    with pytest.raises(ModelMismatchError, match=r"different content hashes \(sha256 there"):
        loaded.check_model(model_identity(models[0]))
    assert main(["stats", "show", str(old)]) == 0
    assert "(format lmdx-stats v2)" in capsys.readouterr().out
    for module in new.modules:
        assert np.array_equal(loaded.gram_stored(module), new.gram_stored(module))
        assert np.array_equal(loaded.sum(module), new.sum(module))
    again = tmp_path / "v3.safetensors"
    assert main(["stats", "add", str(old), "--out", str(again)]) == 0
    assert f"lmdx stats add: 1 file -> {again}" in capsys.readouterr().out
    meta3 = json.loads(_header(again.read_bytes())[1]["__metadata__"]["lmdx"])
    assert meta3["format_version"] == 3 and "sha256" not in meta3
    assert (
        meta3["blake3"]["tensors"]
        == json.loads(_header(raw)[1]["__metadata__"]["lmdx"])["blake3"]["tensors"]
    )

    n, header = _header(data)
    module = next(iter(new.modules))
    begin, _ = header[f"gram/{new.group_of(module)}"]["data_offsets"]
    flipped = bytearray(data)
    flipped[8 + n + begin] ^= 0x01
    bad = Statistics.load(_variant(tmp_path, "flipped.safetensors", bytes(flipped)))
    with pytest.raises(StatisticsFileError, match="does not match its content hash"):
        bad.gram_stored(module)

    def both(m):
        m["blake3"] = m["sha256"]

    def as_v3(m):
        m["format_version"] = 3

    for name, edit in (("both", both), ("as-v3", as_v3)):
        path = _variant(tmp_path, f"{name}.safetensors", _with_meta(data, edit))
        with pytest.raises(StatisticsFileError, match="content hashes are missing or malformed"):
            Statistics.load(path)


def test_identities_of_either_hash_are_described_by_what_differs():
    """Identities of SHA-256 hashes (an older lmdx) and of BLAKE3 ones differ by their hash
    kind, unless one side has no tensors to compare (then what it lacks is said)."""
    _, models, _ = H.cached_family("bert")
    old, new = model_identity(models[0], "sha256"), model_identity(models[0])
    assert old["weights_sha256"] != new["weights_sha256"]
    assert "different content hashes (sha256 there, blake3 here" in describe_mismatch(old, new)
    with_adapter = {**old, "adapter": {"sha256": "0" * 64, "tensors": {}}}
    bare = {"architecture": old["architecture"], "adapter": None}
    assert "this model has none" in describe_mismatch(with_adapter, bare)
    state = {n: t.clone() for n, t in models[0].state_dict().items()}
    state["classifier.bias"][0] += 1e-6
    same = model_identity(dict(models[0].state_dict()), "sha256")
    changed = model_identity(state, "sha256")
    assert "'classifier.bias' has different values (sha256 " in describe_mismatch(same, changed)


def test_foreign_safetensors_file_without_lmdx_metadata(tmp_path):
    path = tmp_path / "weights.safetensors"
    safetensors_numpy.save_file({"w": np.zeros((2, 2))}, str(path), metadata={"a": "b"})
    with pytest.raises(StatisticsFileError, match="no lmdx metadata; this is not an lmdx"):
        Statistics.load(path)


def test_missing_statistics_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing\.safetensors: no such file"):
        Statistics.load(tmp_path / "nothing.safetensors")


def test_truncated_file_given_to_merge_is_an_error_and_writes_nothing(good_file, tmp_path):
    _, models, batches = H.cached_family("bert")
    stats = [_collect(m, batches[0][:2]) for m in models]
    cut = _variant(tmp_path, "cut.safetensors", good_file.read_bytes()[:-64])
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(StatisticsFileError, match=r"cut\.safetensors"):
        merge_models(models, stats=[cut, stats[1], stats[2]], progress=False)
    assert sorted(os.listdir(tmp_path)) == before


def _open_descriptors(path):
    """This process's file descriptors open on ``path`` or on a file inside it (Linux
    /proc)."""
    where = os.path.realpath(path)
    return [
        fd
        for fd in Path("/proc/self/fd").iterdir()
        if os.path.realpath(fd) == where or os.path.realpath(fd).startswith(where + os.sep)
    ]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded-folder"])
def test_a_merge_reads_grams_mapped_read_only_and_lets_go_of_the_file(good_file, tmp_path, sharded):
    path = _variant(tmp_path, "s.safetensors", good_file.read_bytes())
    if sharded:  # the same statistics as a folder of shards (a Gram alone in a shard)
        path = Statistics.load(path).save(tmp_path / "shards", max_shard_size=1)
    stats = Statistics.load(path)
    module = next(iter(stats.modules))
    g = stats.group_of(module)
    _, by_hand = read_file(good_file)
    mapped = stats.gram_stored(module)
    assert not mapped.flags.writeable
    np.testing.assert_array_equal(mapped, by_hand[f"gram/{g}"])
    copy = stats.tensor(f"gram/{g}")  # the public read stays a writable copy
    assert copy.flags.writeable
    np.testing.assert_array_equal(copy, mapped)
    assert _open_descriptors(path)  # the mapping holds the file while the array lives
    del mapped
    assert not _open_descriptors(path)


def test_a_file_cut_short_after_loading_is_one_line_at_the_mapped_read(good_file, tmp_path):
    path = _variant(tmp_path, "late.safetensors", good_file.read_bytes())
    stats = Statistics.load(path)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(StatisticsFileError, match=r"late\.safetensors.*truncated") as err:
        for module in stats.modules:
            stats.gram_stored(module)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- io atomicity


def test_write_safetensors_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5).astype(np.float32)}
    specs = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    path = tmp_path / "t.safetensors"
    write_safetensors(path, specs, arrays.__getitem__, {"k": "v"})
    loaded = safetensors_numpy.load_file(str(path))
    assert set(loaded) == set(arrays)
    for n, a in arrays.items():
        assert loaded[n].dtype == a.dtype and np.array_equal(loaded[n], a)
    assert H.leftovers(tmp_path) == []


def test_writer_takes_tensors_in_any_order_and_new_metadata(tmp_path):
    from lmdx.files.safetensors import SafetensorsWriter

    rng = np.random.default_rng(1)
    arrays = {n: rng.standard_normal((i + 2, 3)) for i, n in enumerate("abcd")}
    specs = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    path = tmp_path / "t.safetensors"
    with SafetensorsWriter(path, specs, {"n": "0"}, header_reserve=64) as w:
        for n in ("c", "a", "d", "b"):  # not the announced order
            w.write(n, arrays[n])
        w.set_metadata({"n": "4", "more": "x" * 40})  # grows into the reserved space
    with safetensors_numpy.safe_open(str(path), "np") as f:
        assert f.metadata() == {"n": "4", "more": "x" * 40}
        assert all(np.array_equal(f.get_tensor(n), a) for n, a in arrays.items())
    incomplete = tmp_path / "u.safetensors"
    with (
        pytest.raises(ValueError, match="never written"),
        SafetensorsWriter(incomplete, specs) as w,
    ):
        w.write("a", arrays["a"])
    assert H.leftovers(tmp_path) == [] and not incomplete.exists()


def test_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"old contents")
    specs = [TensorSpec("a", np.float64, (4,)), TensorSpec("b", np.float64, (4,))]

    def fails_on_b(name):
        if name == "b":
            raise RuntimeError("producer broke")
        return np.zeros(4)

    with pytest.raises(RuntimeError, match="producer broke"):
        write_safetensors(path, specs, fails_on_b)
    with pytest.raises(
        ValueError, match="tensor 'b' announced as float64\\[4\\], got float64\\[3\\]"
    ):
        write_safetensors(path, specs, lambda n: np.zeros(4 if n == "a" else 3))
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["t.safetensors"]


def test_atomic_directory_refuses_existing_and_cleans_up(tmp_path):
    existing = tmp_path / "out"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"), atomic_directory(existing):
        pass
    assert (existing / "keep.txt").read_text() == "mine"
    target = tmp_path / "new"
    with pytest.raises(KeyError), atomic_directory(target) as tmp:
        (tmp / "partial").write_text("x")
        raise KeyError("interrupted")
    assert not target.exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]


@given(st.integers(1, 600), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_packed_products_and_diagonal(d, k, seed):
    """G @ x and diag G straight from the packed triangle, against the full matrix."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((d, d))
    g = a + a.T
    x = rng.standard_normal((d, k))
    packed = pack_upper(g)
    assert np.abs(packed_times(packed, d, x) - g @ x).max() <= 1e-12 * np.abs(g).sum(1).max()
    assert np.array_equal(packed_diagonal(packed, d), np.diag(g))
    with pytest.raises(ValueError, match="expected"):
        packed_times(packed[:-1], d, x)
