"""Ending a forward pass early, once the hooks have what they need: the one mechanism of
lmdx for it (statistics passes that end after their last module, RegMean++ capturing a
block's inputs).

A forward hook calls :func:`stop_forward`; :func:`run_until_stopped` runs a forward pass
and takes that as the pass's end (the exception it raises is control flow between the
two and never reaches a caller). :func:`stop_before` is the common hook: it ends the pass
as a given module is about to run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

__all__ = ["run_until_stopped", "stop_before", "stop_forward"]


class _StopForward(Exception):
    """Raised by :func:`stop_forward`, caught by :func:`run_until_stopped`."""


def stop_forward() -> NoReturn:
    """End the forward pass the calling hook runs in (inside :func:`run_until_stopped`)."""
    raise _StopForward


def run_until_stopped(forward: Callable[[], Any]) -> bool:
    """Run ``forward()`` (a forward pass) to its end or until a hook calls
    :func:`stop_forward`; whether a hook stopped it."""
    try:
        forward()
    except _StopForward:
        return True
    return False


@contextlib.contextmanager
def stop_before(module: Any | None) -> Iterator[None]:
    """While inside, a forward pass ends as ``module`` is about to run (a forward pre-hook
    calling :func:`stop_forward`); ``None``: passes run to their end."""
    if module is None:
        yield
        return

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        stop_forward()

    handle = module.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
