"""KeyDiff: keep keys that differ most from the cache's mean direction (no attention needed).

Recomputed from the cached keys every step and averaged over KV heads and layers (the original selects
per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import Policy, StepMean, lowest, over_budget
from .inertia import keydiff_score


@dataclass
class KeyDiff(Policy):
    """Keep keys least similar to the mean normalised key: score = -cos(k_i, mean of normalised keys)."""

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        self.step_mean = StepMean()

    def wants_scores(self, step: int) -> bool:
        return True

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        self.step_mean.clear()

    def score(self, view: LayerView, positions: torch.Tensor) -> torch.Tensor:
        return keydiff_score(view, positions)

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        self.step_mean.add(self.score(view, positions), positions)

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        return lowest(self.step_mean.mean(positions), positions, over_budget(positions, budget))

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        return self.step_mean.mean(positions)

    def raw_scores(self, positions: torch.Tensor) -> torch.Tensor:
        return self.step_mean.mean(positions)

    def cache_bound(self, budget: int, step: int) -> int:
        return budget
