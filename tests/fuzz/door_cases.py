"""Hostile and unlucky arguments for the in-memory door, ``lmdx.merge_state_dicts``: every
built-in method that needs no data (each also followed by ``+svc`` now and then), its
options drawn from valid and invalid values, the models' dtype (float32, bfloat16,
float16), the ``dtype`` and ``out_dtype`` arguments drawn from torch, NumPy and string
spellings valid or not, tensors of every awkward shape (0-dim floats and integers, empty
ones), and now and then a NaN or an Inf in one model or in the base.

:func:`run_door_case` checks the outcome:

* only :class:`lmdx.LmdxError` subclasses are raised, in one line;
* a merge that succeeds returns every key with its shape, integer tensors as the first
  model's, floating-point ones finite and in the dtype asked for (the input's by default);
* a non-finite value in a tensor a merge reads never comes back merged.

Used by tests/fuzz/test_fuzz.py and scripts/fuzz.py (target ``state_dicts``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

#: Option values drawn for every option of a method: valid ones for most options, and
#: values no option takes.
VALUES: tuple[Any, ...] = (
    *(0.0, 0.1, 0.2, 0.5, 0.9, 1.0, 0, 1, 3),  # valid for most options
    *(2.0, -1.0, 1e300, float("nan"), "x", True),  # valid for few or none
)


def _dtype_argument(rnd: random.Random) -> Any:
    import torch

    if rnd.random() < 0.6:
        return None
    return rnd.choice(
        [torch.float32, torch.bfloat16, "float16", "torch.float64", np.float32, torch.int8,
         torch.bool, torch.complex64, "float33", 3]
    )  # fmt: skip


def _models(rnd: random.Random, dtype: Any) -> dict[Any, dict[str, Any]]:
    """A base and three models: a matrix (possibly with no rows or columns), a vector, a
    0-dim float, a 0-dim integer (equal in all) and an integer vector."""
    import torch

    gen = torch.Generator().manual_seed(rnd.randrange(2**31))
    rows, cols = rnd.choice([0, 1, 5, 8]), rnd.choice([0, 1, 4, 6])
    base = {
        "w": torch.randn(rows, cols, generator=gen),
        "b": torch.randn(cols, generator=gen),
        "scale": torch.tensor(rnd.uniform(0.5, 3.0)),
    }
    models: dict[Any, dict[str, Any]] = {"base": base}
    for i in range(3):
        models[i] = {n: t + 0.02 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
    for state in models.values():
        for name in list(state):
            state[name] = state[name].to(dtype)
        state["steps"] = torch.tensor(7)
        state["ids"] = torch.arange(3)
    return models


def run_door_case(seed: int) -> str:
    """One drawn call of ``merge_state_dicts`` (from ``seed``); returns ``"merged"`` or the
    name of the :class:`lmdx.LmdxError` raised. A bad outcome raises AssertionError."""
    import torch
    from lmdx import LmdxError, merge_state_dicts
    from lmdx.merge.builtin import BUILT_IN
    from lmdx.merge.registry import methods

    rnd = random.Random(f"state_dicts:{seed}")
    # lmdx's own methods (a test may have registered one of its own in this process)
    usable = {
        n: m for n, m in methods().items() if m in BUILT_IN and not m.stats and not m.takes_data
    }
    name = rnd.choice(sorted(usable))
    method = usable[name]
    if rnd.random() < 0.2:
        name += "+svc"
    dtype = rnd.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    models = _models(rnd, dtype)
    poisoned = None
    if rnd.random() < 0.25:
        poisoned = rnd.choice(["base", 0, 1, 2])
        tensor = rnd.choice(["w", "b", "scale"])
        t = models[poisoned][tensor]
        if t.numel():
            t.view(-1)[rnd.randrange(t.numel())] = rnd.choice([float("nan"), float("inf")])
        else:
            poisoned = None
    needs_base = method.needs_base or name.endswith("+svc")
    inputs = models if needs_base else {i: models[i] for i in (0, 1, 2)}
    options = {k: rnd.choice(VALUES) for k in method.options.model_fields if rnd.random() < 0.25}
    dtype_arg, out_arg = _dtype_argument(rnd), _dtype_argument(rnd)
    what = (
        f"{name} {dtype} options {options} dtype {dtype_arg!r} out_dtype {out_arg!r} "
        f"poisoned {poisoned!r} (seed {seed})"
    )
    try:
        merged = merge_state_dicts(
            inputs,
            name,
            base="base" if needs_base else None,
            parameters=options,
            dtype=dtype_arg,
            out_dtype=out_arg,
        )
    except LmdxError as exc:
        assert "\n" not in str(exc), f"state_dicts: {what}: message spans lines"
        return type(exc).__name__
    except Exception as exc:
        raise AssertionError(f"state_dicts: {what} raised {type(exc).__name__}: {exc}") from exc
    used = poisoned is not None and (poisoned != "base" or needs_base)
    assert not used, f"state_dicts: {what}: a NaN/Inf input was merged"
    first = models[0]
    assert list(merged) == list(first), f"state_dicts: {what}: keys"
    for key, t in merged.items():
        assert t.shape == first[key].shape, f"state_dicts: {what}: {key} shape {t.shape}"
        if not first[key].is_floating_point():
            assert torch.equal(t, first[key]), f"state_dicts: {what}: {key} changed"
            continue
        assert bool(torch.isfinite(t).all()), f"state_dicts: {what}: {key} not finite"
        want = out_arg if out_arg is not None else dtype_arg if dtype_arg is not None else dtype
        assert str(t.dtype).removeprefix("torch.") == str(
            getattr(want, "__name__", want)
        ).removeprefix("torch."), f"state_dicts: {what}: {key} is {t.dtype}"
    return "merged"


def _statistics_as(source: Any, out: Any, kind: str) -> Any:
    """Statistics ``source`` written to ``out`` as ``kind``: ``"forged"`` (every Gram and
    sum ×100, rows kept) or ``"impossible"`` (a NaN, an Inf or a negative diagonal entry
    in one Gram), re-hashed so that every file check passes."""
    from lmdx.stats import Statistics

    s = Statistics.load(source)
    tensors = {t.name: s.packed(t.name).copy() for t in s.specs()}
    grams = sorted(n for n in tensors if n.startswith("gram/"))
    if kind == "forged":
        for name in tensors:
            if name.startswith(("gram/", "sum/")):
                tensors[name] *= 100.0
    else:
        value = [float("nan"), float("inf"), -1.0][len(str(out)) % 3]
        tensors[grams[0]].reshape(-1)[0] = value
    return s.rebuilt(tensors).save(out)


def run_cost_case(ws: Any, seed: int) -> str:
    """One drawn merge or cost measurement of the workspace's two models (``ws``:
    :class:`fuzz_cases.Workspace`, its ``m0`` also the base) with each model's statistics
    real, forged (×100), impossible or absent (surrogates), through ``merge_cost`` or a
    written ``stream_merge`` with or without ``accept_flagged``; returns ``"merged"``,
    ``"measured"`` or the :class:`lmdx.LmdxError` raised. A bad outcome (another
    exception, an impossible file measured or merged, a forged file not flagged, a flagged
    merge written without acceptance, a partial output, a modified input) raises
    AssertionError."""
    import shutil

    from lmdx import LmdxError
    from lmdx.merge import merge_cost, stream_merge

    rnd = random.Random(f"cost:{seed}")
    case = ws.root / f"cost-{seed}"
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(ws.clean, case)
    try:
        method = rnd.choice(["regmean", "regmean", "average", "task_arithmetic", "ties", "wudi"])
        kinds = [rnd.choice(["real", "real", "forged", "impossible", "none"]) for _ in range(2)]
        stats: list[Any] = []
        for i, kind in enumerate(kinds):
            given = case / ("s0.safetensors" if i == 0 else "s1")
            if kind in ("forged", "impossible"):
                given = _statistics_as(given, case / f"{kind}{i}.safetensors", kind)
            stats.append(None if kind == "none" else given)
        options: dict[str, Any] = {}
        if method == "regmean" and rnd.random() < 0.5:
            options["surrogate"] = True
        if method in ("task_arithmetic", "ties", "wudi") or options:
            options["base"] = case / "m0"
        write = rnd.random() < 0.5
        if write and rnd.random() < 0.5:
            options["accept_flagged"] = True
        what = f"{method} stats {kinds} options {sorted(options)} write {write} (seed {seed})"
        before = {p: p.read_bytes() for p in sorted(case.rglob("*")) if p.is_file()}
        models = [case / "m0", case / "m1"]
        out = case / "out"
        try:
            if write:
                stats_arg = stats if method == "regmean" else None
                extra = {} if method == "regmean" else {"cost": False}
                report = stream_merge(
                    models, out, method, stats=stats_arg, progress=False, **extra, **options
                ).report
            else:
                report = merge_cost(models, method, stats=stats, progress=False, **options)
        except LmdxError as exc:
            assert "\n" not in str(exc), f"cost: {what}: message spans lines"
            assert not out.exists(), f"cost: {what}: partial output"
            return type(exc).__name__
        except Exception as exc:
            raise AssertionError(f"cost: {what} raised {type(exc).__name__}: {exc}") from exc
        finally:
            after = {p: p.read_bytes() for p in before}
            assert after == before, f"cost: {what}: an input was modified"
        cost = report.get("cost")
        if cost is not None:
            assert "impossible" not in kinds, f"cost: {what}: an impossible Gram was measured"
            if "forged" in kinds and "real" in kinds:
                assert cost["flagged"], f"cost: {what}: a forged file was not flagged"
            if write and cost["flagged"]:
                assert options.get("accept_flagged"), f"cost: {what}: flagged merge written"
        return "merged" if write else "measured"
    finally:
        shutil.rmtree(case, ignore_errors=True)
