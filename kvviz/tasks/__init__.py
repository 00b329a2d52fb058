"""Evaluation tasks: offline synthetic generators (RULER-style, needle grid), public-benchmark loaders, metrics."""

from .metrics import METRICS
from .prose import TASKS as _PROSE_TASKS
from .synthetic import TASKS, Sample, needle_grid

TASKS.update(_PROSE_TASKS)  # one registry: the sweep, the CLI and the app find the prose tasks with the others

__all__ = ["METRICS", "TASKS", "Sample", "needle_grid"]
