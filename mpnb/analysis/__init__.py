"""Analysis: the same run in several modes, a step's memory, the largest batch per mode.

- :mod:`~mpnb.analysis.comparison`: :func:`compare` and its :class:`Comparison` table.
- :mod:`~mpnb.analysis.memory`: :func:`memory`, where a step's memory goes, by category.
- :mod:`~mpnb.analysis.batch_size`: :func:`max_batch_size`, built on that account.

Each shows its progress through the view the UI provides (:mod:`mpnb.views`), never by
importing the UI.
"""

from mpnb.analysis.batch_size import BatchSizeReport, max_batch_size
from mpnb.analysis.comparison import Comparison, ComparisonProgress, ModeResult, compare
from mpnb.analysis.memory import MemoryReport, memory

__all__ = [
    "compare",
    "Comparison",
    "ComparisonProgress",
    "ModeResult",
    "max_batch_size",
    "BatchSizeReport",
    "memory",
    "MemoryReport",
]
