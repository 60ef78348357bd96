"""The public API: every exported name resolves, every lmdx error derives from LmdxError
(and keeps the built-in base users caught before), names that moved still resolve."""

from __future__ import annotations

import importlib
import inspect

import lmdx
import pytest
from lmdx import _errors


def test_every_exported_name_resolves():
    for name in lmdx.__all__:
        assert getattr(lmdx, name) is not None, name


def test_every_error_is_an_lmdx_error_and_keeps_its_builtin_base():
    errors = [
        c
        for _, c in inspect.getmembers(_errors, inspect.isclass)
        if issubclass(c, BaseException) and not issubclass(c, Warning)
    ]
    assert len(errors) >= 8
    for cls in errors:
        assert issubclass(cls, lmdx.LmdxError), cls
        if cls not in (lmdx.LmdxError, _errors.CliError):
            assert issubclass(cls, (ValueError, OSError)), cls
        assert getattr(lmdx, cls.__name__, cls) is cls


@pytest.mark.parametrize("old", sorted(lmdx._MOVED))
def test_moved_names_resolve_with_a_warning_naming_the_new_place(old: str):
    target = lmdx._MOVED[old]
    home, _, new = target.rpartition(".")
    with pytest.warns(DeprecationWarning, match=rf"lmdx\.{old} is now {target}"):
        value = getattr(lmdx, old)
    assert value is getattr(importlib.import_module(home), new)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lmdx.nope  # noqa: B018
