"""Statistics: the files contributors share instead of their data, and their collection
(Gram hooks, diagonal Fisher, Ray workers)."""

from __future__ import annotations

from .add import add_statistics
from .collect import collect_regmean_stats
from .file import Statistics
from .fisher import collect_fisher
from .join import join_statistics
from .ray import collect_regmean_stats_ray, shard_bounds
from .sites import find_linear_modules
from .writer import StatisticsWriter

__all__ = [
    "Statistics",
    "StatisticsWriter",
    "add_statistics",
    "collect_fisher",
    "collect_regmean_stats",
    "collect_regmean_stats_ray",
    "find_linear_modules",
    "join_statistics",
    "shard_bounds",
]
