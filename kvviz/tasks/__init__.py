"""Evaluation tasks: offline synthetic generators (RULER-style, needle grid), public-benchmark loaders, metrics."""

from .metrics import METRICS
from .synthetic import TASKS, Sample, needle_grid

__all__ = ["METRICS", "TASKS", "Sample", "needle_grid"]
