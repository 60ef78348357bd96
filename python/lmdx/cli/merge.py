"""``lmdx merge CONFIG --out DIR``: a merge as a configuration file says."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from .._errors import (
    CliError,
    DataError,
    MergeError,
    MissingFileError,
    ModelMismatchError,
    RegularizationWarning,
    StatisticsFileError,
)
from .common import Claimed, HelpFormatter, report_errors, size_of

__all__ = ["DESCRIPTION", "HELP", "add_merge_parser", "run_merge_cli"]

#: The command's line in ``lmdx --help``.
HELP = (
    "merge models fine-tuned from one checkpoint (RegMean, RegMean++, averages, Fisher, task "
    "arithmetic, TIES, DARE, ...; lmdx methods lists them) as a config file says"
)


#: What ``lmdx merge --help`` says before its flags: a config to start from, and where the
#: rest is (the methods from the registry: ``lmdx methods``; every key: the merging guide).
DESCRIPTION = """\
Merge models fine-tuned from one checkpoint, as a YAML or JSON config says:

  method: regmean          # lmdx methods: every method, what it needs, its options
  models:                  # save_pretrained folders, relative to the config
    - {path: finetuned/bbc, stats: bbc.safetensors}    # from lmdx stats
    - {path: finetuned/reuters, stats: reuters.safetensors}
  alpha: 0.9
  heads: {patterns: ["classifier.*"], policy: keep}    # each model keeps its head

One method with an example config to start from: lmdx methods NAME. Every key, LoRA \
adapters, base models and per-task folders: docs/guide/merging.md."""


def add_merge_parser(sub: Any) -> None:
    p = sub.add_parser(
        "merge",
        help=HELP,
        description=DESCRIPTION,
        epilog=(
            "examples:\n"
            "  lmdx merge merge.yaml --out merged --dry-run   the plan, memory and disk; "
            "nothing written\n"
            "  lmdx merge merge.yaml --out merged\n\n"
            "With heads kept, model i of the config (from 0) predicts its own task with:\n"
            "  model = lmdx.load_merged('merged', task=i)   # merged body, model i's head "
            "and labels"
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("config", metavar="CONFIG", help="YAML or JSON merge configuration")
    p.add_argument("--out", metavar="DIR", help="output folder (must not exist; not with --cost)")
    p.add_argument(
        "--cost",
        nargs="?",
        const="estimate",
        choices=("estimate", "exact"),
        metavar="MODE",
        help="what each task would pay (Gram statistics per model, any method; MODE "
        "estimate or exact); nothing written",
    )
    p.add_argument(
        "--no-cost",
        action="store_true",
        help="skip estimating what each task pays",
    )
    p.add_argument(
        "--exact-cost",
        action="store_true",
        help="what each task pays, measured exactly (slower)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (steps, output shards, memory and disk estimates) and stop",
    )
    p.add_argument(
        "--in-memory",
        action="store_true",
        help="load the models whole instead of streaming them tensor by tensor (needed for "
        "pickle .bin checkpoints)",
    )
    p.add_argument(
        "--ray-workers",
        type=int,
        default=0,
        metavar="N",
        help="solve the RegMean layers on N Ray workers (lmdx[ray]; a local Ray unless "
        "--ray-address)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="auto or HOST:PORT of a Ray cluster (default: start a local Ray)",
    )
    for flag, path, key, field in _option_flags():
        help_ = f"{field.description} (as {path} in the config)"
        if field.annotation is bool:
            p.add_argument(flag, dest=key, action="store_const", const=True, help=help_)
        else:
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            metavar = str(extra.get("metavar", "VALUE"))
            p.add_argument(flag, dest=key, default=None, metavar=metavar, help=help_)
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bars (transformers' included)"
    )


def _option_flags() -> list[tuple[str, str, str, Any]]:
    """The options every merge shares that ``lmdx merge`` has a flag for, from their one
    definition (:meth:`lmdx.merge.options.SharedOptions.flags`): (``--flag``, the key in
    the config, the front doors' keyword, the field)."""
    from ..merge.options import SharedOptions

    return [
        ("--" + path.rsplit(".", 1)[-1].replace("_", "-"), path, key, field)
        for path, key, field in SharedOptions.flags()
    ]


def run_merge_cli(args: argparse.Namespace) -> int:
    """``lmdx merge CONFIG --out DIR [...]``; returns the exit code."""
    claimed = Claimed()
    return report_errors(
        "merge",
        lambda: _merge(args, claimed),
        usage=(
            CliError,
            DataError,
            MergeError,
            MissingFileError,
            ModelMismatchError,
            StatisticsFileError,
        ),
        claimed=claimed,
    )


def _merge(args: argparse.Namespace, claimed: Claimed) -> int:
    from .._util import peak_rss_bytes
    from ..files.atomic import existing_parent
    from ..merge.config import plan_merge, run_merge
    from ..merge.door import check_new_folder
    from ..merge.lora import lora_errors
    from ..merge.registry import method_named
    from ..merge.sink import HEADS_DIR, MERGE_RECORD, TASKS_DIR

    if args.no_cost and args.exact_cost:
        raise CliError("--exact-cost: not with --no-cost; drop one")
    if args.cost:
        if args.no_cost:
            raise CliError("--no-cost: not with --cost; drop one")
        if args.exact_cost:
            raise CliError("--exact-cost: with --cost, say --cost exact")
        return _cost(args)
    if args.out is None:
        raise CliError("--out: the output folder is required (or --cost: nothing written)")
    out = check_new_folder(args.out)
    if args.ray_workers and args.in_memory:
        raise CliError("--ray-workers: only for the streaming merge; drop --in-memory")
    if args.ray_workers < 0:
        raise CliError(f"--ray-workers: expected N >= 0, got {args.ray_workers}")
    cfg = _config(args)
    if args.dry_run:
        if args.in_memory:
            raise CliError("--dry-run plans the streaming merge; drop --in-memory")
        plan = plan_merge(cfg)
        free = shutil.disk_usage(existing_parent(out)).free
        print(plan.describe())
        print(f"disk:     {free / 1e9:.2f} GB free at {existing_parent(out)}")
        if free < plan.output_bytes:
            print("lmdx merge: warning: not enough free disk for the output", file=sys.stderr)
        print(f"lmdx merge: dry run; nothing written (would write {out})")
        return 0
    t0 = time.perf_counter()
    claimed.claim(out)
    with warnings.catch_warnings():
        # Systems that needed a ridge are listed once, in the summary below (and in
        # lmdx_merge.json), instead of one Python warning per layer.
        warnings.simplefilter("ignore", RegularizationWarning)
        run_merge(
            cfg,
            out,
            progress=not args.no_progress,
            streaming=not args.in_memory,
            ray_workers=args.ray_workers,
            ray_address=args.ray_address,
            command=shlex.join(["lmdx", *args.argv]),
            cost=False if args.no_cost else "exact" if args.exact_cost else None,
        )
    size = size_of(out)
    record = json.loads((out / MERGE_RECORD).read_text())
    report = record["report"]
    shown = method_named(cfg.method).headline
    settings = ", ".join(f"{k} {report[k]}" for k in shown if report.get(k) is not None)
    print(
        f"lmdx merge: {cfg.method}{f' ({settings})' if settings else ''} of "
        f"{len(cfg.models)} models in "
        f"{time.perf_counter() - t0:.1f} s; wrote {out} ({size / 1e6:.1f} MB); "
        f"peak RSS {peak_rss_bytes() / 1e9:.2f} GB"
    )
    if isinstance(report.get("base"), dict) and report["base"].get("line"):
        print(f"lmdx merge: {report['base']['line']}")
    _report_precision(report)
    _report_surrogates(report)
    _report_poorly_determined(out / MERGE_RECORD, report)
    _report_not_solved(out / MERGE_RECORD, report)
    _report_cost(report)
    if record.get("lora"):
        print(
            f"lmdx merge: LoRA of the merged update in {out / record['lora']['folder']}, "
            f"{lora_errors(record['lora'])}"
        )
    if record.get("task_folders"):
        print(
            f"lmdx merge: one model folder per task: {out / TASKS_DIR}/<i> "
            f"(i = 0..{len(cfg.models) - 1})"
        )
    if (out / HEADS_DIR).is_dir():
        print(
            f"lmdx merge: model i's classifier (i = 0..{len(cfg.models) - 1}, in the config's "
            f"order): lmdx.load_merged({str(out)!r}, task=i)"
        )
    return 0


def _config(args: argparse.Namespace) -> Any:
    """The merge configuration file, with the options the flags give replacing its own."""
    from ..merge.config import load_merge_config
    from ..merge.options import OptionError

    cfg = load_merge_config(args.config, cost=args.cost is not None)
    for flag, _, key, _ in _option_flags():  # a flag's value replaces the config's
        value = getattr(args, key)
        if value is not None:
            try:
                cfg = cfg.with_option(key, value)
            except OptionError as exc:
                raise CliError(f"{flag}: {exc.what}, got {value!r}") from None
            except MergeError as exc:
                raise CliError(f"{flag}: {exc}") from None
    return cfg


def _cost(args: argparse.Namespace) -> int:
    """``lmdx merge CONFIG --cost``: what each task would pay, printed; nothing written."""
    from ..merge.config import cost_merge

    for flag, given in (
        ("--out", args.out is not None),
        ("--dry-run", args.dry_run),
        ("--in-memory", args.in_memory),
        ("--ray-workers", bool(args.ray_workers)),
    ):
        if given:
            raise CliError(f"{flag}: --cost writes nothing and runs in this process; drop {flag}")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RegularizationWarning)
        report = cost_merge(_config(args), progress=not args.no_progress, mode=args.cost)
    print(
        f"lmdx merge: {report['method']} of {len(report['models'])} models measured in "
        f"{time.perf_counter() - t0:.1f} s (the cost itself {report['cost']['cpu_seconds']:.1f} "
        "CPU s); nothing written"
    )
    _report_surrogates(report)
    _report_cost(report)
    return 0


def _report_cost(report: dict[str, Any]) -> None:
    """What each task pays (:func:`lmdx.merge.cost.cost_lines`), from the merge's
    ``report``; a flag on standard error too."""
    from ..merge.cost import cost_lines

    if not report.get("cost"):
        return
    for line in cost_lines(report["cost"]):
        print(f"lmdx merge: {line}")
        if line.startswith("warning"):
            print(f"lmdx merge: {line}", file=sys.stderr)


def _report_precision(report: dict[str, Any]) -> None:
    """How many RegMean systems each precision solved, and the largest certified output
    error of the float32 ones (from the merge's ``report``)."""
    layers = [  # the solver's reports (SWUDI's eigendecompositions have none)
        info
        for m, info in report.get("layers", {}).items()
        if info.get("shared_with") is None and "precision" in info
    ]
    if not layers:
        return
    counts: dict[str, int] = {}
    for info in layers:
        counts[info["precision"]] = counts.get(info["precision"], 0) + 1
    parts = ", ".join(f"{n} {p}" for p, n in sorted(counts.items()))
    worst = max((float(i.get("output_error_estimate", 0.0)) for i in layers), default=0.0)
    rounded = counts.get("float32") or counts.get("float32-rhs")
    bound = f"; float32 output error <= {worst:.1e} (certified)" if rounded else ""
    print(f"lmdx merge: RegMean systems by precision: {parts}{bound}")


def _report_surrogates(report: dict[str, Any]) -> None:
    """Which models took surrogate statistics (from the merge's ``report``)."""
    from ..merge.surrogate import surrogates_line

    made = report.get("surrogate_stats")
    if made:
        print(f"lmdx merge: {surrogates_line(made)}")


def _report_poorly_determined(record: Path, report: dict[str, Any]) -> None:
    """The RegMean systems the merge found poorly determined (from its ``record``, whose
    ``report`` has been read)."""
    notes = report.get("poorly_determined", [])
    if not notes:
        return
    worst = sorted(notes, key=lambda n: (n["rows"] / max(n["dim"], 1), -n["condition"]))
    shown = "; ".join(f"{n['module']} ({n['why']})" for n in worst[:5])
    more = f"; and {len(notes) - 5} more" if len(notes) > 5 else ""
    print(
        f"lmdx merge: {len(notes)} RegMean system(s) poorly determined (all in "
        f"{record}), fewest rows per input first: {shown}{more}. "
        f"{notes[0]['advice'][0].upper()}"
        f"{notes[0]['advice'][1:]}."
    )


def _report_not_solved(record: Path, report: dict[str, Any]) -> None:
    """The linear weights the statistics could not cover, which were averaged (from the
    merge's ``record``, whose ``report`` has been read)."""
    missing = report.get("not_solved") or {}
    if not missing:
        return
    name, why = next(iter(missing.items()))
    print(
        f"lmdx merge: {len(missing)} linear weight(s) averaged, not solved: their statistics "
        f"could not be collected (all in {record}, not_solved); e.g. {name}: {why}"
    )
