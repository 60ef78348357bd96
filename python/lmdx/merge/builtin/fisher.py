"""``fisher``: Fisher-weighted averaging (Matena & Raffel, 2022)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ..methods import fisher_tensor
from ..registry import MergeMethod, NoOptions

if TYPE_CHECKING:
    from ..engine import Executor
    from ..inputs import MergeInputs
    from ..plan import Step, StepSizes

__all__ = ["Fisher", "FisherOptions"]


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


class Fisher(MergeMethod):
    """``Σ c_i (F_i+ε) θ_i / Σ c_i (F_i+ε)`` for the parameters the Fisher statistics
    cover (``F_i``: their mean squared gradients); the others are averaged."""

    name: ClassVar[str] = "fisher"
    summary: ClassVar[str] = "Fisher-weighted averaging (Matena & Raffel, 2022)"
    options: ClassVar[type[NoOptions]] = FisherOptions
    stats: ClassVar[str | None] = "fisher"

    def tensor_kind(self, inputs: MergeInputs, name: str) -> str:
        assert inputs.stats is not None
        return self.name if name in inputs.stats[0].parameters else "average"

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        assert inputs.stats is not None
        return fisher_tensor(name, tensors, inputs.stats, inputs.options)

    def compute(self, step: Step, executor: Executor) -> None:
        executor.report.setdefault("fisher_weighted", []).append(step.tensors[0])
        super().compute(step, executor)

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """The average's estimate plus the K Fisher tensors and their weights."""
        return super().memory(step, sizes, inputs) + 2 * sizes.k * 8 * sizes.n
