"""RegMean with a prior mean (the RegMean form of Bayesian Model Merging, arXiv
2605.12843): each solved layer is pulled toward an *anchor*, a data-free merge of the same
models, with a strength per module::

    W_Mᵀ = (Σ c_i G̃_i + Λ)⁻¹ (Σ c_i G̃_i W_iᵀ + Λ W_aᵀ),    Λ = λ · t · I,
    t = tr(Σ c_i G̃_i) / d_in

``W_a``: the anchor's merge of the layer (``prior``: any registered method that takes no
statistics and no data, ``task_arithmetic``, ``ties``, ``tsv_m``, ``wudi``, ..., with its
own options ``prior_options``); ``G̃_i`` reduced by α as for RegMean; ``λ``:
``prior_strength``, one number or shell-style patterns of module names to numbers (the
first that matches; a module none matches has no prior). ``t`` is the mean of the
system's diagonal, so ``λ`` is scale-free: at ``λ = 1`` the prior weighs, along every
input direction, what the statistics weigh on average along one. It is MAP estimation
with the Gaussian prior ``N(W_a, (λt)⁻¹ σ² I)`` on each output row and RegMean's
likelihood. The paper's prior precision could not be read here (only its abstract); this
isotropic one with a per-module scale is what the issue asking for it describes. The
Bayesian optimisation of ``λ`` on validation it reports is done here by a grid search
(``bench/bench_methods.py``).

The solve is RegMean's own (:func:`lmdx.regmean_merge_layer`, its precision, certificate
and report) with the anchor as a (K + 1)-th model whose Gram is ``Λ`` (over one row,
coefficient 1): that model's share of the system is ``Λ`` (a diagonal Gram is unchanged
by α) and of the right-hand side ``Λ W_aᵀ``, which is the formula exactly. ``λ = 0`` adds
nothing (RegMean bit for bit); as ``λ → ∞`` the merge tends to the anchor (error
``O(1/λ)``). Directions no statistics reached, which plain RegMean leaves at the average,
follow the anchor.

A group's anchor is computed where the group is solved, tensor by tensor with the anchor
method's own :meth:`~lmdx.merge.method.MergeMethod.tensor`, from the same reads: its
cost is the anchor's own time. A merge with a prior runs its groups in this process
(``ray_workers`` still serves nothing else: its workers open no base).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, NamedTuple

import numpy as np
from numpy.typing import NDArray
from pydantic import Field, ValidationError

from ..._errors import MergeError
from ..._util import did_you_mean, matches
from ..method import (
    Merged,
    MergeInputs,
    MergeMethod,
    NoOptions,
    Step,
    StepSizes,
    cast_merged,
    checked_input,
)
from ..options import option_error

__all__ = [
    "AnchorTensors",
    "Prior",
    "PriorOptions",
    "PriorSystem",
    "joined",
    "prior_strength",
    "prior_system",
]


_Strength = Annotated[float, Field(ge=0.0)]


class PriorOptions(NoOptions):
    """RegMean's prior: the anchor method, its options and the strength per module."""

    prior: Annotated[
        str | None,
        Field(
            description="a data-free method (task_arithmetic, ties, tsv_m, wudi, ...) whose "
            "merge is the prior mean of every solved layer; needs base",
            json_schema_extra={"label": "must be a method's name"},
        ),
    ] = None
    prior_strength: Annotated[
        _Strength | dict[str, _Strength],
        Field(
            description="λ >= 0: the prior's weight, in units of the layer's mean Gram "
            "diagonal (0: RegMean; large: the anchor); or module-name patterns to λ (the "
            "first that matches; none: no prior)",
            json_schema_extra={"label": "must be a number >= 0 or patterns to numbers >= 0"},
        ),
    ] = 1.0
    prior_options: Annotated[
        dict[str, Any],
        Field(
            description="the anchor method's own options (e.g. {density: 0.2} for ties)",
            json_schema_extra={"label": "must be a mapping of the anchor's options"},
        ),
    ] = {}  # noqa: RUF012 (pydantic copies a mutable default)


def prior_strength(module: str, own: PriorOptions) -> float:
    """``λ`` of ``module`` (0 where there is no prior or no pattern matches it)."""
    if own.prior is None:
        return 0.0
    strength = own.prior_strength
    if not isinstance(strength, dict):
        return float(strength)
    for pattern, value in strength.items():
        if matches(module, [pattern]):
            return float(value)
    return 0.0


def _anchor_options(method: MergeMethod, given: Mapping[str, Any]) -> NoOptions:
    """The anchor's own options from ``prior_options``, or :class:`MergeError` naming the
    key."""
    try:
        out: NoOptions = method.options.model_validate(given)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        key = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            known = sorted(method.options.model_fields)
            raise MergeError(
                f"prior_options: {method.name} takes no option {key!r}; its options are {known}"
            ) from None
        raise MergeError(f"prior_options.{option_error(key, method.options, exc)}") from None
    return out


class Prior:
    """The anchor of one merge: the method and the inputs it merges with (its own
    options, the base as it names the tensors), set up by :meth:`open`."""

    def __init__(self, method: MergeMethod, inputs: MergeInputs) -> None:
        self.method = method
        self.inputs = inputs
        cls = type(
            f"{type(method).__name__}Anchor",
            (AnchorTensors,),
            {"name": f"{method.name} (the prior)", "summary": method.summary},
        )
        #: the method of the tensors RegMean does not solve, of modules with a prior
        self.tensors: MergeMethod = cls(self)

    @classmethod
    def open(cls, inputs: MergeInputs, own: PriorOptions) -> Prior | None:
        """The anchor of a merge whose RegMean options are ``own``, checked (the method
        exists, needs neither statistics nor data, accepts ``prior_options``; the base is
        given), or None without a prior. :class:`MergeError` naming the option."""
        if own.prior is None:
            if own.prior_options:
                raise MergeError("prior_options: given without prior; name the anchor method")
            return None
        method = inputs.methods.get(own.prior)
        if method is None:
            raise MergeError(
                f"prior: no method {own.prior!r}{did_you_mean(own.prior, inputs.methods)}"
            )
        if method.stats is not None or method.takes_data or own.prior == inputs.method.name:
            raise MergeError(
                f"prior: {own.prior} needs statistics or data; the anchor is a data-free "
                "method (task_arithmetic, ties, tsv_m, wudi, ...)"
            )
        if inputs.base is None:
            raise MergeError(
                f"base: prior {own.prior} merges task vectors against the pre-trained model "
                "the models were fine-tuned from; give base"
            )
        anchor_own = _anchor_options(method, own.prior_options)
        options = inputs.options.model_copy(
            update={"method": method.name, "method_options": anchor_own}
        )
        anchor = MergeInputs(
            method,
            options,
            inputs.sources,
            inputs.labels,
            base=inputs.base if method.needs_base else None,
            methods=inputs.methods,
        )
        method.check(anchor)
        return cls(method, anchor)

    def values(self, tensors: Sequence[str], reads: Sequence[Sequence[Any]]) -> list[Any]:
        """The anchor's merge (float64) of each of ``tensors`` from the models' ``reads``
        (per model, one read per tensor, as stored)."""
        out = []
        for j, name in enumerate(tensors):
            method = self.method.tensor_method(self.inputs, name)
            out.append(method.tensor(name, [r[j] for r in reads], self.inputs))
        return out

    def report(self) -> dict[str, Any]:
        """The anchor's options as resolved (its defaults filled in)."""
        return dict(self.inputs.options.method_options.model_dump())

    def memory(self, step: Step, sizes: StepSizes) -> int:
        """The most any member's anchor takes at once, and the anchors held in float64."""
        most = 0
        for name in step.tensors:
            one = Step(self.method, [name])
            most = max(most, self.method.memory(one, sizes.of(one, packed=False), self.inputs))
        return most + 8 * sizes.n


class AnchorTensors(MergeMethod):
    """A tensor RegMean does not solve (a bias, a norm, an embedding) of a module with a
    prior: the anchor's merge of it, as the prior is all there is without statistics
    (with ``λ = 0`` it is averaged, as by RegMean)."""

    def __init__(self, prior: Prior) -> None:
        self.prior = prior

    def compute(self, step: Step, inputs: MergeInputs) -> Merged:
        name = step.tensors[0]
        reads = [[checked_input(name, s.label, s.read(name))] for s in inputs.sources]
        value = self.prior.values([name], reads)[0]
        if inputs.lora is not None:
            inputs.lora.observe(name, value)
        return Merged({name: cast_merged(name, value, inputs.sources[0].dtype(name))})

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        return self.prior.memory(step, sizes) + sizes.out


class PriorSystem(NamedTuple):
    """The anchor as a (K + 1)-th model of one RegMean system (over one row, coefficient
    1): its Gram ``Λ`` (packed upper triangle), its weight (the members joined as the
    models' weights are) and ``λ``."""

    gram: NDArray[np.float64]
    weight: NDArray[np.float64]
    strength: float

    def rows(self, lo: int, hi: int) -> PriorSystem:
        """The system of output rows ``lo:hi`` (layout ``linear``)."""
        return self._replace(weight=self.weight[lo:hi])


def _diagonal(gram: NDArray[Any], dim: int) -> NDArray[np.float64]:
    """The diagonal of a Gram as stored: full (d, d), or its upper triangle packed row by
    row (row i starts at i·d − i(i − 1)/2)."""
    if gram.ndim == 2:
        return np.asarray(np.diagonal(gram), dtype=np.float64)
    i = np.arange(dim)
    return np.asarray(gram[i * dim - i * (i - 1) // 2], dtype=np.float64)


def prior_system(
    grams: Sequence[NDArray[Any]],
    counts: Sequence[float],
    coefficients: Sequence[float] | None,
    dim: int,
    strength: float,
    weight: NDArray[np.float64],
) -> PriorSystem:
    """The (K + 1)-th model of a system with prior strength ``strength`` > 0 and anchor
    ``weight``: ``Λ = λ t I``, ``t`` the mean diagonal of ``Σ c_i G_i / n_i`` (that of
    ``Σ c_i G̃_i`` for every α)."""
    coef = coefficients or (1.0,) * len(grams)
    diag = np.zeros(dim)
    for c, g, n in zip(coef, grams, counts, strict=True):
        if c > 0:
            diag += (c / n) * _diagonal(g, dim)
    value = strength * float(diag.mean())
    packed = np.zeros(dim * (dim + 1) // 2)
    i = np.arange(dim)
    packed[i * dim - i * (i - 1) // 2] = value
    return PriorSystem(packed, weight, strength)


def joined(values: Sequence[NDArray[Any]], layout: str) -> NDArray[np.float64]:
    """Members' anchors joined as a group's weights are (along the outputs)."""
    axis = 0 if layout == "linear" else 1
    arrays = [np.asarray(v, dtype=np.float64) for v in values]
    return np.concatenate(arrays, axis=axis) if len(arrays) > 1 else arrays[0]
