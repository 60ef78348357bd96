"""The options of a RegMean solve, shared by ``regmean`` and ``regmean_plusplus``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ..registry import NoOptions

__all__ = ["SolveOptions"]

_IGNORED = "ignored"  # given to a method that solves nothing: accepted, no effect


class SolveOptions(NoOptions):
    """RegMean's α and how its systems are solved (see :func:`lmdx.regmean_merge_layer`)."""

    alpha: Annotated[
        float,
        Field(
            ge=0.0,
            le=1.0,
            description="off-diagonal scaling of the Grams in [0, 1] (the paper uses 0.9 "
            "for transformers)",
            json_schema_extra={"label": "must be in [0, 1]", "elsewhere": _IGNORED},
        ),
    ] = 1.0
    ridge: Annotated[
        float,
        Field(
            ge=0.0,
            description="relative ridge added to every system",
            json_schema_extra={"label": "must be a number >= 0", "elsewhere": _IGNORED},
        ),
    ] = 0.0
    allow_regularization: Annotated[
        bool,
        Field(
            description="whether the solver may raise the ridge of a system that is not "
            "positive definite",
            json_schema_extra={"label": "must be true or false", "elsewhere": _IGNORED},
        ),
    ] = True
    precision: Annotated[
        Literal["auto", "float32", "float64"],
        Field(
            description="auto: per layer float32 where a certificate bounds the relative "
            "output error by 1e-6, else float64; float32: always (estimate reported); "
            "float64: always",
            json_schema_extra={
                "label": "must be one of auto, float32, float64",
                "elsewhere": _IGNORED,
            },
        ),
    ] = "auto"
