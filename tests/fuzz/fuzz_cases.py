"""Hostile and unlucky inputs for lmdx, generated from one clean workspace.

A workspace holds two tiny checkpoints (one single file, one sharded with an index),
their RegMean statistics (one file, one sharded folder), their Fisher statistics and a
merge config for each kind; the clean merges are computed once. :func:`run_case`
corrupts one input of one *target* (byte flips, truncations at every region, header and
JSON mutations, YAML mutations) the way a random number generator says, runs the merge,
and checks the outcome:

* only :class:`lmdx.LmdxError` subclasses are raised (anything else is a bad outcome);
* on an error nothing is written beside the output (no partial folder, no temporary);
* no input file is modified;
* a merge that succeeds from corrupted statistics or checkpoints equals the clean merge
  tensor for tensor (every such corruption is detectable: content hashes, identity
  hashes, the strict reader), and a config that is accepted gives a complete folder.

Used by tests/fuzz/test_fuzz.py (hypothesis draws the seeds) and scripts/fuzz.py (the
long release run).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

TARGETS = ("stats_file", "stats_folder", "fisher_file", "checkpoint", "checkpoint_index", "config")
MODULES = ("enc.a", "enc.b")
D_IN, D_OUT, ROWS = 6, 5, 40


# --------------------------------------------------------------------------- workspace


def _state(rng: np.random.Generator, base: dict[str, np.ndarray] | None) -> dict[str, Any]:
    state = {}
    for m in MODULES:
        for suffix, shape in (("weight", (D_OUT, D_IN)), ("bias", (D_OUT,))):
            name = f"{m}.{suffix}"
            noise = rng.standard_normal(shape).astype(np.float32)
            state[name] = noise if base is None else base[name] + np.float32(0.1) * noise
    state["norm.weight"] = np.ones(D_IN, np.float32) + (0 if base is None else 0.01)
    state["position_ids"] = np.arange(4, dtype=np.int64)
    return state


def _statistics(state: dict[str, Any], rng: np.random.Generator, on_torch: bool) -> Any:
    """RegMean statistics of bfloat16 rows as the collectors accumulate them: lmdx's
    kernel (the bf16 dot product where the CPU has it; ``"mixed"``), or torch's
    (``"torch-float32"``, :mod:`lmdx.stats.torch_gram`)."""
    import torch
    from lmdx import Moments
    from lmdx.files.identity import model_identity
    from lmdx.stats import Statistics
    from lmdx.stats.torch_gram import TorchGram

    identity = model_identity(state)
    modules, groups, moments = {}, {}, {}
    for m in MODULES:
        x = torch.from_numpy(rng.standard_normal((ROWS, D_IN))).to(torch.bfloat16)
        modules[m] = {"group": m, "layout": "linear", "weight": f"{m}.weight", "dim": D_IN}
        groups[m] = {"dim": D_IN, "count": float(ROWS)}
        if on_torch:
            acc = TorchGram(D_IN, "cpu")
            acc.update(x)
            moments[m] = acc.moments(m)
        else:
            moments[m] = Moments(D_IN).update(x)
    return Statistics(
        kind="regmean-gram",
        model=identity,
        data="fuzz rows",
        padding="excluded",
        modules=modules,
        groups=groups,
        moments=moments,
        extra={"accumulation": "torch-float32" if on_torch else "mixed"},
    )


def _fisher(state: dict[str, Any], rng: np.random.Generator) -> Any:
    from lmdx.files.identity import model_identity
    from lmdx.stats import Statistics

    params = {n: a.shape for n, a in state.items() if a.dtype == np.float32}
    return Statistics(
        kind="fisher",
        model=model_identity(state),
        parameters={n: {"shape": list(shape)} for n, shape in params.items()},
        count=float(ROWS),
        tensors={f"fisher/{n}": rng.random(shape) + 0.1 for n, shape in params.items()},
    )


def _write_checkpoint(folder: Path, state: dict[str, Any], sharded: bool) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "fuzz"}))
    (folder / "special_tokens_map.json").write_text('{"pad_token": "[PAD]"}')
    if not sharded:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for j, part in enumerate(halves):
        fname = f"model-{j + 1:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


CONFIG = """method: regmean
models:
  - {path: m0, stats: s0.safetensors}
  - {path: m1, stats: s1}
alpha: 0.9
threads: 1
output: {dtype: auto, max_shard_size: 2GB}
"""
FISHER_CONFIG = """method: fisher
models:
  - {path: m0, stats: f0.safetensors}
  - {path: m1, stats: f1.safetensors}
"""


class Workspace:
    """The clean inputs (under ``root/clean``) and the clean merge's tensors."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clean = root / "clean"
        self.clean.mkdir(parents=True)
        rng = np.random.default_rng(0)
        base = _state(rng, None)
        for i in range(2):
            state = _state(rng, base)
            _write_checkpoint(self.clean / f"m{i}", state, sharded=i == 1)
            stats = _statistics(state, rng, on_torch=i == 1)
            stats.save(
                self.clean / f"s{i}" if i else self.clean / "s0.safetensors",
                max_shard_size="200B" if i else None,
            )
            _fisher(state, rng).save(self.clean / f"f{i}.safetensors")
        (self.clean / "config.yaml").write_text(CONFIG)
        (self.clean / "fisher.yaml").write_text(FISHER_CONFIG)
        self.expected = self.merge(self.clean, root / "clean-merge")
        self.expected_fisher = self.merge(self.clean, root / "clean-fisher", "fisher.yaml")
        self.cases = 0

    def merge(self, folder: Path, out: Path, config: str = "config.yaml") -> dict[str, np.ndarray]:
        """The merge of the inputs in ``folder`` (as ``config`` says) into ``out``."""
        from lmdx.merge import load_merge_config, run_merge

        run_merge(load_merge_config(folder / config), out, progress=False)
        return load_file(str(out / "model.safetensors"))


# --------------------------------------------------------------------------- mutations

NASTY: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**63,
    2**64 + 1,
    1.5,
    -0.0,
    1e308,
    "",
    "x",
    "F32",
    "\x1b[31mred",
    [],
    {},
    [0],
    [[1, 2]],
    [0, 2**62],
    {"dtype": "F32"},
    "a" * 300,
    10**400,
)


def _header_split(raw: bytes) -> tuple[int, bytes, bytes] | None:
    if len(raw) < 8:
        return None
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        return None
    return n, raw[8 : 8 + n], raw[8 + n :]


def _nodes(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _nodes(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _nodes(v, (*path, i))
    return out


def _mutate_tree(tree: Any, rnd: random.Random) -> Any:
    """One change to a JSON-like tree: a value replaced by a nasty one, a key deleted or
    renamed, a number nudged, two siblings swapped; JSON strings holding JSON (the lmdx
    metadata) are mutated inside."""
    tree = json.loads(json.dumps(tree))
    paths = _nodes(tree)
    path = rnd.choice(paths)
    if not path:
        return rnd.choice(NASTY)
    parent = tree
    for p in path[:-1]:
        parent = parent[p]
    key = path[-1]
    value = parent[key]
    op = rnd.randrange(6)
    if isinstance(value, str) and value[:1] in "{[" and op < 3:
        try:
            inner = json.loads(value)
        except ValueError:
            inner = None
        if inner is not None:
            parent[key] = json.dumps(_mutate_tree(inner, rnd))
            return tree
    if op == 0 and isinstance(parent, dict):
        del parent[key]
    elif op == 1 and isinstance(parent, dict):
        parent[str(key) + rnd.choice(["_", "x", "\u202e"])] = parent.pop(key)
    elif op == 2 and isinstance(value, (int, float)) and not isinstance(value, bool):
        parent[key] = value + rnd.choice([-1, 1, 8, -8, 0.5, 1e-9]) * (1 if value == 0 else value)
    elif op == 3 and isinstance(parent, dict) and len(parent) > 1:
        other = rnd.choice([k for k in parent if k != key])
        parent[key], parent[other] = parent[other], parent[key]
    else:
        parent[key] = rnd.choice(NASTY)
    return tree


def _header_bytes(header: Any, rnd: random.Random) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    if rnd.random() < 0.7:
        text += b" " * (-len(text) % 8)
    return text


def mutate_safetensors(raw: bytes, rnd: random.Random) -> bytes:
    """A corrupted copy of a safetensors file."""
    split = _header_split(raw)
    kind = rnd.randrange(8)
    if kind == 0:  # truncate, at a region boundary or anywhere
        marks = [0, 4, 8, len(raw) // 2, len(raw) - 1, len(raw) - 8]
        if split:
            marks += [8 + split[0] - 1, 8 + split[0], 8 + split[0] + 1]
        cut = rnd.choice([*marks, rnd.randrange(len(raw))])
        return raw[: max(cut, 0)]
    if kind == 1:  # flip bytes in the header or the data
        out = bytearray(raw)
        end = 8 + split[0] if split else len(raw)
        for _ in range(rnd.randint(1, 3)):
            pos = rnd.randrange(end) if rnd.random() < 0.5 else rnd.randrange(len(raw))
            out[pos] ^= rnd.randrange(1, 256)
        return bytes(out)
    if kind == 2:  # bytes appended or inserted
        extra = bytes(rnd.randrange(256) for _ in range(rnd.choice([1, 7, 8, 64])))
        pos = rnd.choice([len(raw), 8 + split[0] if split else 8])
        return raw[:pos] + extra + raw[pos:]
    if split is None:
        return raw[:-1]
    n, header_raw, data = split
    try:
        header = json.loads(header_raw)
    except ValueError:
        return raw[:-1]
    if kind == 3:  # a header length that lies
        return (n + rnd.choice([-8, -1, 1, 8, 2**40])).to_bytes(8, "little", signed=True)[:8] + raw[
            8:
        ]
    if kind == 4:  # ranges swapped or shifted (same shapes)
        names = [k for k in header if k != "__metadata__"]
        a, b = rnd.choice(names), rnd.choice(names)
        if rnd.random() < 0.5:
            header[a]["data_offsets"], header[b]["data_offsets"] = (
                header[b]["data_offsets"],
                header[a]["data_offsets"],
            )
        else:
            shift = rnd.choice([-8, 8, 4])
            header[a]["data_offsets"] = [o + shift for o in header[a]["data_offsets"]]
        return _with_header(header, data, rnd)
    if kind == 5:  # nested deeply, not UTF-8, duplicated key
        bad = rnd.choice(
            [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000, b"\xff\xfe{}"]
        )
        if rnd.random() < 0.5:
            text = header_raw.rstrip()
            bad = text[:-1] + b',"' + next(iter(header)).encode() + b'":{}}'
        return len(bad).to_bytes(8, "little") + bad + data
    return _with_header(_mutate_tree(header, rnd), data, rnd)


def _with_header(header: Any, data: bytes, rnd: random.Random) -> bytes:
    text = _header_bytes(header, rnd)
    return len(text).to_bytes(8, "little") + text + data


def mutate_json_text(raw: bytes, rnd: random.Random) -> bytes:
    """A corrupted copy of a JSON document (an index)."""
    kind = rnd.randrange(5)
    if kind == 0:
        return raw[: rnd.randrange(len(raw))]
    if kind == 1:
        out = bytearray(raw)
        for _ in range(rnd.randint(1, 3)):
            out[rnd.randrange(len(out))] ^= rnd.randrange(1, 256)
        return bytes(out)
    if kind == 2:
        return rnd.choice([b"[" * 50_000, b"\xff\xfe\x00", b'{"weight_map": {"a": "b", "a": "c"}}'])
    return json.dumps(_mutate_tree(json.loads(raw), rnd)).encode()


def mutate_yaml_text(raw: bytes, rnd: random.Random) -> bytes:
    """A corrupted copy of a YAML merge config."""
    import yaml

    kind = rnd.randrange(6)
    if kind == 0:
        return raw[: rnd.randrange(len(raw))]
    if kind == 1:
        out = bytearray(raw)
        out[rnd.randrange(len(out))] ^= rnd.randrange(1, 256)
        return bytes(out)
    if kind == 2:  # alias bombs, deep nesting, odd numbers
        bomb = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + "".join(
            f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
            for p, c in zip("abcdefgh", "bcdefghi", strict=True)
        )
        numbers = [
            "threads: .inf",
            f"threads: {2**63}",
            "threads: 1.5",
            "threads: true",
            "alpha: " + "9" * 400,
            "output: {max_shard_size: infGB}",
            "alpha: .nan",
        ]
        extra = rnd.choice([bomb, "x: " + "[" * 20_000, rnd.choice(numbers)])
        return raw + b"\n" + extra.encode()
    tree = yaml.safe_load(raw)
    return yaml.safe_dump(_mutate_tree(tree, rnd), allow_unicode=True).encode()


# --------------------------------------------------------------------------- cases


def _hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _corrupt(case: Path, target: str, rnd: random.Random) -> str:
    """Corrupt one file of ``target`` in the copy ``case``; return what was done."""
    pick: Callable[[list[Path]], Path] = rnd.choice
    if target == "stats_file":
        file = case / "s0.safetensors"
        file.write_bytes(mutate_safetensors(file.read_bytes(), rnd))
    elif target == "fisher_file":
        file = case / "f0.safetensors"
        file.write_bytes(mutate_safetensors(file.read_bytes(), rnd))
    elif target == "stats_folder":
        files = sorted((case / "s1").iterdir())
        file = pick(files)
        mutate = mutate_json_text if file.suffix == ".json" else mutate_safetensors
        file.write_bytes(mutate(file.read_bytes(), rnd))
    elif target == "checkpoint":
        file = case / "m0" / "model.safetensors"
        file.write_bytes(mutate_safetensors(file.read_bytes(), rnd))
    elif target == "checkpoint_index":
        file = pick(sorted(p for p in (case / "m1").iterdir() if p.name.startswith("model")))
        mutate = mutate_json_text if file.suffix == ".json" else mutate_safetensors
        file.write_bytes(mutate(file.read_bytes(), rnd))
    else:
        file = case / "config.yaml"
        file.write_bytes(mutate_yaml_text(file.read_bytes(), rnd))
    return str(file.relative_to(case))


def run_case(ws: Workspace, target: str, seed: int) -> str:
    """One corrupted input of ``target`` (from ``seed``), merged; returns ``"merged"`` or
    the name of the :class:`lmdx.LmdxError` raised. A bad outcome raises AssertionError."""
    from lmdx import LmdxError

    rnd = random.Random(f"{target}:{seed}")
    ws.cases += 1
    case = ws.root / f"case-{ws.cases}"
    shutil.copytree(ws.clean, case)
    try:
        what = _corrupt(case, target, rnd)
        before = _hashes(case)
        out = case / "out"
        fisher = target == "fisher_file"
        expected = ws.expected_fisher if fisher else ws.expected
        try:
            got = ws.merge(case, out, "fisher.yaml" if fisher else "config.yaml")
        except LmdxError as exc:
            outcome = type(exc).__name__
            assert "\n" not in str(exc), f"{target} {what} seed {seed}: message spans lines"
            assert not out.exists(), f"{target} {what} seed {seed}: partial output"
        except Exception as exc:
            raise AssertionError(
                f"{target}: {what} (seed {seed}) raised {type(exc).__name__}: {exc}"
            ) from exc
        else:
            outcome = "merged"
            if target != "config":
                assert set(got) == set(expected), f"{target} {what} seed {seed}"
                for name, arr in got.items():
                    assert np.array_equal(arr, expected[name]), (
                        f"{target}: {what} (seed {seed}) merged silently differently: {name}"
                    )
            shutil.rmtree(out)
        leftovers = [p.name for p in case.iterdir() if p.name.startswith(".")]
        assert not leftovers, f"{target} {what} seed {seed}: temporaries left: {leftovers}"
        assert _hashes(case) == before, f"{target} {what} seed {seed}: an input was modified"
        return outcome
    finally:
        shutil.rmtree(case, ignore_errors=True)
