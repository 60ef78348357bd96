"""Ray, started, watched and reported the same way for distributed collection and merging.

Work goes to Ray as tasks (one CPU each, or ``threads_per_worker``): a task that ends
gives its CPUs back, so more workers than CPUs only queue, and the task of a lost node is
run again (once) on a node that remains. :func:`wait_ready` bounds the wait for a node
that can run it: when no live node has the CPUs a task needs for ``LMDX_RAY_WAIT``
seconds (default 60), the run stops with :class:`~lmdx._errors.RayClusterError`.

Ray is imported only when one of these is called; ``import lmdx`` never imports it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ._errors import RayClusterError

__all__ = [
    "CONNECT_TIMEOUT",
    "WAIT_ENV",
    "cancel",
    "check_address",
    "failure",
    "import_ray",
    "largest_node",
    "start_ray",
    "stop_ray",
    "wait_ready",
    "wait_seconds",
]

#: Seconds to wait for a TCP connection to a cluster's address before ``ray.init``.
CONNECT_TIMEOUT = 5.0
#: The environment variable bounding the wait for a node that can run a task (seconds).
WAIT_ENV = "LMDX_RAY_WAIT"
_DEFAULT_WAIT = 60.0
_POLL = 0.5


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "this needs the ray package: pip install 'ray>=2.9' (lmdx's ray extra; import "
            f"failed: {exc})"
        ) from exc
    return ray


def _host_port(address: str) -> tuple[str, int]:
    """The host and port a Ray address (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``) names."""
    where = address
    if address == "auto":
        where = os.environ.get("RAY_ADDRESS", "")
        if not where or where == "auto":
            current = Path("/tmp/ray/ray_current_cluster")  # written by `ray start`
            where = current.read_text().strip() if current.is_file() else ""
        if not where:
            raise RayClusterError(
                "Ray address auto: no cluster found (RAY_ADDRESS is not set and no `ray start` "
                "ran on this machine); start one with `ray start --head` or give HOST:PORT"
            )
    host, sep, port = re.sub(r"^ray://", "", where).rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayClusterError(f"Ray address {address}: expected HOST:PORT, ray://HOST:PORT or auto")
    return host, int(port)


def check_address(address: str) -> None:
    """Raise :class:`RayClusterError` within :data:`CONNECT_TIMEOUT` seconds if nothing
    accepts a TCP connection at the Ray cluster ``address`` (``ray.init`` itself would
    retry for minutes)."""
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        shown = address if address != "auto" else f"auto ({host}:{port})"
        raise RayClusterError(
            f"Ray cluster {shown}: nothing answers at {host}:{port} ({why} within "
            f"{CONNECT_TIMEOUT:g} s); start it (`ray start --head` prints the address) or "
            "check the address"
        ) from None


_HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _signals_held() -> Iterator[list[int]]:
    """Ctrl-C and SIGTERM recorded, not acted on, inside the block (main thread only): the
    list it yields gets each one that came. Handlers the block tries to install for them
    (``ray.init`` sets SIGTERM's to an exit) are not installed; the handlers in place
    before are put back at the end. Python-level, so it holds whichever thread the
    operating system delivers the signal to (a mask would not: it holds back only the
    signals sent to its own thread, and it is inherited by the processes Ray starts)."""
    received: list[int] = []
    before = {s: signal.getsignal(s) for s in _HELD}
    install = signal.signal

    def hold(signum: int, frame: Any) -> None:
        received.append(signum)

    def set_handler(signum: int, handler: Any) -> Any:
        if signum in _HELD:
            return hold  # taken back at the end anyway
        return install(signum, handler)

    for sig in _HELD:
        install(sig, hold)
    signal.signal = set_handler  # type: ignore[assignment]
    try:
        yield received
    finally:
        signal.signal = install
        for sig, handler in before.items():
            if handler is not None:
                install(sig, handler)


def start_ray(address: str | None, num_cpus: int) -> bool:
    """Start or join Ray unless ``ray.init`` was called already; True if this call did.

    ``address=None``: a new local instance with ``num_cpus`` CPUs ("local": even if
    ``RAY_ADDRESS`` or a ``ray start`` cluster says otherwise); else join that cluster,
    after :func:`check_address`.

    Ctrl-C and SIGTERM are held back while ``ray.init`` runs (an exception raised inside
    it can leave one of Ray's locks taken, and the next Ray call then waits forever), and
    the handlers in place before it stay (``ray.init`` would replace SIGTERM's with an
    exit). A signal that came meanwhile goes to them once ``ray.init`` has returned, as
    if it had come just after: a KeyboardInterrupt (Ctrl-C, or SIGTERM under ``lmdx``'s
    command line) shuts Ray down again and reaches the caller's clean-up.
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    if address is not None:
        check_address(address)
    main = threading.current_thread() is threading.main_thread()
    held: contextlib.AbstractContextManager[list[int]] = (
        _signals_held() if main else contextlib.nullcontext([])
    )
    try:
        with held as received:
            if address is None:
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
            else:
                ray.init(address=address)
        for sig in dict.fromkeys(received):
            if signal.getsignal(sig) is signal.SIG_DFL and sig != signal.SIGINT:
                ray.shutdown()  # the default action ends the process: Ray first
            signal.raise_signal(sig)  # its handler runs here
    except BaseException as exc:
        if ray.is_initialized():
            ray.shutdown()
        if isinstance(exc, SystemExit) and exc.code == signal.SIGTERM:
            # Ray's own SIGTERM handler, had it been installed all the same
            raise KeyboardInterrupt("terminated (SIGTERM)") from None
        raise
    return True


def cancel(ray: Any, refs: list[Any]) -> None:
    """Cancel the tasks behind ``refs`` (those still running are killed)."""
    for ref in refs:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # finished, lost or Ray going down: nothing left to stop
            pass


def stop_ray(ray: Any, refs: list[Any], started: bool) -> None:
    """:func:`cancel` ``refs`` and shut Ray down if this process ``started`` it."""
    cancel(ray, refs)
    if started:
        ray.shutdown()


def wait_seconds() -> float:
    """The bound on the wait for a node that can run a task: ``LMDX_RAY_WAIT`` or 60 s."""
    value = os.environ.get(WAIT_ENV, "")
    try:
        seconds = float(value) if value else _DEFAULT_WAIT
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise RayClusterError(f"{WAIT_ENV}={value!r}: expected a number of seconds > 0")
    return seconds


def largest_node(ray: Any, resource: str = "CPU") -> float:
    """The most of ``resource`` (``"CPU"``; ``"memory"``: bytes tasks may ask for) one live
    node of the cluster has."""
    return max(
        (float(n.get("Resources", {}).get(resource, 0)) for n in ray.nodes() if n.get("Alive")),
        default=0.0,
    )


def _node_fits(ray: Any, cpus: float, memory: float) -> bool:
    """Some live node has ``cpus`` CPUs and ``memory`` bytes of Ray's memory resource."""
    for node in ray.nodes():
        have = node.get("Resources", {})
        if node.get("Alive") and have.get("CPU", 0) >= cpus and have.get("memory", 0) >= memory:
            return True
    return False


def wait_ready(
    ray: Any, refs: list[Any], cpus: float, waiting: Callable[[], str], memory: float = 0.0
) -> list[Any]:
    """The ``refs`` that are ready, waiting until one is.

    Raises :class:`RayClusterError` naming ``waiting()`` (the work still out) when no live
    node of the cluster has had ``cpus`` CPUs (and ``memory`` bytes of Ray's memory
    resource) for :func:`wait_seconds` in a row: nodes were lost and none can take their
    work.
    """
    patience = wait_seconds()
    short_since: float | None = None
    needs = f"{cpus:g} CPU(s)"
    if memory:
        needs += f" and {memory / 1e9:.2f} GB" if memory >= 1e8 else f" and {memory / 1e6:.1f} MB"
        needs += " of memory"
    while True:
        done, _ = ray.wait(refs, num_returns=1, timeout=_POLL)
        if done:
            return list(done)
        if _node_fits(ray, cpus, memory):
            short_since = None
            continue
        now = time.monotonic()
        if short_since is None:
            short_since = now
        elif now - short_since >= patience:
            raise RayClusterError(
                f"{waiting()}: lost; no node of the Ray cluster has had {needs} to "
                f"run it for {patience:g} s (nodes left the cluster; {WAIT_ENV} sets this "
                "wait); nothing was written"
            )


def failure(ray: Any, exc: BaseException) -> str:
    """A worker's error in one line (Ray's messages carry remote tracebacks)."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0].split(" This can happen")[0].split(" Some common causes")[0] if lines else ""
    lost = (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)
    if isinstance(exc, lost) or isinstance(exc, ray.exceptions.RayActorError):
        return (
            "its Ray worker process or node was lost on the retry too (each task runs at "
            f"most twice){': ' + first if first else ''}"
        )
    return first or type(exc).__name__
