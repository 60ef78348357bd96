"""The documentation site as a reader gets it: built once here with the project's
mkdocs.yml in strict mode (a warning fails the build, as in .ci/run), then read as HTML.

* no Sphinx role is left raw (``:func:`merge_models```): they are links to the API
  reference (docs/hooks/sphinx_roles.py), or plain code where the site does not document
  the object;
* a parameter's type in the API reference is its annotation in the signature;
* the API page's table of contents names ``lmdx`` once;
* the command line reference fits its 100 columns;
* a link to an anchor that does not exist fails the strict build;
* nothing is loaded from another host: code is highlighted by Pygments when the site is
  built, with a style sheet of the site's own.
"""

from __future__ import annotations

import copy
import html
import os
import re
from collections.abc import Iterator
from pathlib import Path

import griffe
import pytest
from doc_blocks import ROOT

mkdocs_build = pytest.importorskip("mkdocs.commands.build")
from mkdocs.config import load_config  # noqa: E402
from mkdocs.exceptions import Abort  # noqa: E402
from mkdocs.utils import yaml_load  # noqa: E402

#: A Sphinx role as it would show in HTML: ``:func:<code>x</code>`` or ``:func:`x```.
RAW_ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const):(?:<code>|`)")


def _build(config_file: Path, site: Path, **overrides: object) -> None:
    """``mkdocs build --strict`` of ``config_file`` into ``site``, from the config's folder
    (its relative paths: hooks, griffe extensions, the package's source)."""
    before = Path.cwd()
    os.chdir(config_file.parent)
    try:
        cfg = load_config(str(config_file), site_dir=str(site), strict=True, **overrides)
        mkdocs_build.build(cfg)
    finally:
        os.chdir(before)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    _build(ROOT / "mkdocs.yml", out)
    return out


def _pages(site: Path) -> Iterator[tuple[Path, str]]:
    for page in sorted(site.rglob("*.html")):
        yield page, page.read_text(encoding="utf-8")


def test_no_raw_sphinx_role_and_the_roles_are_links(site: Path) -> None:
    raw = [
        f"{page.relative_to(site)}: {text[m.start() - 40 : m.end() + 40]!r}"
        for page, text in _pages(site)
        for m in RAW_ROLE.finditer(text)
    ]
    assert not raw, "\n".join(raw[:20])
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    # a relative :func: of lmdx.stats.file (save_merged is lmdx.merge's) and a full path
    for shown, href in (
        ("save_merged()", "#lmdx.save_merged"),
        ("lmdx.stats.collect.collect_regmean_stats()", "#lmdx.collect_regmean_stats"),
        ("Moments", "#lmdx.Moments"),
    ):
        link = rf'<a class="autorefs autorefs-internal"[^>]* href="{re.escape(href)}"'
        assert re.search(rf"{link}[^>]*><code>{re.escape(shown)}</code></a>", api), shown


def test_reference_pages_show_no_raw_literals(site: Path) -> None:
    """Docstrings and help are rendered, not shown as written: no double backquotes (a
    numpydoc section that took prose for a type or a name shows them raw) and no
    reStructuredText literal-block markers on the command line and API pages."""
    for page in ("cli", "api"):
        text = (site / "reference" / page / "index.html").read_text(encoding="utf-8")
        raw = [text[m.start() - 60 : m.end() + 40] for m in re.finditer(r"``|::\s*\n", text)]
        assert not raw, (page, raw[:5])


def _public_objects() -> Iterator[griffe.Object]:
    """What the API reference documents: the names of ``__all__`` of lmdx and of its
    subpackages, with the public methods of classes."""
    pkg = griffe.load("lmdx", search_paths=[str(ROOT / "python")], resolve_aliases=True)
    for module in (pkg, *(pkg[m] for m in ("stats", "merge", "lmd", "files", "data"))):
        for name in module.exports or ():
            obj = module[str(name)]
            obj = obj.final_target if obj.is_alias else obj
            yield obj
            if obj.is_class:
                yield from (
                    m
                    for m in obj.members.values()
                    if not m.is_alias and m.is_function and not m.name.startswith("_")
                )


def test_documented_parameter_types_are_the_signatures() -> None:
    """A numpydoc entry ``a, b`` gives both names one type and default (the first's): so
    parameters of different types get an entry each."""
    wrong, checked = [], 0
    for obj in _public_objects():
        params = getattr(obj, "parameters", None)
        if obj.docstring is None or params is None:
            continue
        for section in obj.docstring.parse("numpy"):
            if section.kind is not griffe.DocstringSectionKind.parameters:
                continue
            for entry in section.value:
                if entry.name not in params:
                    continue
                sig = params[entry.name]
                checked += 1
                if sig.annotation is not None and str(entry.annotation) != str(sig.annotation):
                    wrong.append(
                        f"{obj.path}({entry.name}): {entry.annotation} vs {sig.annotation}"
                    )
                if str(entry.value) != str(sig.default):
                    wrong.append(
                        f"{obj.path}({entry.name}): default {entry.value} vs {sig.default}"
                    )
    assert checked > 100
    assert not wrong, "\n".join(wrong)


def test_decomposition_dims_are_ints_and_lmdx_is_in_the_contents_once(site: Path) -> None:
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    start = api.index('id="lmdx.Decomposition"')
    table = re.sub(r"<[^>]+>", " ", api[start : api.index("</table>", start)])
    row = re.search(r"\bdims\s+(.*?)\s+Their embedding sizes", " ".join(table.split()))
    assert row and row.group(1).replace(" ", "") == "Sequence[int]", row
    contents = api[api.index("bs-sidebar") : api.index('role="main"')]
    entries = re.findall(r'class="nav-link">([^<]*)</a>', contents)
    assert entries.count("lmdx") == 1, entries[:5]
    assert "Decomposition" in entries


def test_command_line_reference_fits_its_width(site: Path) -> None:
    page = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    blocks = re.findall(r"<pre[^>]*>(.*?)</pre>", page, flags=re.S)
    assert len(blocks) >= 6  # lmdx, info, stats (+ add, show), merge, decompose
    lines = [html.unescape(re.sub(r"<[^>]+>", "", ln)) for b in blocks for ln in b.splitlines()]
    long = [ln for ln in lines if len(ln) > 100]
    assert not long, "\n".join(long)
    assert any("lmdx stats finetuned/bbc train.jsonl --kind fisher" in ln for ln in lines)


def test_a_dead_anchor_fails_the_strict_build(tmp_path: Path) -> None:
    """The project's link checks (``validation``) and heading anchors (``toc``, GitHub's
    slugs), on a two-page site whose link's anchor exists or not."""
    project = yaml_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "mkdocs.yml").write_text("site_name: anchors\n", encoding="utf-8")
    (docs / "other.md").write_text("# Other\n\n## SPD solve A x = B (float64, k = d)\n")
    keys = ("validation", "markdown_extensions")

    def build(site: str) -> None:  # mkdocs consumes the settings it is given: a copy each
        overrides = {k: copy.deepcopy(project[k]) for k in keys}
        _build(tmp_path / "mkdocs.yml", tmp_path / site, docs_dir=str(docs), **overrides)

    (docs / "index.md").write_text("[there](other.md#spd-solve-a-x--b-float64-k--d)\n")
    build("good")
    (docs / "index.md").write_text("[there](other.md#spd-solve-a-x-b-float64-k-d)\n")
    with pytest.raises(Abort):
        build("bad")


def test_nothing_is_loaded_from_another_host_and_code_is_highlighted(site: Path) -> None:
    external = re.compile(r"<(?:script|link|img)\b[^>]*(?:src|href)=\"(?:https?:)?//", re.I)
    loaded = [str(page.relative_to(site)) for page, text in _pages(site) if external.search(text)]
    assert not loaded
    install = (site / "install" / "index.html").read_text(encoding="utf-8")
    assert 'href="../css/pygments.css"' in install
    assert re.search(r'<div class="highlight"><pre>.*<span class="', install, flags=re.S)
    assert ".highlight .k " in (site / "css" / "pygments.css").read_text(encoding="utf-8")
