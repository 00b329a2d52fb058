"""Recency: keep the most recent ``B`` tokens (a sliding window, no sinks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, lowest, over_budget


@dataclass
class Recency(Policy):
    """Evict the oldest entry whenever the cache is over budget."""

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        return lowest(positions.float(), positions, over_budget(positions, budget))

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.float()

    def cache_bound(self, budget: int, step: int) -> int:
        return budget
