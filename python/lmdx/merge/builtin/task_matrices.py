"""What the methods on task matrices share (TSV-M, ISO-C, ISO-CTS, WUDI, and SVC's
post-step): which tensors are task matrices, each model's task matrix read in the
``[out, in]`` orientation, the polar factor, and the rule for every other tensor.

A **task matrix** is ``c_i τ_i = c_i (θ_i − θ_0)`` of a two-dimensional floating-point
tensor that the base has and that no ``exclude`` pattern names (the tensor's name or its
module's, the name without its last part): linear layers' weights, and embedding tables
(FusionBench's rule: every 2-D parameter). Models with ``c_i = 0`` take no part. A
Hugging Face ``Conv1D`` weight (GPT-2) is stored ``[in, out]``; the methods whose result
depends on the orientation (ISO-CTS, WUDI, SVC) read it transposed, as found from the
models' class built without weights (:func:`conv1d_weights`); a model without a
configuration (a state dict) has its 2-D tensors read as stored, ``[out, in]`` as
``torch.nn.Linear`` stores them.

Every other tensor of the body (biases, norms, any tensor of three or more dimensions) is
``θ_0 + λ × Σ c_i τ_i / Σ c_i``: the coefficient-weighted mean of the task vectors, scaled
as the matrices are (FusionBench's TSV-M and ISO: the mean, then ``× α``).

A task matrix that no model changed (every ``τ_i`` zero: a layer frozen in fine-tuning,
such as the embeddings) stays at the base without an SVD: every method's update of zero
task matrices is zero.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ..._errors import MergeError
from ..._tensors import as_float64
from ..._util import matches
from ...files.hf import may_hold_conv1d
from ...stats.sites import find_linear_modules
from ..method import MergeInputs, Step, StepSizes, checked_input
from ..skeleton import build_skeleton
from ..source import TensorSource
from .task_vectors import TaskVectorMethod, finite_task_vector

__all__ = [
    "FAST_PATH_BOUND",
    "GRAM_EPS",
    "GRAM_PRECISION",
    "GRAM_SMALL_LIMIT",
    "MATRIX_SCALING",
    "GramPolar",
    "GramTriplets",
    "Precision",
    "TaskMatrices",
    "TaskMatrixMethod",
    "conv1d_weights",
    "factorization_of",
    "gram_polar",
    "gram_triplets",
    "is_task_matrix",
    "polar",
    "task_matrices",
]


#: The field of α, the scaling of a merged task matrix (and of the other tensors' mean task
#: vector).
MATRIX_SCALING = Field(
    description="α: θ_base + α × (the merged task matrix; other tensors: the mean task vector)"
)

#: The relative Frobenius bound of a factoring method's default (``precision: auto``, Gram
#: eigendecompositions) merged update against its float64 SVD definition (``precision:
#: float64``): TSV-M's, ISO-C's and ISO-CTS's contract.
FAST_PATH_BOUND = 1e-6
#: The smallest kept singular value, of the largest, the Gram paths take.
GRAM_SMALL_LIMIT = 1e-4
#: A factoring method's ``precision`` option: ``auto`` (the Gram path, checked) or
#: ``float64`` (the SVDs).
Precision = Literal["auto", "float64"]
GRAM_PRECISION = Field(
    description="auto: float64 eigendecompositions of Grams, within a relative "
    "Frobenius 1e-6 of the SVDs (a tensor falls back to them where an a-posteriori "
    "estimate does not assure it); float64: the SVDs, as before",
    json_schema_extra={"label": "must be auto or float64"},
)


@contextlib.contextmanager
def factorization_of(name: str, method: str) -> Iterator[None]:
    """Within the block, LAPACK's refusal to factor tensor ``name``'s matrices (an SVD that
    does not converge, on finite inputs: non-finite ones are refused before) is one
    :class:`MergeError` naming the tensor and the method, not NumPy's LinAlgError."""
    try:
        yield
    except np.linalg.LinAlgError as exc:
        raise MergeError(
            f"tensor {name!r}: {method}: the factorization of its task matrices failed "
            f"({exc}); exclude it (exclude: [...]) to merge it by its mean task vector"
        ) from None


def conv1d_weights(source: TensorSource) -> frozenset[str]:
    """The tensors of ``source`` stored ``[in, out]``: the weights of its Hugging Face
    ``Conv1D`` layers, from its class built without weights; none for a model without a
    configuration (a state dict)."""
    config = getattr(source, "config", None) or {}
    if not config.get("architectures") or not may_hold_conv1d(config):
        return frozenset()
    model = build_skeleton(config, source.label)
    return frozenset(
        f"{name}.weight"
        for name, (_, layout) in find_linear_modules(model).items()
        if layout == "conv1d"
    )


def is_task_matrix(name: str, shape: Sequence[int], exclude: Sequence[str]) -> bool:
    """Whether tensor ``name`` of ``shape`` is merged as a task matrix: two-dimensional and
    named by no ``exclude`` pattern (its name or its module's)."""
    module = name.rsplit(".", 1)[0]
    return len(shape) == 2 and not matches(name, exclude) and not matches(module, exclude)


def polar(a: NDArray[np.float64]) -> NDArray[np.float64]:
    """The orthogonal polar factor ``U Vᵀ`` of ``a = U Σ Vᵀ`` (thin SVD): the orthonormal
    matrix nearest to ``a`` (orthonormal columns if ``a`` is tall, rows if wide)."""
    u, _, vt = np.linalg.svd(a, full_matrices=False)
    out: NDArray[np.float64] = u @ vt
    return out


#: The unit roundoff of float64, the scale of the Gram paths' error estimates.
GRAM_EPS = float(np.finfo(np.float64).eps)


class GramTriplets(NamedTuple):
    """The top ``k`` singular triplets of a matrix ``a`` (``[m, n]``) from its Gram:
    ``u`` (``[m, k]``), ``s`` (``[k]``, descending), ``v`` (``[n, k]``), ``a ≈ u diag(s)
    vᵀ``; ``lam``: all eigenvalues of the smaller Gram (ascending, ``min(m, n)`` of them,
    the squared singular values to an absolute error of about ``ε λ_max``); ``terms``: the
    first-order error estimate's pieces, in order: the cut's sensitivity ``ε · n · λ_1 /
    (λ_k − λ_{k+1})`` (``n`` the Gram's order; absent if ``k = n``), then the
    orthonormality defects ``max |uᵀu − I|`` and ``max |vᵀv − I|``."""

    u: NDArray[np.float64]
    s: NDArray[np.float64]
    v: NDArray[np.float64]
    lam: NDArray[np.float64]
    terms: tuple[float, ...]


class GramPolar(NamedTuple):
    """The orthogonal polar factor ``q`` of a matrix from its Gram, its error estimate
    ``ε μ_max / μ_min`` and the Gram's eigenvalues ``mu`` (ascending: the squared singular
    values)."""

    q: NDArray[np.float64]
    estimate: float
    mu: NDArray[np.float64]


def gram_triplets(a: NDArray[np.float64], k: int, small: float = 1e-4) -> GramTriplets | None:
    """The top ``k`` singular triplets of ``a`` (``[m, n]``, float64, ``1 ≤ k ≤ min(m,
    n)``) by the float64 eigendecomposition of its smaller Gram: with ``t = a`` if ``m ≥
    n`` (else ``aᵀ``), ``v`` and ``s²`` the top ``k`` eigenpairs of ``tᵀt``, ``u = t v /
    s`` (``s`` the norms of ``t v``'s columns), swapped back for a wide ``a``.

    Parameters
    ----------
    a
        The matrix.
    k
        How many triplets.
    small
        The smallest ``s_k / s_1`` accepted.

    Returns
    -------
    GramTriplets | None
        The triplets and their estimate's pieces, or ``None`` where the Gram cannot give
        them: ``s_k`` at most ``small`` of ``s_1`` (a zero matrix, rank below ``k``), or
        equal eigenvalues at the cut (the top ``k`` not unique).
    """
    tall = a.shape[0] >= a.shape[1]
    t = a if tall else a.T
    lam, vec = np.linalg.eigh(t.T @ t)
    first, last = float(lam[-1]), float(lam[-k])
    if not last > small**2 * first:
        return None
    terms: list[float] = []
    if k < lam.shape[0]:
        gap = last - float(lam[-k - 1])
        if not gap > 0.0:
            return None
        terms.append(GRAM_EPS * lam.shape[0] * first / gap)
    v = vec[:, : -k - 1 : -1]
    u = t @ v
    s = np.linalg.norm(u, axis=0)
    u = u / s
    for block in (u, v):
        terms.append(float(np.abs(block.T @ block - np.eye(k)).max()))
    if not tall:
        u, v = v, u
    return GramTriplets(u, s, v, lam, tuple(terms))


def gram_polar(a: NDArray[np.float64]) -> GramPolar | None:
    """The orthogonal polar factor of ``a`` (``[d, p]``, float64) as ``a (aᵀa)^(-1/2)``
    (``(a aᵀ)^(-1/2) a`` if ``p > d``: the smaller Gram) by the Gram's float64
    eigendecomposition.

    Parameters
    ----------
    a
        The matrix (not empty).

    Returns
    -------
    GramPolar | None
        The factor (what :func:`polar` gives, where the Gram is well conditioned), its
        first-order error estimate ``ε μ_max / μ_min`` and the Gram's eigenvalues ``μ``;
        ``None`` where the smallest ``μ`` is not positive (``a`` numerically rank
        deficient).
    """
    tall = a.shape[0] >= a.shape[1]
    gram = a.T @ a if tall else a @ a.T
    mu, z = np.linalg.eigh(gram)
    if not float(mu[0]) > 0.0:
        return None
    root = (z / np.sqrt(mu)) @ z.T
    out: NDArray[np.float64] = a @ root if tall else root @ a
    return GramPolar(out, GRAM_EPS * float(mu[-1]) / float(mu[0]), mu)


class TaskMatrices:
    """One tensor's task matrices: ``taus`` (``c_i τ_i``, or ``τ_i`` if not ``scaled``;
    ``[out, in]``, float64), of the models with ``c_i > 0``, whose ``coefficients`` these
    are; the base ``theta0`` as stored and whether the tensor is stored ``transposed`` (a
    ``Conv1D`` weight)."""

    def __init__(
        self,
        theta0: NDArray[np.float64],
        taus: list[NDArray[np.float64]],
        transposed: bool,
        coefficients: list[float],
    ) -> None:
        self.theta0, self.taus, self.transposed = theta0, taus, transposed
        self.coefficients = coefficients

    def merged(self, delta: NDArray[np.float64]) -> NDArray[np.float64]:
        """``θ_0 + delta`` with ``delta`` (``[out, in]``) in the stored orientation."""
        out: NDArray[np.float64] = self.theta0 + (delta.T if self.transposed else delta)
        return out


def task_matrices(
    name: str,
    base: Any,
    tensors: Sequence[Any],
    coefficients: Sequence[float] | None,
    transposed: bool,
    *,
    scaled: bool = True,
) -> TaskMatrices:
    """Tensor ``name``'s task matrices from the base's and the models' values (see
    :class:`TaskMatrices`)."""
    theta0 = as_float64(base, f"base: {name}")
    coef = [1.0] * len(tensors) if coefficients is None else [float(c) for c in coefficients]
    taus, used = [], []
    for i, (c, t) in enumerate(zip(coef, tensors, strict=True)):
        if c > 0:
            tau = finite_task_vector(name, i, as_float64(t, name) - theta0)
            if scaled:
                tau *= c
            taus.append(tau.T if transposed else tau)
            used.append(c)
    return TaskMatrices(theta0, taus, transposed, used)


class TaskMatrixMethod(TaskVectorMethod):
    """A method that merges each task matrix by :meth:`merge_matrices` (the ``[out, in]``
    task matrices -> the merged update) and every other tensor by :meth:`other_tensor`
    (default: ``θ_0 + λ ×`` the coefficient-weighted mean of the task vectors).
    ``oriented``: whether its result depends on the orientation (then ``Conv1D`` weights
    are read transposed); ``scaled``: whether its task matrices are ``c_i τ_i`` (else
    ``τ_i``, the coefficients its own to apply). Its options have ``scaling`` (λ) unless it
    overrides :meth:`scaling`."""

    oriented: ClassVar[bool] = False
    scaled: ClassVar[bool] = True

    def check(self, inputs: MergeInputs) -> None:
        super().check(inputs)
        if self.oriented:
            inputs.state["conv1d"] = conv1d_weights(inputs.sources[0])

    def scaling(self, inputs: MergeInputs) -> float:
        """λ, the scaling of the merged update (the options' ``scaling``)."""
        own: Any = inputs.options.method_options
        return float(own.scaling)

    def merge_matrices(
        self, name: str, matrices: TaskMatrices, inputs: MergeInputs
    ) -> NDArray[np.float64]:
        """The merged update of tensor ``name`` (``[out, in]``), before ``× λ``."""
        raise NotImplementedError

    def other_tensor(
        self, name: str, base: Any, tensors: Sequence[Any], inputs: MergeInputs
    ) -> NDArray[np.float64]:
        """A tensor that is no task matrix: ``θ_0 + λ Σ c_i τ_i / Σ c_i``."""
        coef = inputs.options.coefficients or (1.0,) * len(tensors)
        theta0 = as_float64(base, f"base: {name}")
        delta = np.zeros_like(theta0)
        for c, t in zip(coef, tensors, strict=True):
            if c > 0:
                delta += c * (as_float64(t, name) - theta0)
        merged: NDArray[np.float64] = theta0 + (self.scaling(inputs) / sum(coef)) * delta
        return merged

    def matrices(
        self, name: str, base: Any, tensors: Sequence[Any], inputs: MergeInputs
    ) -> TaskMatrices:
        """Task matrix ``name``'s :class:`TaskMatrices` from the base's and models' values."""
        transposed = name in inputs.state.get("conv1d", ())
        coefficients = inputs.options.coefficients
        return task_matrices(name, base, tensors, coefficients, transposed, scaled=self.scaled)

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        assert inputs.base is not None
        base = checked_input(name, "the base", inputs.base.read(name))
        if not is_task_matrix(name, tuple(base.shape), inputs.options.exclude):
            return self.other_tensor(name, base, tensors, inputs)
        matrices = self.matrices(name, base, tensors, inputs)
        if not any(tau.any() for tau in matrices.taus):  # no model moved it (a frozen layer):
            return matrices.theta0  # the base, as every method's zero update leaves it
        with factorization_of(name, self.name):
            delta = self.merge_matrices(name, matrices, inputs)
        delta *= self.scaling(inputs)
        return matrices.merged(delta)

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """The reads, ``θ_0``, the K task matrices and about six matrices of the same size
        of SVD work (factors, products), all in float64."""
        return (sizes.k + 1) * (sizes.read + sizes.widened) + 8 * sizes.n * (sizes.k + 7)
