"""StreamingLLM: the first ``sinks`` tokens (attention sinks) plus the most recent ``B - sinks``.

Keys keep the RoPE positions they were written with (as in kvpress); the original re-indexes positions
within the cache, which matters once generation runs past the model's trained context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BudgetTooSmall, Policy, lowest, over_budget, param


@dataclass
class StreamingLLM(Policy):
    """Attention sinks plus a sliding window; needs no scores."""

    sinks: int = param(4, low=0, high=64, help="initial tokens always kept")

    def __post_init__(self):
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        if budget <= self.sinks:
            raise BudgetTooSmall(budget, self.sinks, f"the {self.sinks} sink tokens StreamingLLM always keeps", "sinks")
        super().reset(prompt_len, budget, num_layers)

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        # Sinks are the oldest entries, so give them an infinite utility and evict the oldest of the rest.
        utility = positions.float()
        utility[positions < self.sinks] = float("inf")
        return lowest(utility, positions, over_budget(positions, budget))

    def pinned(self, budget: int) -> tuple[int, int]:
        return self.sinks, 0

    def cache_bound(self, budget: int, step: int) -> int:
        return budget
