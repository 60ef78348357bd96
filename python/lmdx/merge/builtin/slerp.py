"""``slerp`` (two models) and ``karcher`` (any number): spherical interpolation of the
models' parameters, tensor by tensor, each tensor taken as one flat vector (mergekit's
``slerp`` and ``karcher``). No base.

``slerp`` of ``θ_0`` (the first model) and ``θ_1`` at ``t`` (Shoemake's formula, as
mergekit): with the unit vectors ``v_i = θ_i / ‖θ_i‖`` (``θ_i`` itself where ``‖θ_i‖ ≤
1e-8``) and ``cos Ω = ⟨v_0, v_1⟩``::

    slerp = sin((1 − t) Ω) / sin Ω · θ_0 + sin(t Ω) / sin Ω · θ_1

and the linear ``(1 − t) θ_0 + t θ_1`` where ``|cos Ω| > 0.9995`` (nearly parallel). The
coefficients are not used (``t`` weighs the two models).

``karcher``, the multi-model version: the weighted Karcher (Riemannian, Fréchet) mean of
the directions on the unit sphere, rescaled to the weighted mean norm (mergekit's
``karcher``, run to convergence): with weights ``w_i = c_i / Σ c_j`` (equal by default),
norms ``n_i = ‖θ_i‖`` and unit vectors ``u_i`` of the models with ``n_i > 0``, ``u``
minimises ``Σ w_i arccos(⟨u, u_i⟩)²`` over unit vectors, by the fixed-point iteration
started at the normalized weighted mean of the ``u_i``::

    T = Σ w_i (θ_i / sin θ_i) (u_i − cos θ_i u),   cos θ_i = ⟨u, u_i⟩
    u ← cos ‖T‖ u + sin ‖T‖ T / ‖T‖

until ``‖T‖ ≤ tol`` (at most ``max_iter`` steps; not converging is an error naming the
tensor); the merged tensor is ``(Σ w_i n_i) u``. With two models and weights ``(1 − t,
t)``, ``u`` is the slerp of ``u_0`` and ``u_1`` at ``t``. mergekit's ``multislerp`` (one
step in the tangent space at the weighted mean, not iterated) is a different, approximate
mean; lmdx has the exact one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ..._errors import MergeError
from ..._tensors import as_float64
from ..method import MergeInputs, MergeMethod, NoOptions

__all__ = ["Karcher", "KarcherOptions", "Slerp", "SlerpOptions", "karcher_mean", "slerp"]

#: Above this |cos Ω| two vectors are taken as parallel and interpolated linearly.
PARALLEL = 0.9995


class SlerpOptions(NoOptions):
    """SLERP: halfway (t = 0.5)."""

    t: Annotated[
        float,
        Field(
            ge=0.0,
            le=1.0,
            description="slerp: where between the first model (0) and the second (1)",
            json_schema_extra={"label": "must be in [0, 1]"},
        ),
    ] = 0.5


class KarcherOptions(NoOptions):
    """The Karcher mean iterated until its step is below ``tol`` radians."""

    max_iter: Annotated[
        int,
        Field(
            ge=1,
            description="karcher: the most fixed-point steps per tensor",
            json_schema_extra={"label": "must be a whole number >= 1"},
        ),
    ] = 100
    tol: Annotated[
        float,
        Field(
            gt=0.0,
            description="karcher: the step (radians) below which the mean has converged",
            json_schema_extra={"label": "must be a number > 0"},
        ),
    ] = 1e-12


def slerp(t: float, a: NDArray[np.float64], b: NDArray[np.float64]) -> NDArray[np.float64]:
    """``a`` and ``b`` (float64, one shape) interpolated on the sphere at ``t`` (see the
    module's description)."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    va = a / na if na > 1e-8 else a
    vb = b / nb if nb > 1e-8 else b
    cos = float(np.vdot(va, vb))
    if abs(cos) > PARALLEL:
        out: NDArray[np.float64] = (1.0 - t) * a + t * b
        return out
    omega = np.arccos(cos)
    s = np.sin(omega)
    out = (np.sin((1.0 - t) * omega) / s) * a + (np.sin(t * omega) / s) * b
    return out


def karcher_mean(
    name: str,
    tensors: Sequence[NDArray[np.float64]],
    weights: Sequence[float],
    *,
    max_iter: int = 100,
    tol: float = 1e-12,
) -> NDArray[np.float64]:
    """The weighted Karcher mean of ``tensors`` (float64, one shape; ``weights`` sum to
    1) as the module describes; :class:`MergeError` naming tensor ``name`` if it does not
    converge in ``max_iter`` steps."""
    norms = [float(np.linalg.norm(x)) for x in tensors]
    scale = sum(w * n for w, n in zip(weights, norms, strict=True))
    used = [i for i, n in enumerate(norms) if n > 0 and weights[i] > 0]
    if not used:
        return np.zeros_like(tensors[0])
    total = sum(weights[i] for i in used)
    w = [weights[i] / total for i in used]
    units = [tensors[i].reshape(-1) / norms[i] for i in used]
    u = np.zeros_like(units[0])
    for wi, ui in zip(w, units, strict=True):
        u += wi * ui
    length = float(np.linalg.norm(u))
    u = u / length if length > 0 else units[0].copy()
    step = np.inf
    for _ in range(max_iter):
        tangent = np.zeros_like(u)
        for wi, ui in zip(w, units, strict=True):
            # the angle from the chord ‖u_i − u‖ = 2 sin(θ/2): accurate for small angles
            chord = min(2.0, float(np.linalg.norm(ui - u)))
            theta = 2.0 * np.arcsin(chord / 2.0)
            if theta > 0:
                cos = 1.0 - chord * chord / 2.0
                tangent += (wi * theta / np.sin(theta)) * (ui - cos * u)
        step = float(np.linalg.norm(tangent))
        if step <= tol:
            break
        u = np.cos(step) * u + (np.sin(step) / step) * tangent
        u /= np.linalg.norm(u)
    else:
        raise MergeError(
            f"tensor {name!r}: the Karcher mean did not converge in max_iter={max_iter} steps "
            f"(last step {step:.1e} rad, tol {tol:g}); raise max_iter or tol"
        )
    out: NDArray[np.float64] = (scale * u).reshape(tensors[0].shape)
    return out


class Slerp(MergeMethod):
    name: ClassVar[str] = "slerp"
    summary: ClassVar[str] = (
        "SLERP (Shoemake, 1985; mergekit's slerp): two models interpolated on the sphere, "
        "tensor by tensor, at t"
    )
    options: ClassVar[type[NoOptions]] = SlerpOptions
    headline: ClassVar[tuple[str, ...]] = ("t",)

    def check(self, inputs: MergeInputs) -> None:
        if len(inputs.sources) != 2:
            raise MergeError(
                f"models: slerp interpolates two models, got {len(inputs.sources)}; merge "
                "more with method karcher"
            )
        if inputs.options.coefficients is not None:
            raise MergeError("coefficients: slerp weighs its two models by t; leave them out")

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        t = inputs.options.own(SlerpOptions).t
        return slerp(t, as_float64(tensors[0], name), as_float64(tensors[1], name))


class Karcher(MergeMethod):
    name: ClassVar[str] = "karcher"
    summary: ClassVar[str] = (
        "the Karcher mean (mergekit's karcher, to convergence): multi-model SLERP, the "
        "coefficient-weighted mean direction on the sphere times the mean norm, per tensor"
    )
    options: ClassVar[type[NoOptions]] = KarcherOptions

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        own = inputs.options.own(KarcherOptions)
        coef = inputs.options.coefficients or (1.0,) * len(tensors)
        weights = [c / sum(coef) for c in coef]
        arrays = [as_float64(t, name) for t in tensors]
        return karcher_mean(name, arrays, weights, max_iter=own.max_iter, tol=own.tol)
