"""The built-in merge methods, one file each, written exactly as an outside method would
be (:mod:`lmdx.merge.method`): RegMean (with its blocks of rows), averaging, Fisher
averaging, the task-vector methods (task arithmetic, TIES, DARE, DARE-TIES) and RegMean++.
:mod:`lmdx.merge.registry` registers :data:`BUILT_IN`."""

from __future__ import annotations

from .average import AVERAGE, Average
from .fisher import Fisher
from .regmean import RegMean
from .regmean_plusplus import RegMeanPlusPlus
from .task_vectors import Dare, DareTies, TaskArithmetic, Ties

__all__ = [
    "BUILT_IN",
    "DEFAULT_METHOD",
    "Average",
    "Dare",
    "DareTies",
    "Fisher",
    "RegMean",
    "RegMeanPlusPlus",
    "TaskArithmetic",
    "Ties",
]

#: The built-in methods, in the order ``lmdx merge --help`` lists them.
BUILT_IN = (
    RegMean(),
    AVERAGE,
    Fisher(),
    TaskArithmetic(),
    Ties(),
    Dare(),
    DareTies(),
    RegMeanPlusPlus(),
)

#: The method the front doors use when none is named.
DEFAULT_METHOD = RegMean.name
