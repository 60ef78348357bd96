"""``model_stock`` (Model Stock, Jang et al., ECCV 2024, arXiv 2403.19522): the average of
the fine-tuned models pulled toward the pre-trained one by a ratio the angle between their
task vectors sets, tensor by tensor (layer-wise, as the paper). No options.

Per tensor, with the task vectors ``τ_i = θ_i − θ_0`` taken as flat vectors, ``cos θ`` the
mean of the pairwise cosines ``⟨τ_i, τ_j⟩ / (‖τ_i‖ ‖τ_j‖)`` over the pairs ``i < j`` (a
pair with a zero task vector counts 0; the paper assumes one angle between every pair,
mergekit and FusionBench average the pairs' cosines) and K models::

    t = K cos θ / (1 + (K − 1) cos θ),      merged = t · θ̄ + (1 − t) · θ_0

where ``θ̄`` is the (coefficient-weighted) average of the models; models with coefficient 0
take no part (one model left: ``t = 1``). Identical fine-tuned
models give ``t = 1`` (their average), orthogonal task vectors ``t = 0`` (the base). A
tensor whose cosine is at or below ``−1/(K − 1)`` has no ratio: an error names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from ..._errors import MergeError
from ..._tensors import as_float64
from ..method import MergeInputs, NoOptions, Step, StepSizes, checked_input
from .task_vectors import TaskVectorMethod

__all__ = ["ModelStock", "model_stock_ratio"]


def model_stock_ratio(name: str, taus: Sequence[NDArray[np.float64]]) -> float:
    """Model Stock's interpolation ratio ``t`` of tensor ``name`` from its task vectors
    (see the module's description)."""
    k = len(taus)
    flat = [t.reshape(-1) for t in taus]
    norms = [float(np.linalg.norm(f)) for f in flat]
    cosines = []
    for i in range(k):
        for j in range(i + 1, k):
            denominator = norms[i] * norms[j]
            cos = float(np.dot(flat[i], flat[j])) / denominator if denominator > 0 else 0.0
            cosines.append(min(1.0, max(-1.0, cos)))
    cos = float(np.mean(cosines))
    denominator = 1.0 + (k - 1) * cos
    if denominator <= 0:
        raise MergeError(
            f"tensor {name!r}: the task vectors' mean pairwise cosine {cos:.3g} is at or below "
            f"−1/(K − 1) = {-1 / (k - 1):.3g}, where Model Stock's ratio is undefined; merge "
            "it with another method"
        )
    return k * cos / denominator


class ModelStock(TaskVectorMethod):
    name: ClassVar[str] = "model_stock"
    summary: ClassVar[str] = (
        "Model Stock (Jang et al., 2024): per tensor the average of the models, pulled toward "
        "the base by the ratio K cos θ / (1 + (K − 1) cos θ) of their task vectors' angle"
    )
    options: ClassVar[type[NoOptions]] = NoOptions

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        assert inputs.base is not None
        theta0 = as_float64(checked_input(name, "the base", inputs.base.read(name)), name)
        coef = inputs.options.coefficients or (1.0,) * len(tensors)
        used = [(c, as_float64(x, name)) for c, x in zip(coef, tensors, strict=True) if c > 0]
        mean = np.zeros_like(theta0)
        for c, x in used:
            mean += (c / sum(coef)) * x
        t = model_stock_ratio(name, [x - theta0 for _, x in used]) if len(used) > 1 else 1.0
        out: NDArray[np.float64] = t * mean + (1.0 - t) * theta0
        return out

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """The reads, ``θ_0``, the K models and K task vectors in float64, the mean."""
        return (sizes.k + 1) * (sizes.read + sizes.widened) + 8 * sizes.n * (2 * sizes.k + 3)
