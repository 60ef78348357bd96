"""``lmdx stats``: collect, add and show statistics files."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .._errors import CliError, DataError, MergeError, MissingFileError
from .common import Claimed, HelpFormatter, printable, report_errors, size_of

__all__ = ["HELP", "add_stats_parser", "run_stats_cli"]

#: The command's line in ``lmdx --help``.
HELP = "collect RegMean Gram or Fisher statistics of a model on data; add or show files"


# --------------------------------------------------------------------------- parsers


def add_stats_parser(sub: Any) -> None:
    p = sub.add_parser(
        "stats",
        help=HELP,
        description=(
            "Collect the statistics a contributor shares instead of data: the Gram of every "
            "linear module's input (RegMean) or the diagonal Fisher, over the texts in DATA, "
            "written to one safetensors file with JSON metadata.\n\n"
            "  lmdx stats MODEL DATA --out FILE   collect\n"
            "  lmdx stats add FILE FILE... --out FILE   add statistics of disjoint data shards\n"
            "  lmdx stats show FILE   print a file's metadata\n\n"
            "DATA is a text file (one text per line), a .jsonl file (field --text-field), a "
            ".csv file (column --text-field) or corpus:NAME (a corpus of lmdx.data.corpora); for "
            "vision models a folder of images (read with Pillow, turned into pixel values by "
            "the image processor saved in MODEL, preprocessor_config.json) or a .npy file of "
            "pixel values (images, channels, height, width), used as they are.\n\n"
            "Texts are cut at --max-length tokens: use the length the model was fine-tuned "
            "with.\n\n"
            "--include/--exclude are shell-style patterns (* and ?, case-sensitive). What they "
            "match depends on --kind:\n"
            "  regmean  module names, as in model.named_modules() (bert.encoder.layer.0."
            "output.dense,\n"
            "           classifier; or their weights' names: classifier.* works too); only\n"
            "           nn.Linear / Conv1D modules have Grams\n"
            "  fisher   parameter names, as in model.named_parameters() "
            "(bert.encoder.layer.0.output.\n"
            "           dense.weight, classifier.bias): 'classifier.*', not 'classifier'\n"
            "A saved model folder does not record which layers were frozen while fine-tuning: "
            "leave\nthem (and the task head) out with --exclude; what is left out is averaged "
            "by the merge."
        ),
        epilog=(
            "examples:\n"
            "  lmdx stats finetuned/bbc corpus:bbc_news --max-texts 1000 --out bbc.safetensors\n"
            "  lmdx stats finetuned/bbc train.jsonl --max-length 64 --out bbc.safetensors\n"
            "  lmdx stats finetuned/bbc train.jsonl --kind fisher --exclude 'classifier.*' "
            "'bert.embeddings.*' --out bbc-fisher.safetensors\n"
            "  lmdx stats finetuned/bbc corpus:bbc_news --out bbc.safetensors --ray --workers 4\n"
            "  lmdx stats finetuned/vit photos/ --batch-size 32 --out vit.safetensors\n"
            "  lmdx stats add part1.safetensors part2.safetensors --out all.safetensors"
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="a save_pretrained model folder, a sentence-transformers folder (its "
        "Transformer), or a PEFT LoRA adapter folder (with --base)",
    )
    p.add_argument(
        "--base",
        default=None,
        metavar="FOLDER",
        help="MODEL is a LoRA adapter: the model folder it adapts (statistics of base + "
        "adapter, for merging the adapter over that base)",
    )
    p.add_argument(
        "data",
        metavar="DATA",
        help="texts: FILE.txt, FILE.jsonl, FILE.csv, corpus:NAME; images: FOLDER, FILE.npy",
    )
    p.add_argument("--out", required=True, metavar="FILE", help="statistics file to write")
    p.add_argument(
        "--kind",
        choices=("regmean", "fisher"),
        default="regmean",
        help="regmean: the Gram of every linear module's input; fisher: the diagonal Fisher "
        "of every parameter",
    )
    p.add_argument(
        "--description",
        default=None,
        help="what the data is, stored in the file (default: 'N texts from DATA')",
    )
    p.add_argument("--text-field", default="text", help="field/column of .jsonl/.csv texts")
    p.add_argument(
        "--label-field", default="label", help="field/column of gold labels (--labels gold)"
    )
    p.add_argument(
        "--max-texts",
        type=int,
        default=None,
        metavar="N",
        help="use the first N texts or images (default: all)",
    )
    p.add_argument("--batch-size", type=int, default=16, help="texts per forward pass")
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="tokens per text, longer texts are cut (truncation): match the fine-tuning "
        "length (default: 128), for a sentence-transformers folder its max_seq_length",
    )
    p.add_argument(
        "--include-padding",
        action="store_true",
        help="count padding tokens like the reference code (default: left out)",
    )
    p.add_argument(
        "--include",
        nargs="+",
        metavar="PATTERN",
        help="collect only what matches: module names (--kind regmean) or parameter names "
        "(--kind fisher) (default: every linear module / every parameter)",
    )
    p.add_argument(
        "--exclude",
        nargs="+",
        metavar="PATTERN",
        help="leave out what matches: module names (--kind regmean, e.g. classifier) or "
        "parameter names (--kind fisher, e.g. 'classifier.*')",
    )
    p.add_argument(
        "--no-share-inputs", action="store_true", help="one Gram per module even for q/k/v"
    )
    p.add_argument(
        "--accumulation",
        default=None,
        metavar="{mixed,float64}",
        help="how Grams are accumulated: mixed (float32 products of chunks of rows summed in "
        "float64, the default) or float64 (activations multiplied in float64)",
    )
    p.add_argument(
        "--float64-products",
        action="store_true",
        help="deprecated: write --accumulation float64",
    )
    p.add_argument(
        "--labels",
        choices=("predicted", "gold"),
        default="predicted",
        help="Fisher: the log-likelihood of the label the model predicts, or of the gold "
        "label (--label-field)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads of the Gram products (default: $LMDX_NUM_THREADS or every CPU "
        "available; see lmdx info)",
    )
    p.add_argument(
        "--max-memory",
        default=None,
        metavar="SIZE",
        help="bound on the Grams held in memory (e.g. 4GB; on --device, that device's): more "
        "passes over the data, each writing its Grams to --out as it ends (regmean, "
        "without --ray)",
    )
    p.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="run the model and accumulate the Grams on this torch device (e.g. cuda, "
        "cuda:1; regmean, without --ray): the model and its float64 Grams must fit there "
        "(--max-memory bounds the Grams) (default: cpu)",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=("lmdx", "torch"),
        help="where the Gram arithmetic runs: lmdx (the native kernels, on the CPU) or torch "
        "(matmuls on the model's device; the file records accumulation torch-float32) "
        "(default: lmdx on the CPU, torch on any other device; regmean, without --ray)",
    )
    p.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="write --out as a folder of shards of at most SIZE (e.g. 2GB) with an index",
    )
    ray = p.add_argument_group(
        "Ray (RegMean only; pip install 'ray>=2.9')",
        "split the batches into contiguous shards collected by Ray workers that each load "
        "MODEL once; the shards' statistics are added in float64 (the same file as without "
        "Ray, Grams to <= 1e-12 relative, plus extra.ray naming the shards)",
    )
    ray.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="collect with Ray: no value starts a local Ray; 'auto', HOST:PORT or "
        "ray://HOST:PORT joins a cluster (MODEL must be readable on every node)",
    )
    ray.add_argument(
        "--workers", type=int, default=None, metavar="N", help="Ray workers (default: 2)"
    )
    ray.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        metavar="T",
        help="CPUs per worker (default: 1)",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bars (transformers' included)"
    )


def _stats_add_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmdx stats add",
        description="Add statistics of disjoint data shards of one model into one file "
        "(one file given: rewrite it in this lmdx's format, e.g. a format 2 file as 3).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="statistics files or folders")
    p.add_argument("--out", required=True, metavar="FILE", help="statistics file to write")
    p.add_argument(
        "--description",
        default=None,
        help="what the data is (default: the files' descriptions joined)",
    )
    p.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="write --out as a folder of shards of at most SIZE (default: one file)",
    )
    return p


def _stats_show_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmdx stats show",
        description="Print a file's metadata.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("file", metavar="FILE", help="a statistics file or folder")
    p.add_argument("--json", action="store_true", help="the full metadata as JSON")
    return p


def _label_ids(labels: list[Any] | None, model: Any, spec: str) -> list[int]:
    if labels is None:
        raise CliError(f"--labels gold: DATA {spec} has no labels (--label-field)")
    label2id = {str(k): int(v) for k, v in (model.config.label2id or {}).items()}
    out = []
    for v in labels:
        if isinstance(v, int) or (isinstance(v, str) and v.isdigit()):
            out.append(int(v))
        elif str(v) in label2id:
            out.append(label2id[str(v)])
        else:
            raise CliError(
                f"--labels gold: label {v!r} is neither an integer nor in the model's "
                f"label2id {sorted(label2id)}"
            )
    return out


# --------------------------------------------------------------------------- commands


def run_stats_cli(argv: list[str]) -> int:
    """``lmdx stats ...`` (argv after ``stats``); returns the exit code."""

    claimed = Claimed()

    def body() -> int:
        if argv and argv[0] == "add":
            return _stats_add(_stats_add_parser().parse_args(argv[1:]), claimed)
        if argv and argv[0] == "show":
            return _stats_show(_stats_show_parser().parse_args(argv[1:]))
        parser = argparse.ArgumentParser(prog="lmdx")
        add_stats_parser(parser.add_subparsers(dest="command"))
        return _stats_collect(parser.parse_args(["stats", *argv]), claimed)

    return report_errors(
        "stats", body, usage=(CliError, DataError, MergeError, MissingFileError), claimed=claimed
    )


def _check_out_file(out: Path, claimed: Claimed) -> None:
    """``--out`` must not exist and its folder must; then it is the command's output."""
    if out.exists():
        raise CliError(f"--out {out}: already exists; choose a new file name")
    if not out.parent.is_dir():
        raise CliError(f"--out: the folder {out.parent} does not exist")
    claimed.claim(out)


def _stats_collect(args: argparse.Namespace, claimed: Claimed) -> int:
    # Everything that can be checked without torch and transformers is checked first (the
    # output, the model folder, the data file): a mistake is reported in well under a
    # second, not after the seconds those imports take.
    from ..data.files import read_data
    from ..data.images import is_image_data
    from ..files.peft import is_adapter_folder
    from ..files.st import sentence_transformer

    out = Path(args.out)
    _check_out_file(out, claimed)
    ray_address = _ray_options(args)
    accumulation = _accumulation(args)
    if args.max_memory is not None and (args.ray is not None or args.kind != "regmean"):
        raise CliError("--max-memory: only for --kind regmean without --ray")
    for flag, given in (("--device", args.device), ("--backend", args.backend)):
        if given is not None and (args.ray is not None or args.kind != "regmean"):
            raise CliError(f"{flag}: only for --kind regmean without --ray")
    model_dir = Path(args.model)
    adapter = model_dir if is_adapter_folder(model_dir) else None
    if adapter is not None:
        if args.base is None:
            raise CliError(f"MODEL {model_dir}: a LoRA adapter folder; give --base FOLDER")
        if args.ray is not None:
            raise CliError("--ray: not for LoRA adapters; collect without --ray")
        model_dir = Path(args.base)
    elif args.base is not None:
        raise CliError(f"--base: MODEL {model_dir} is not a LoRA adapter folder")
    st = sentence_transformer(model_dir)
    if st is not None:
        model_dir = st.transformer
    if not (model_dir / "config.json").is_file():
        raise CliError(f"MODEL {model_dir}: not a save_pretrained folder (no config.json)")
    images = is_image_data(args.data)
    if not images:
        texts, labels, source = read_data(
            args.data,
            text_field=args.text_field,
            label_field=args.label_field,
            max_texts=args.max_texts,
        )
    from transformers import AutoTokenizer

    from ..data.batches import text_batches
    from ..data.images import read_images
    from ..files.hf import load_model, model_files
    from ..files.peft import load_peft_model
    from ..stats.collect import collect_regmean_stats
    from ..stats.fisher import collect_fisher

    batches: Any
    if images:
        if args.kind == "fisher" and args.labels == "gold":
            raise CliError("--labels gold: image DATA has no labels; use --labels predicted")
        pixels = read_images(
            args.data,
            processor=_image_processor(model_dir),
            batch_size=args.batch_size,
            max_images=args.max_texts,
        )
        t0 = time.perf_counter()
        model = None if args.ray else load_model(model_dir, progress=not args.no_progress)
        if adapter is not None:
            model = load_peft_model(adapter, model)
        batches = list(pixels) if args.ray else pixels  # Ray ships the batches to workers
        items = f"{pixels.count} images"
        source = pixels.source
    else:
        max_length = args.max_length
        if st is not None:  # as sentence-transformers prepares texts for this encoder
            max_length = max_length or st.max_seq_length()
            if st.do_lower_case():
                texts = [t.lower() for t in texts]
        elif max_length is None:
            max_length = 128
        t0 = time.perf_counter()
        # with Ray the workers load the model; here only the tokenizer is needed
        model = None if args.ray else load_model(model_dir, progress=not args.no_progress)
        if adapter is not None:
            model = load_peft_model(adapter, model)
        tokens = adapter if adapter is not None and model_files(adapter) else model_dir
        tokenizer = AutoTokenizer.from_pretrained(str(tokens))
        gold = (
            _label_ids(labels, model, args.data)
            if args.kind == "fisher" and args.labels == "gold"
            else None
        )
        batches = text_batches(
            texts, tokenizer, batch_size=args.batch_size, max_length=max_length, labels=gold
        )
        items = f"{len(texts)} texts"
    common: dict[str, Any] = {
        "include": args.include,
        "exclude": args.exclude,
        "description": args.description or f"{items} from {source}",
        "progress": not args.no_progress,
    }
    regmean_options: dict[str, Any] = {
        "include_padding": args.include_padding,
        "share_inputs": not args.no_share_inputs,
        "accumulation": accumulation,
    }
    where = ""
    if args.ray:
        from ..stats.ray import collect_regmean_stats_ray

        workers, threads = args.workers or 2, args.threads_per_worker or 1
        stats = collect_regmean_stats_ray(
            model_dir,
            batches,
            address=ray_address,
            num_workers=workers,
            threads_per_worker=threads,
            **regmean_options,
            **common,
        )
        where = f" on Ray ({stats.extra['ray']['workers']} workers × {threads} threads)"
    elif args.kind == "regmean":
        stats = collect_regmean_stats(
            model,
            batches,
            n_threads=args.threads,
            out=out,
            max_memory=args.max_memory,
            max_shard_size=args.max_shard_size,
            device=args.device,
            backend=args.backend,
            **regmean_options,
            **common,
        )
    else:
        stats = collect_fisher(model, batches, labels=args.labels, **common)
    if not out.exists():
        stats.save(out, max_shard_size=args.max_shard_size)
    print(
        f"lmdx stats: {stats!r} from {items}{where} in "
        f"{time.perf_counter() - t0:.1f} s; wrote {out} ({size_of(out) / 1e6:.1f} MB)"
    )
    return 0


def _accumulation(args: argparse.Namespace) -> str:
    """``--accumulation``, or its deprecated spelling ``--float64-products`` (with a note)."""
    from ..stats.collector import ACCUMULATIONS

    if args.accumulation not in (None, *ACCUMULATIONS):
        raise CliError(
            f"--accumulation: expected one of {', '.join(ACCUMULATIONS)}, got "
            f"{printable(args.accumulation)}"
        )
    if not args.float64_products:
        return str(args.accumulation or "mixed")
    print(
        "lmdx stats: --float64-products is deprecated; write --accumulation float64",
        file=sys.stderr,
    )
    if args.accumulation not in (None, "float64"):
        raise CliError(
            f"--float64-products and --accumulation {args.accumulation} disagree; "
            "give --accumulation only"
        )
    return "float64"


def _image_processor(model_dir: Path) -> Any:
    """The image processor saved in a model folder (None where it has none)."""
    if not (model_dir / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise CliError(
            f"MODEL {model_dir}: its image processor (preprocessor_config.json) cannot be "
            f"loaded ({exc})"
        ) from None


def _ray_options(args: argparse.Namespace) -> str | None:
    """Check the Ray options; the address to pass on (None: a local Ray)."""
    if args.ray is None:
        for flag, value in (
            ("--workers", args.workers),
            ("--threads-per-worker", args.threads_per_worker),
        ):
            if value is not None:
                raise CliError(f"{flag}: only with --ray")
        return None
    if args.kind != "regmean":
        raise CliError(
            "--ray: only for --kind regmean (Fisher statistics are collected in one process); "
            "drop --ray or use --kind regmean"
        )
    if args.threads is not None:
        raise CliError("--threads: with --ray, set --threads-per-worker instead")
    for flag, value in (
        ("--workers", args.workers),
        ("--threads-per-worker", args.threads_per_worker),
    ):
        if value is not None and value < 1:
            raise CliError(f"{flag}: must be >= 1, got {value}")
    from .._ray import check_address, import_ray

    try:
        ray = import_ray()
    except ImportError as exc:
        raise CliError(f"--ray: {exc}") from None
    address = None if args.ray == "local" else str(args.ray)
    if address is not None and not ray.is_initialized():
        check_address(address)  # within seconds, before the data is read
    return address


def _stats_add(args: argparse.Namespace, claimed: Claimed) -> int:
    from ..stats.add import add_statistics
    from ..stats.file import Statistics

    out = Path(args.out)
    _check_out_file(out, claimed)
    parts = [Statistics.load(f) for f in args.files]
    total = add_statistics(parts, data=args.description)
    total.save(out, max_shard_size=args.max_shard_size)
    files = "1 file" if len(parts) == 1 else f"{len(parts)} files"
    print(f"lmdx stats add: {files} -> {out} ({total!r})")
    return 0


def _stats_show(args: argparse.Namespace) -> int:
    from ..stats.file import Statistics

    stats = Statistics.load(args.file)
    meta = stats.metadata()
    meta["format_version"] = stats.format_version  # the file's own (metadata() writes this lmdx's)
    if args.json:
        print(json.dumps(meta, indent=2))
        return 0
    model = stats.model
    print(f"file:        {printable(args.file)}")
    print(f"kind:        {stats.kind}  (format {meta['format']} v{meta['format_version']})")
    print(
        f"model:       {printable(model['architecture'])}  weights sha256 "
        f"{model['weights_sha256'][:16]}…  ({len(model['parameters'])} tensors)"
    )
    print(f"data:        {printable(stats.data)}")
    if stats.kind == "regmean-gram":
        print(f"padding:     {stats.padding}")
        print(f"accumulation: {stats.accumulation or 'not recorded'}")
        print(f"modules:     {len(stats.modules)} in {len(stats.groups)} input groups")
        for g, v in stats.groups.items():
            members = [m for m, i in stats.modules.items() if i["group"] == g]
            print(f"  {printable(g)}: dim {v['dim']}, rows {v['count']:g}, modules {len(members)}")
    else:
        print(f"examples:    {stats.count():g}  labels {printable(stats.extra.get('labels'))}")
        print(f"parameters:  {len(stats.parameters)}")
    return 0
