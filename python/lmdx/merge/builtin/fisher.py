"""``fisher``: Fisher-weighted averaging (Matena & Raffel, 2022), ``Σ c_i (F_i+ε) θ_i /
Σ c_i (F_i+ε)`` per parameter, with ``F_i`` the mean squared gradients from
:func:`lmdx.collect_fisher`; the parameters the statistics do not cover are averaged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ...average import fisher_average
from ...stats.file import Statistics
from ..method import Merged, MergeInputs, MergeMethod, NoOptions, Step, StepSizes, on_tensor
from .average import AVERAGE

__all__ = ["Fisher", "FisherOptions", "fisher_tensor"]


class FisherOptions(NoOptions):
    """Fisher averaging's option."""

    fisher_eps: Annotated[
        float,
        Field(
            ge=0.0,
            description="ε added to every Fisher value",
            json_schema_extra={"label": "must be a number >= 0", "elsewhere": "ignored"},
        ),
    ] = 1e-8


def fisher_tensor(
    name: str,
    tensors: Sequence[Any],
    stats: Sequence[Statistics],
    coefficients: Sequence[float] | None,
    eps: float,
    n_threads: int | None,
) -> NDArray[np.float64]:
    """One parameter's Fisher-weighted average, the Fisher sums divided by the counts."""
    fishers = [s.fisher(name) / max(s.count(), 1.0) for s in stats]
    return on_tensor(
        name, fisher_average, tensors, fishers, coefficients, eps=eps, n_threads=n_threads
    )


class Fisher(MergeMethod):
    """``Σ c_i (F_i+ε) θ_i / Σ c_i (F_i+ε)`` for the parameters the Fisher statistics
    cover (``F_i``: their mean squared gradients); the others are averaged."""

    name: ClassVar[str] = "fisher"
    summary: ClassVar[str] = "Fisher-weighted averaging (Matena & Raffel, 2022)"
    options: ClassVar[type[NoOptions]] = FisherOptions
    stats: ClassVar[str | None] = "fisher"

    def tensor_method(self, inputs: MergeInputs, name: str) -> MergeMethod:
        assert inputs.stats is not None
        return self if name in inputs.stats[0].parameters else AVERAGE

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        assert inputs.stats is not None
        options = inputs.options
        return fisher_tensor(
            name,
            tensors,
            inputs.stats,
            options.coefficients,
            options.own(FisherOptions).fisher_eps,
            options.threads,
        )

    def compute(self, step: Step, inputs: MergeInputs) -> Merged:
        """The tensor, and its name in the report's ``fisher_weighted``."""
        merged = super().compute(step, inputs)
        merged.report["fisher_weighted"] = [step.tensors[0]]
        return merged

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """The average's estimate plus the K Fisher tensors and their weights."""
        return super().memory(step, sizes, inputs) + 2 * sizes.k * 8 * sizes.n
