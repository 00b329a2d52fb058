"""Random: evict uniformly at random among the cached entries (seeded), the floor every policy must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, over_budget, param


@dataclass
class RandomEviction(Policy):
    """Each step, drop entries chosen uniformly at random until the cache holds ``B``."""

    seed: int = param(0, low=0, high=2**31 - 1, help="random seed")

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        self.generator = torch.Generator().manual_seed(self.seed)

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        count = over_budget(positions, budget)
        return torch.randperm(positions.numel(), generator=self.generator)[:count]

    def cache_bound(self, budget: int, step: int) -> int:
        return budget
