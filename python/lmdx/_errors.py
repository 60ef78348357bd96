"""Exception and warning classes (a leaf module: the native core imports it by name)."""

from __future__ import annotations

__all__ = ["NotPositiveDefiniteError", "RegularizationWarning"]


class NotPositiveDefiniteError(ValueError):
    """A system could not be factored: not positive definite and regularization forbidden
    or exhausted. The message names the system (e.g. the layer) and the failing pivot."""


class RegularizationWarning(UserWarning):
    """The solver had to raise the ridge above the requested one to factor a system."""
