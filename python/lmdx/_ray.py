"""Ray, started and reported the same way for distributed collection and merging.

Ray is imported only when one of these is called; ``import lmdx`` never imports it.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["failure", "import_ray", "kill_actors", "start_ray"]


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            f"this needs the ray package: pip install 'lmdx[ray]' (import failed: {exc})"
        ) from exc
    return ray


def start_ray(address: str | None, num_cpus: int) -> bool:
    """Start or join Ray unless ``ray.init`` was called already; True if this call did.

    ``address=None``: a new local instance with ``num_cpus`` CPUs ("local": even if
    ``RAY_ADDRESS`` or a ``ray start`` cluster says otherwise); else join that cluster.
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    else:
        ray.init(address=address)
    return True


def kill_actors(ray: Any, actors: list[Any], started: bool) -> None:
    """Kill ``actors`` (no restarts) and shut Ray down if this process ``started`` it."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead or Ray going down: nothing left to stop
            pass
    if started:
        ray.shutdown()


def failure(ray: Any, exc: BaseException) -> str:
    """A worker's error in one line (Ray's messages carry remote tracebacks)."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if getattr(exc, "actor_init_failed", False) and lines:
        return f"loading the model failed: {lines[-1]}"
    if isinstance(exc, ray.exceptions.RayActorError):
        detail = next((ln for ln in lines if ln.startswith("The actor is dead because")), "")
        detail = detail.split(" Some common causes")[0]
        return (
            "the worker process died again after its restart (each worker is restarted once "
            f"and its shard recomputed){': ' + detail if detail else ''}"
        )
    return lines[0] if lines else type(exc).__name__
