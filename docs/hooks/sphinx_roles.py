"""A griffe extension (mkdocs.yml: mkdocstrings' ``extensions``): the Sphinx cross-reference
roles in lmdx's docstrings (``:func:`merge_models```, ``:class:`~lmdx.Moments```, ...)
become links of the site's API reference when it is built.

Each role becomes an mkdocs-autorefs reference to the object's full path: names written
relative to the docstring (``:meth:`fit```) are resolved in its object's scope, as Sphinx
resolves them; ``~`` shows the last part of the path only; functions and methods are shown
with ``()``. The reference is optional: it is a link where the site documents the object
and plain code where it does not (a private module's helper), as mkdocstrings does with
the names in signatures. ``tests/docs/test_site.py`` fails on any role left in the site.
"""

from __future__ import annotations

import re
from functools import partial
from html import escape
from typing import Any

import griffe

#: ``:role:`target``` or ``:py:role:`~target```.
ROLE = re.compile(
    r":(?:py:)?(?P<role>mod|class|func|meth|attr|data|exc|obj|const):`(?P<target>~?\.?[\w.]+)`"
)


def _full_path(obj: griffe.Object, target: str) -> str:
    """``target`` as the full path of the object it names, seen from ``obj``'s scope."""
    head, _, rest = target.lstrip(".").partition(".")
    for scope in (obj, obj.parent):
        if scope is None:
            continue
        try:
            base = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError):
            continue
        return f"{base}.{rest}" if rest else base
    return target.lstrip(".")


def _link(obj: griffe.Object, match: re.Match[str]) -> str:
    target = match["target"]
    short = target.startswith("~")
    target = target.removeprefix("~")
    shown = target.lstrip(".").rsplit(".", 1)[-1] if short else target.lstrip(".")
    if match["role"] in ("func", "meth"):
        shown += "()"
    path = escape(_full_path(obj, target), quote=True)
    return f'<autoref identifier="{path}" optional><code>{escape(shown)}</code></autoref>'


def _objects(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and every object defined under it (aliases are documented where they point)."""
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found += _objects(member)  # type: ignore[arg-type]
    return found


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring of the package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = ROLE.sub(partial(_link, obj), obj.docstring.value)
