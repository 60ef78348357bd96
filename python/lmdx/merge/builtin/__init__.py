"""The built-in merge methods, one file each, written exactly as an outside method would
be (:mod:`lmdx.merge.method`): RegMean (with its blocks of rows), averaging, Fisher
averaging, the task-vector methods (task arithmetic, TIES, DARE, DARE-TIES, Model
Breadcrumbs, DELLA, Model Stock), RegMean++, the methods on task matrices (TSV-M, ISO-C,
ISO-CTS, WUDI), SLERP and the Karcher mean; and SVC, the post-step any of them can be
followed by (``method: <name>+svc``). :mod:`lmdx.merge.registry` registers
:data:`BUILT_IN` and :data:`POST_STEPS`."""

from __future__ import annotations

from .average import AVERAGE, Average
from .breadcrumbs import Breadcrumbs, BreadcrumbsTies
from .della import Della, DellaLinear
from .fisher import Fisher
from .isotropic import IsoC, IsoCts
from .model_stock import ModelStock
from .regmean import RegMean
from .regmean_plusplus import RegMeanPlusPlus
from .slerp import Karcher, Slerp
from .svc import SVC
from .task_vectors import Dare, DareTies, TaskArithmetic, Ties
from .tsv import TaskSingularVectors
from .wudi import Wudi

__all__ = [
    "BUILT_IN",
    "DEFAULT_METHOD",
    "POST_STEPS",
    "Average",
    "Breadcrumbs",
    "BreadcrumbsTies",
    "Dare",
    "DareTies",
    "Della",
    "DellaLinear",
    "Fisher",
    "IsoC",
    "IsoCts",
    "Karcher",
    "ModelStock",
    "RegMean",
    "RegMeanPlusPlus",
    "Slerp",
    "TaskArithmetic",
    "TaskSingularVectors",
    "Ties",
    "Wudi",
]

#: The built-in methods, in the order ``lmdx methods`` lists them.
BUILT_IN = (
    RegMean(),
    AVERAGE,
    Fisher(),
    TaskArithmetic(),
    Ties(),
    Dare(),
    DareTies(),
    RegMeanPlusPlus(),
    Breadcrumbs(),
    BreadcrumbsTies(),
    Della(),
    DellaLinear(),
    ModelStock(),
    TaskSingularVectors(),
    IsoC(),
    IsoCts(),
    Wudi(),
    Slerp(),
    Karcher(),
)

#: The post-steps every method can be followed by (``method: <name>+<post-step>``).
POST_STEPS = (SVC,)

#: The method the front doors use when none is named.
DEFAULT_METHOD = RegMean.name
