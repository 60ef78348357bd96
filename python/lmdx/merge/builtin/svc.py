"""SVC, Singular Value Calibration ("When Shared Knowledge Hurts: Spectral
Over-Accumulation in Model Merging", arXiv 2602.05536): a data-free post-step that any
method's merged model can go through, ``method: <name>+svc`` (``ties+svc``,
``regmean+svc``, ...; it needs ``base``, the pre-trained model).

Summing task updates over-counts what the tasks share: where several tasks push the same
singular direction, the merged response along it is amplified. Per task matrix of the
merged model (a 2-D tensor the base has, not named by ``exclude``, read ``[out, in]``:
:mod:`lmdx.merge.builtin.task_matrices`), with ``Δ = W_merged − W_0`` and the task updates
``Δ_i = W_i − W_0`` of the models with coefficient ``c_i > 0``:

1. the thin SVD ``Δ = U Σ Vᵀ``;
2. per singular direction ``r`` and task ``i``, the task's response ``a_ri = u_rᵀ Δ_i``
   and the merged one ``u_rᵀ Δ = σ_r v_rᵀ``, and the projection coefficient
   ``s_ri = ⟨σ_r v_r, a_ri⟩ / ‖a_ri‖²`` (0 where ``a_ri = 0``): above 1 the merge
   amplifies task i along ``u_r``;
3. ``γ_r = Σ c_i / Σ c_i max(α, s_ri)`` (α: ``svc_alpha``; ``K / Σ_i max(α, s_ri)`` for
   equal coefficients) and the calibrated ``W_0 + U diag(γ Σ) Vᵀ``.

Every other tensor is as the method merged it, and so is a task matrix the merge left at
the base (``Δ = 0``: its calibration is 0, found without an SVD). This is the algorithm
as FusionBench implements it ("Algorithm 1 of the paper", its SVC in
``singular_value_calibration``; the paper itself could not be read here), with two
differences that only matter in degenerate cases: a zero response gives ``s = 0``
exactly (FusionBench clamps ``‖a‖²`` at 1e-12), and the coefficients weigh the tasks. α
defaults to 0.1 (FusionBench's documented default; its configurations use 1.0 after TSV-M
and WUDI).

The method runs as it would without SVC (the steps, the report, RegMean++'s blocks on its
own uncalibrated results); each step's merged tensors are then calibrated before they are
written, from the merged tensor as the method computed it (in float64, before any cast:
:func:`lmdx.merge.method.uncast`), the base and the models read again, and cast to the
input dtype once, after the calibration (as merging float32 upcasts and rounding once). A
``+svc`` merge runs in one process (no Ray workers) and builds no LoRA of the merged update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, Field, create_model

from ..._errors import MergeError
from ..._tensors import as_float64
from ..method import (
    COPY,
    Merged,
    MergeInputs,
    MergeMethod,
    NoOptions,
    PostStep,
    Step,
    StepSizes,
    cast_merged,
    checked_input,
    tensor_step,
    uncast,
)
from .task_matrices import conv1d_weights, factorization_of, is_task_matrix
from .task_vectors import base_as_models_name_it

__all__ = ["SVC", "SvcOptions", "svc_calibrate", "with_svc"]


class SvcOptions(NoOptions):
    """SVC's α (FusionBench's default 0.1)."""

    svc_alpha: Annotated[
        float,
        Field(
            gt=0.0,
            description="SVC's α: a direction's scale is K / Σ_i max(α, s_ri); larger α "
            "calibrates more",
            json_schema_extra={"label": "must be a number > 0"},
        ),
    ] = 0.1


def svc_calibrate(
    delta: NDArray[np.float64],
    task_deltas: Sequence[NDArray[np.float64]],
    coefficients: Sequence[float],
    alpha: float,
) -> NDArray[np.float64]:
    """The calibrated merged update ``U diag(γ Σ) Vᵀ`` of ``delta`` (``[out, in]``) from the
    task updates ``task_deltas`` with positive ``coefficients`` (see the module's
    description)."""
    u, s, vt = np.linalg.svd(delta, full_matrices=False)
    weighted = np.zeros_like(s)
    for c, task in zip(coefficients, task_deltas, strict=True):
        response = u.T @ task  # a_ri, one row per direction r
        along = np.einsum("rj,rj->r", response, vt) * s  # ⟨σ_r v_r, a_ri⟩
        norm2 = np.einsum("rj,rj->r", response, response)
        ratio = np.divide(along, norm2, out=np.zeros_like(s), where=norm2 > 0)
        weighted += c * np.maximum(alpha, ratio)
    gamma = sum(coefficients) / weighted
    out: NDArray[np.float64] = (u * (gamma * s)) @ vt
    return out


class _Calibrating(MergeMethod):
    """A step of a ``+svc`` merge: the step's own method, then every merged task matrix
    calibrated."""

    ray: ClassVar[str] = "local"

    def __init__(self, method: MergeMethod) -> None:
        self.method = method

    def compute(self, step: Step, inputs: MergeInputs) -> Merged:
        with uncast():  # calibrated from the method's float64 values, then cast once
            raw = self.method.compute(step, inputs)
        out = Merged(dict(raw.tensors), raw.report)
        for name, value in raw.tensors.items():
            out.tensors[name] = _calibrated(name, value, inputs)
            raw.tensors[name] = _cast_as_input(name, value, inputs)
        inputs.state.setdefault("svc_raw", {})[id(step)] = raw
        return out

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """The step's own, then the merged tensor, the base and the K models read again in
        float64, and the SVD's factors."""
        calibration = (sizes.k + 1) * (sizes.read + sizes.widened) + 8 * sizes.n * (sizes.k + 6)
        return max(self.method.memory(step, sizes, inputs), calibration + sizes.out)

    def step_label(self, step: Step) -> str:
        return self.method.step_label(step)


def _cast_as_input(name: str, value: Any, inputs: MergeInputs) -> Any:
    """Merged tensor ``name`` (float64 where it is floating point: :func:`uncast`) in its
    input dtype, as the method itself would have returned it."""
    source = inputs.sources[0]
    if name not in source or not source.is_float(name):
        return value
    return cast_merged(name, value, source.dtype(name))


def _calibrated(name: str, value: Any, inputs: MergeInputs) -> Any:
    """Merged tensor ``name`` (in float64, as the step computed it) calibrated and cast to
    its input dtype once, or only cast if it is no task matrix (or the base lacks it, or it
    is not floating point)."""
    base = inputs.base
    assert base is not None
    source = inputs.sources[0]
    if name not in base or not source.is_float(name):
        return _cast_as_input(name, value, inputs)
    theta0 = as_float64(checked_input(name, "the base", base.read(name)), name)
    if not is_task_matrix(name, theta0.shape, inputs.options.exclude):
        return _cast_as_input(name, value, inputs)
    transposed = name in inputs.state.get("svc_conv1d", ())
    coef = inputs.options.coefficients or (1.0,) * len(inputs.sources)

    def oriented(x: NDArray[np.float64]) -> NDArray[np.float64]:
        return x.T if transposed else x

    delta = oriented(as_float64(value, name) - theta0)
    if not delta.any():  # the merge left it at the base (a frozen layer): nothing to scale
        return cast_merged(name, theta0, source.dtype(name))
    used = [c for c in coef if c > 0]
    tasks = [
        oriented(as_float64(s.read(name), name) - theta0)
        for c, s in zip(coef, inputs.sources, strict=True)
        if c > 0
    ]
    own = inputs.options.own(SvcOptions)
    with factorization_of(name, "svc"):
        update = svc_calibrate(delta, tasks, used, own.svc_alpha)
    return cast_merged(name, theta0 + oriented(update), source.dtype(name))


class _WithSvc(MergeMethod):
    """``inner`` followed by SVC (:func:`with_svc` makes one per method)."""

    inner: ClassVar[MergeMethod]
    needs_base: ClassVar[bool] = True
    ray: ClassVar[str] = "refused"

    def __init__(self) -> None:
        self._steps: dict[int, MergeMethod] = {}

    def around(self, method: MergeMethod) -> MergeMethod:
        """``method``'s steps, calibrated (one object per method)."""
        if method is COPY:
            return method
        if id(method) not in self._steps:
            cls = type(
                f"{type(method).__name__}Svc",
                (_Calibrating,),
                {"name": f"{method.name}+svc", "summary": method.summary},
            )
            self._steps[id(method)] = cls(method)
        return self._steps[id(method)]

    def surrogates(self, own: BaseModel) -> bool:
        return self.inner.surrogates(own)

    def check(self, inputs: MergeInputs) -> None:
        if inputs.lora is not None:
            raise MergeError(
                f"output.lora_rank: method {self.name} builds no LoRA of the merged update; "
                "leave lora_rank out"
            )
        self.inner.check(inputs)
        assert inputs.base is not None
        inputs.base, _ = base_as_models_name_it(inputs.base, inputs.sources[0], inputs)
        inputs.state["svc_conv1d"] = conv1d_weights(inputs.sources[0])

    def order(self, inputs: MergeInputs, names: list[str]) -> list[str]:
        return self.inner.order(inputs, names)

    def group_steps(self, inputs: MergeInputs, body: Sequence[str], tied: set[str]) -> list[Step]:
        """The method's steps (its group steps and one per other tensor), each calibrated."""
        steps = [
            replace(s, method=self.around(s.method))
            for s in self.inner.group_steps(inputs, body, tied)
        ]
        covered = {t for s in steps for t in s.tensors}
        for name in body:
            if name not in covered:
                step = tensor_step(inputs, name)
                steps.append(replace(step, method=self.around(step.method)))
        return steps

    def tensor_method(self, inputs: MergeInputs, name: str) -> MergeMethod:
        return self.inner.tensor_method(inputs, name)

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        return self.inner.tensor(name, tensors, inputs)

    def plan_notes(self, inputs: MergeInputs, steps: Sequence[Step]) -> list[str]:
        inner_steps = [
            replace(s, method=s.method.method) if isinstance(s.method, _Calibrating) else s
            for s in steps
        ]
        return [
            *self.inner.plan_notes(inputs, inner_steps),
            "then SVC (singular value calibration) of every merged 2-D tensor the base has",
        ]

    def report(self, inputs: MergeInputs) -> dict[str, Any]:
        return self.inner.report(inputs)

    def start(self, inputs: MergeInputs, progress: bool) -> None:
        self.inner.start(inputs, progress)

    def after_step(self, step: Step, merged: Merged, inputs: MergeInputs) -> None:
        """The method sees its own, uncalibrated results."""
        raw = inputs.state.get("svc_raw", {}).pop(id(step), merged)
        if isinstance(step.method, _Calibrating):
            step = replace(step, method=step.method.method)
        self.inner.after_step(step, raw, inputs)

    def finish(self, inputs: MergeInputs) -> dict[str, Any]:
        return self.inner.finish(inputs)


def with_svc(method: MergeMethod) -> MergeMethod:
    """``method`` followed by SVC: the method named ``<name>+svc``, whose options are the
    method's and :class:`SvcOptions`."""
    bases = (
        (SvcOptions,) if issubclass(SvcOptions, method.options) else (method.options, SvcOptions)
    )
    options = create_model(f"{method.options.__name__}Svc", __base__=bases)
    cls = type(
        f"{type(method).__name__}Svc",
        (_WithSvc,),
        {
            "inner": method,
            "name": f"{method.name}+svc",
            "summary": f"{method.summary}; then SVC (singular value calibration)",
            "options": options,
            "stats": method.stats,
            "takes_data": method.takes_data,
            "headline": (*method.headline, "svc_alpha"),
            "shows_progress": method.shows_progress,
        },
    )
    wrapped: MergeMethod = cls()
    return wrapped


#: SVC as a post-step: ``method: <name>+svc``.
SVC = PostStep(
    "svc",
    "SVC (singular value calibration, arXiv 2602.05536): each merged 2-D tensor's singular "
    "values scaled down where the tasks' updates over-accumulate; no data, needs base",
    SvcOptions,
    with_svc,
)
