"""The built-in merge methods, registered with :func:`lmdx.merge.registry.register_method`
exactly as an outside method would be: RegMean, averaging, Fisher averaging, the
task-vector methods (task arithmetic, TIES, DARE, DARE-TIES) and RegMean++."""

from __future__ import annotations

from ..registry import register_method
from .average import Average
from .fisher import Fisher
from .regmean import RegMean
from .regmean_plusplus import RegMeanPlusPlus
from .task_vectors import Dare, DareTies, TaskArithmetic, Ties

__all__ = [
    "Average",
    "Dare",
    "DareTies",
    "Fisher",
    "RegMean",
    "RegMeanPlusPlus",
    "TaskArithmetic",
    "Ties",
]

for _method in (
    RegMean(),
    Average(),
    Fisher(),
    TaskArithmetic(),
    Ties(),
    Dare(),
    DareTies(),
    RegMeanPlusPlus(),
):
    register_method(_method)
