"""``lmdx methods [NAME]``: the merge methods, what each needs and its options, from the
registry (built-in, installed and post-steps alike); one method with an example config."""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

from .._errors import CliError, MergeError
from .._util import did_you_mean
from .common import HelpFormatter, report_errors

__all__ = ["HELP", "add_methods_parser", "methods_text", "run_methods"]

#: The command's line in ``lmdx --help``.
HELP = "the merge methods, what each needs and its options (one: lmdx methods NAME)"
#: Width of the listing (the help's own width does not apply to plain output).
WIDTH = 88


def add_methods_parser(sub: Any) -> None:
    p = sub.add_parser(
        "methods",
        help=HELP,
        description="Every merge method a config's `method:` can name (built-in, installed "
        "as a package, and the post-steps any method can be followed by), what each needs "
        "and its options with their defaults; with NAME, that method alone and an example "
        "config to start from.",
        epilog="examples:\n  lmdx methods\n  lmdx methods ties\n  lmdx methods svc",
        formatter_class=HelpFormatter,
    )
    p.add_argument("name", nargs="?", metavar="NAME", help="one method or post-step")


def run_methods(args: argparse.Namespace) -> int:
    """``lmdx methods [NAME]``; returns the exit code."""

    def body() -> int:
        print(methods_text(args.name))
        return 0

    return report_errors("methods", body, usage=(CliError, MergeError))


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def _options(model: Any, indent: str = "      ") -> list[str]:
    """One entry per option of a method's (or post-step's) pydantic ``model``."""
    lines = []
    for key, f in model.model_fields.items():
        default = "none" if f.default is None else f.default
        lines += _wrapped(f"{key} (default {default}): {f.description or ''}", indent)
    return lines


def _needs(method: Any, indent: str = "      ") -> list[str]:
    needs = [
        *([f"{method.stats} statistics per model (models[].stats)"] if method.stats else []),
        *(["base: the pre-trained model folder"] if method.needs_base else []),
        *(["data per model (models[].data)"] if method.takes_data else []),
    ]
    return _wrapped(f"needs: {', '.join(needs)}", indent) if needs else []


def _shared() -> list[str]:
    """The options every merge takes, from their one definition."""
    from ..merge.options import SharedOptions

    lines = ["options every method takes (top-level keys; lmdx merge has flags for some):"]
    for path, f in SharedOptions.fields().items():
        default = "none" if f.default is None else f.default
        if isinstance(default, list | tuple):
            default = json.dumps(list(default))
        lines += _wrapped(f"{'.'.join(path)} (default {default}): {f.description or ''}", "  ")
    return lines


def _yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):  # YAML 1.1 reads 1e-08 as a string, 1.0e-08 as a number
        mantissa, e, exponent = repr(value).partition("e")
        return f"{mantissa}{'' if '.' in mantissa else '.0'}{e}{exponent}" if e else repr(value)
    if isinstance(value, list | tuple | dict):
        return json.dumps(value)
    return str(value)


def _example(method: Any) -> list[str]:
    """A config to start from: the method, its inputs and every option at its default."""

    def model(task: str) -> str:
        if method.stats:
            return f"{{path: finetuned/{task}, stats: {task}.safetensors}}"
        if method.takes_data:
            return f"{{path: finetuned/{task}, data: {task}-train.jsonl}}"
        return f"finetuned/{task}"

    lines = [f"method: {method.name}"]
    if method.needs_base:
        lines.append("base: pretrained            # the checkpoint the models were tuned from")
    lines += ["models:", *(f"  - {model(t)}" for t in ("bbc", "reuters"))]
    lines += [
        f"{key}: {_yaml_value(f.default)}"
        for key, f in method.options.model_fields.items()
        if f.default is not None
    ]
    lines.append('heads: {patterns: ["classifier.*"], policy: keep}')
    return ["example config (merge.yaml; then lmdx merge merge.yaml --out merged):"] + [
        f"  {line}" for line in lines
    ]


def methods_text(name: str | None = None) -> str:
    """What ``lmdx methods [NAME]`` prints: every registered method with its line, what it
    needs and its options, the installed methods that could not be loaded (with why), the
    post-steps and the options every merge shares; or, with ``name``, that method (or
    post-step) alone with an example config."""
    from ..merge.registry import methods, post_steps, unloaded_methods

    registered, posts, unloaded = methods(), post_steps(), unloaded_methods()
    if name is not None:
        if name in registered:
            method = registered[name]
            return "\n".join(
                [
                    *_wrapped(f"{name}: {method.summary}", ""),
                    *_needs(method, ""),
                    *(
                        ["options (top-level keys):", *_options(method.options, "  ")]
                        if method.options.model_fields
                        else ["options: none of its own"]
                    ),
                    "",
                    *_example(method),
                ]
            )
        post = name.lstrip("+")
        if post in posts:
            step = posts[post]
            return "\n".join(
                [
                    *_wrapped(f"+{post}: {step.summary}", ""),
                    f"after any method: method: NAME+{post} (e.g. ties+{post})",
                    "options (top-level keys):",
                    *_options(step.options, "  "),
                ]
            )
        if name in unloaded:
            raise CliError(f"method {name!r}: not loaded: {unloaded[name]}")
        known = [*registered, *posts]
        raise CliError(
            f"no merge method {name!r}{did_you_mean(name, known)} (lmdx methods lists them)"
        )
    lines = ["methods (method: NAME in the config; lmdx methods NAME: one, with an example):"]
    for key, method in registered.items():
        lines += _wrapped(f"{key}: {method.summary}", "  ")
        lines += _needs(method)
        lines += _options(method.options)
    for key, why in unloaded.items():
        lines += _wrapped(f"{key}: not loaded: {why}", "  ")
    lines.append("post-steps any method can be followed by (method: NAME+POST, e.g. ties+svc):")
    for key, post in posts.items():
        lines += _wrapped(f"+{key}: {post.summary}", "  ")
        lines += _options(post.options)
    return "\n".join([*lines, *_shared()])
