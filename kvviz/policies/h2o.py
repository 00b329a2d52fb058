"""H2O: heavy hitters (accumulated attention) plus a window of the most recent tokens.

Original H2O accumulates per head; kvviz keeps one token-level set, so the accumulated score is the sum over
steps of the head- and layer-mean last-query attention.  The most recent ``recent`` share of the budget is
always kept; the rest of the budget goes to the highest accumulated scores.

Accumulation starts at the first decode step, from 0: the original also sums the prompt queries'
attention and evicts during prefill, so here the prompt's heavy hitters are first chosen by step 1's
attention alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import NO_SLOTS, Policy, StepMean, grown, lowest, over_budget, param


@dataclass
class H2O(Policy):
    """Heavy-Hitter Oracle: accumulated attention, plus a recent window of ``recent * B`` tokens."""

    recent: float = param(0.5, low=0.0, high=1.0, help="share of the budget kept for the most recent tokens")

    def records_attention(self) -> bool:
        return True

    def __post_init__(self):
        if not 0.0 <= self.recent <= 1.0:
            raise ValueError(f"recent must be in [0, 1], got {self.recent}")

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        self.accumulated = torch.zeros(prompt_len + 64)
        self.step_mean = StepMean()

    def wants_scores(self, step: int) -> bool:
        return True

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        self.accumulated = grown(self.accumulated, new_position)
        self.step_mean.clear()

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        self.step_mean.add(view.attn.mean(0), positions)

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        if self.step_mean.layers:
            self.accumulated[positions] += self.step_mean.mean(positions)
        count = over_budget(positions, budget)
        if count == 0:
            return NO_SLOTS
        window = int(self.recent * budget)
        newest = int(positions.max())
        old = torch.nonzero(positions <= newest - window).flatten()
        return old[lowest(self.accumulated[positions[old]], positions[old], count)]

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        return self.accumulated[positions]

    def raw_scores(self, positions: torch.Tensor) -> torch.Tensor | None:
        return self.step_mean.mean(positions)

    def pinned(self, budget: int) -> tuple[int, int]:
        return 0, int(self.recent * budget)

    def cache_bound(self, budget: int, step: int) -> int:
        return budget
