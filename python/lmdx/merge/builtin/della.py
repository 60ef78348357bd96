"""``della`` and ``della_linear`` (DELLA-Merging, Deep et al., 2024, arXiv 2406.11617):
each task vector's entries dropped at random with probabilities ranked by magnitude
(MAGPRUNE), the survivors rescaled, then TIES's sign election and mean (``della``) or task
arithmetic (``della_linear``).

Per tensor and model, row by row (a tensor of two or more dimensions has ``shape[0]`` rows
of its other entries; a vector is one row; mergekit ranks within rows as well): the ``n``
entries of a row are ranked by ``|τ_i|`` from 0 (smallest) to ``n − 1`` (largest; equal
magnitudes lowest index first), and entry ``j`` is kept with probability

    p_j = density − ε + 2ε · rank_j / (n − 1)        (p = density for a row of one entry)

so keep probabilities run from ``density − ε`` to ``density + ε``, larger entries kept more
often. A kept entry is divided by its own ``p_j`` (the paper's rescaling, so that each
entry keeps its expected value; mergekit instead rescales a task vector to its L1 norm).
The draws are DARE's (:func:`lmdx.merge.builtin.task_vectors.random_draws`: PCG64 seeded
by the seed, the model's index and the tensor's name; kept where the draw is ``< p_j``).
Then ``della``: ``θ_0 + λ × (mean of the agreeing c_i τ̂_i)`` after TIES's sign election;
``della_linear``: ``θ_0 + λ Σ c_i τ̂_i``.

Defaults: density 0.5 (lmdx's DARE), ε 0.15 (mergekit's), λ 1 for ``della`` (a mean, as
TIES) and 0.3 for ``della_linear`` (lmdx's task arithmetic); ``density ± ε`` must lie in
(0, 1].
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import Field, model_validator

from ..method import MergeInputs, NoOptions
from .task_vectors import SCALING, Sparsifier, TaskVectorMethod, random_draws

__all__ = ["Della", "DellaLinear", "DellaLinearOptions", "DellaOptions", "magprune"]

_DENSITY = Field(
    gt=0.0,
    le=1.0,
    description="the mean probability of keeping each task-vector entry",
    json_schema_extra={"label": "must be in (0, 1] (the mean probability of keeping an entry)"},
)
_EPSILON = Field(
    ge=0.0,
    lt=1.0,
    description="keep probabilities run from density − epsilon (smallest entry of a row) to "
    "density + epsilon (largest)",
    json_schema_extra={"label": "must be in [0, 1)"},
)
_SEED = Field(
    ge=0,
    description="the seed of the random drops: the same seed gives the same bits, in memory "
    "or streaming, on any thread count",
    json_schema_extra={"label": "must be a whole number >= 0"},
)


class DellaOptions(NoOptions):
    """DELLA: density 0.5, ε 0.15, λ 1."""

    scaling: Annotated[float, SCALING] = 1.0
    density: Annotated[float, _DENSITY] = 0.5
    epsilon: Annotated[float, _EPSILON] = 0.15
    seed: Annotated[int, _SEED] = 0

    @model_validator(mode="after")
    def _probabilities(self) -> DellaOptions:
        if not (0.0 < self.density - self.epsilon and self.density + self.epsilon <= 1.0):
            raise ValueError(
                f"density ± epsilon must lie in (0, 1] (keep probabilities), got density "
                f"{self.density:g} and epsilon {self.epsilon:g}"
            )
        return self


class DellaLinearOptions(DellaOptions):
    """DELLA without the sign election: λ 0.3."""

    scaling: Annotated[float, SCALING] = 0.3


def magprune(
    name: str, model: int, tau: NDArray[np.float64], density: float, epsilon: float, seed: int
) -> NDArray[np.float64]:
    """Model ``model``'s task vector ``tau`` of tensor ``name`` after MAGPRUNE: entries kept
    with their rank's probability and divided by it (see the module's description); a
    new array."""
    if tau.size == 0:  # nothing to prune (a tensor with zero rows or columns)
        return tau.copy()
    rows = tau.reshape(tau.shape[0] if tau.ndim >= 2 else 1, -1)
    n = rows.shape[1]
    if n > 1:
        # |τ| as the integers of its bits: they sort as the floats do (finite, >= 0), and
        # a stable integer sort is quicker than a stable float one.
        order = np.argsort(np.abs(rows).view(np.int64), axis=1, kind="stable")
        rank = np.empty(rows.shape, dtype=np.float64)
        np.put_along_axis(rank, order, np.arange(n, dtype=np.float64)[None, :], axis=1)
        rank *= 2.0 * epsilon / (n - 1)
        rank += density - epsilon
        keep_probability = rank
    else:
        keep_probability = np.full(rows.shape, density)
    draws = random_draws(name, model, rows.shape, seed)
    out = np.where(draws < keep_probability, rows / keep_probability, 0.0)
    return out.reshape(tau.shape)


class Della(TaskVectorMethod):
    name: ClassVar[str] = "della"
    summary: ClassVar[str] = (
        "DELLA-Merging (Deep et al., 2024): task-vector entries dropped with probabilities "
        "ranked by magnitude and rescaled, then TIES's sign election and mean"
    )
    options: ClassVar[type[NoOptions]] = DellaOptions
    headline: ClassVar[tuple[str, ...]] = ("density", "epsilon", "scaling", "seed")
    elects: ClassVar[bool] = True

    def sparsifier(self, name: str, inputs: MergeInputs) -> Sparsifier | None:
        own = inputs.options.own(DellaOptions)
        return lambda i, tau: magprune(name, i, tau, own.density, own.epsilon, own.seed)


class DellaLinear(Della):
    name: ClassVar[str] = "della_linear"
    summary: ClassVar[str] = (
        "DELLA's magnitude-ranked drops and rescaling, then task arithmetic (no sign election)"
    )
    options: ClassVar[type[NoOptions]] = DellaLinearOptions
    elects: ClassVar[bool] = False
