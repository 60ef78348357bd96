"""Ending a forward pass early, once the hooks have what they need: the one mechanism of
lmdx for it (statistics passes that end after their last module, RegMean++ capturing a
block's inputs).

A forward hook raises :class:`StopForward`; :func:`run_until_stopped` runs a forward pass
and takes it as the pass's end. :func:`stop_before` is the common hook: it ends the pass
as a given module is about to run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["StopForward", "run_until_stopped", "stop_before"]


class StopForward(Exception):
    """Raised by a forward hook to end the forward pass it runs in (caught by
    :func:`run_until_stopped`)."""


def run_until_stopped(forward: Callable[[], Any]) -> bool:
    """Run ``forward()`` (a forward pass) to its end or until a hook raises
    :class:`StopForward`; whether a hook stopped it."""
    try:
        forward()
    except StopForward:
        return True
    return False


@contextlib.contextmanager
def stop_before(module: Any | None) -> Iterator[None]:
    """While inside, a forward pass ends as ``module`` is about to run (a forward pre-hook
    raising :class:`StopForward`); ``None``: passes run to their end."""
    if module is None:
        yield
        return

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        raise StopForward

    handle = module.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
