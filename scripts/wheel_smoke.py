"""Smoke suite for an installed lmdx (a release wheel), run from outside the source tree.

    python scripts/wheel_smoke.py [--no-compiler] [--torch]

Checks that lmdx comes from site-packages, not a checkout; picks the best SIMD build this
CPU runs; runs the kernels of every build this CPU runs against NumPy float64 references;
refuses a build the CPU lacks with an ImportError while every other module imports
(simulated with LMDX_DISABLE_CPU_FEATURES); and runs ``lmdx info``. ``--no-compiler``
also asserts that no C/C++ compiler is on PATH (what a user without one has). ``--torch``
(needs torch and transformers) collects RegMean statistics of two tiny BERTs built from a
config and merges them, each checked against NumPy. Used by scripts/check_wheel.sh and by
the wheel builds' test command (pyproject.toml, [tool.cibuildwheel]).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "clang++")


def check(condition: bool, message: str) -> None:
    if not condition:
        sys.exit(f"wheel smoke: FAILED: {message}")


def relative_error(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-300))


def run_self(*args: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    check(proc.returncode == 0, f"{' '.join(args)} {env}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def kernels() -> dict:
    """The public kernels on the running build, each against a float64 NumPy reference."""
    import lmdx

    rng = np.random.default_rng(7)
    x32 = (rng.standard_normal((2000, 97)) + 0.3).astype(np.float32)
    w = rng.uniform(0.0, 2.0, 2000)
    x64 = rng.standard_normal((2000, 97))
    ref32 = x32.astype(np.float64).T @ x32.astype(np.float64)
    gram32 = lmdx.Moments(97).update(x32).gram()
    ref64 = (x64 * w[:, None]).T @ x64
    gram64 = lmdx.Moments(97).update(x64, weights=w).gram()
    a = ref64 / w.sum() + 0.1 * np.eye(97)
    b = rng.standard_normal((97, 3))
    solved = lmdx.spd_solve(a, b).x
    grams = [ref32, ref64]
    weights = [rng.standard_normal((40, 97)) for _ in grams]
    merged = lmdx.regmean_merge_layer(grams, weights, [2000.0, float(w.sum())]).weight
    lhs = grams[0] / 2000.0 + grams[1] / w.sum()
    rhs = grams[0] / 2000.0 @ weights[0].T + grams[1] / w.sum() @ weights[1].T
    averaged = lmdx.weighted_average([weights[0], weights[1]], [1.0, 3.0])
    errors = {
        "gram_float32": relative_error(gram32, ref32),
        "gram_float64": relative_error(gram64, ref64),
        "spd_solve": relative_error(solved, np.linalg.solve(a, b)),
        "regmean_merge_layer": relative_error(merged, np.linalg.solve(lhs, rhs).T),
        "weighted_average": relative_error(averaged, (weights[0] + 3.0 * weights[1]) / 4.0),
    }
    bounds = {"gram_float32": 1e-6}
    for name, err in errors.items():
        check(err <= bounds.get(name, 1e-9), f"{name} on {lmdx.config()['simd_path']}: {err:.1e}")
    return {"simd_path": lmdx.config()["simd_path"], "errors": errors}


def walk() -> dict:
    """Import every module of the package; the ImportErrors, by module."""
    import importlib
    import pkgutil

    import lmdx

    errors = {}
    for info in pkgutil.walk_packages(lmdx.__path__, "lmdx."):
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            errors[info.name] = str(exc)
    return {"errors": errors, "simd_path": lmdx.config()["simd_path"]}


def tiny_merge() -> dict:
    """Statistics of two tiny BERTs (built from a config) and their RegMean merge."""
    import lmdx
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=32,
    )
    base = BertModel(config).eval()
    models = []
    for seed in (1, 2):  # two fine-tuned stand-ins of one checkpoint
        torch.manual_seed(seed)
        model = BertModel(config).eval()
        model.load_state_dict(base.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        models.append(model)
    gen = torch.Generator().manual_seed(3)
    batches = [
        {"input_ids": torch.randint(5, 50, (4, 12), generator=gen), "attention_mask": mask}
        for mask in (torch.ones(4, 12, dtype=torch.long),) * 3
    ]
    name = "encoder.layer.1.intermediate.dense"
    stats, refs = [], []
    for model in models:
        rows: list[np.ndarray] = []
        hook = model.get_submodule(name).register_forward_hook(
            lambda _m, inputs, _out, rows=rows: rows.append(
                inputs[0].detach().double().reshape(-1, inputs[0].shape[-1]).numpy()
            )
        )
        with torch.no_grad():
            for batch in batches:
                model(**batch)
        hook.remove()
        stats.append(lmdx.collect_regmean_stats(model, batches, progress=False))
        x = np.concatenate(rows)
        refs.append((x.T @ x, len(x)))
    gram_err = max(relative_error(s.gram(name), g) for s, (g, _) in zip(stats, refs, strict=True))
    check(gram_err <= 1e-6, f"statistics of {name}: {gram_err:.1e} from float64")
    check(all(s.count(name) == n for s, (_, n) in zip(stats, refs, strict=True)), "row counts")
    merged = lmdx.merge_models(
        models, "regmean", stats=stats, precision="float64", progress=False, exclude=["pooler.*"]
    )
    ws = [m.get_submodule(name).weight.detach().double().numpy() for m in models]
    # RegMean's formula on the statistics the merge was given (checked above), in float64.
    grams = [(s.gram(name), s.count(name)) for s in stats]
    lhs = sum(g / n for g, n in grams)
    rhs = sum(g / n @ w.T for (g, n), w in zip(grams, ws, strict=True))
    ref = np.linalg.solve(lhs, rhs).T
    got = merged.state_dict[f"{name}.weight"].double().numpy()
    merge_err = relative_error(got, ref)
    check(merge_err <= 1e-6, f"merged {name}: {merge_err:.1e} from float64 (float32 weights)")
    return {"gram": gram_err, "merge": merge_err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compiler", action="store_true", help="assert no compiler on PATH")
    parser.add_argument("--torch", action="store_true", help="also collect and merge (torch)")
    parser.add_argument("--part", choices=["kernels", "walk", "tiny-merge"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        part = {"kernels": kernels, "walk": walk, "tiny-merge": tiny_merge}[args.part]
        print(json.dumps(part()))
        return

    import lmdx

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    check(Path(lmdx.__file__).resolve().is_relative_to(site), f"lmdx from {lmdx.__file__}")
    if args.no_compiler:
        found = {c: shutil.which(c) for c in COMPILERS if shutil.which(c)}
        check(not found, f"a compiler is on PATH: {found}")
        print(f"wheel smoke: no compiler on PATH ({', '.join(COMPILERS)} not found)")
    config = lmdx.config()
    supported, built = config["supported_paths"], config["built_paths"]
    print(
        f"wheel smoke: lmdx {lmdx.__version__} from {Path(lmdx.__file__).parent}; built "
        f"{built}, CPU runs {supported}, chose {config['simd_path']}"
    )
    check(config["simd_path"] == supported[0], "the best build this CPU runs was not chosen")
    if "avx512" in built and "avx512f" in config["cpu_features"]:
        check(config["simd_path"] == "avx512", "AVX-512 CPU but the avx512 build not chosen")
    for variant in supported:
        out = run_self("--part", "kernels", env={"LMDX_SIMD": variant})
        check(out["simd_path"] == variant, f"LMDX_SIMD={variant} ran {out['simd_path']}")
        worst = max(out["errors"].values())
        print(f"wheel smoke: kernels on {variant} match NumPy float64 (worst {worst:.1e})")
    for variant in [v for v in built if v != "baseline"]:
        level = {"avx2": "x86-64-v3", "avx512": "x86-64-v4"}[variant]
        out = run_self("--part", "walk", env={"LMDX_DISABLE_CPU_FEATURES": level})
        check(set(out["errors"]) <= {"lmdx._core_avx2", "lmdx._core_avx512"}, str(out["errors"]))
        message = out["errors"].get(f"lmdx._core_{variant}", "")
        check(f"cannot run the {variant} build" in message, f"import of {variant}: {message}")
        print(
            f"wheel smoke: without {level}, every module imports but lmdx._core_{variant} "
            f"(ImportError), chose {out['simd_path']}"
        )
    command = str(Path(sysconfig.get_paths()["scripts"]) / "lmdx")
    info = subprocess.run([command, "info"], capture_output=True, text=True, timeout=120)
    check(info.returncode == 0 and "simd_path" in info.stdout, f"lmdx info: {info.stderr}")
    print("wheel smoke: `lmdx info`:\n" + info.stdout.rstrip())
    if args.torch:
        out = run_self("--part", "tiny-merge")
        print(
            f"wheel smoke: tiny BERT statistics within {out['gram']:.1e} and RegMean merge "
            f"within {out['merge']:.1e} of float64"
        )
    print("wheel smoke: passed")


if __name__ == "__main__":
    main()
