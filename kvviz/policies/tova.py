"""TOVA: every step, drop the entry the newest query attends to least.

Original TOVA decides per layer with that layer's head-mean attention; kvviz keeps one token-level keep
set, so the score here is the head- and layer-mean last-query attention of the current step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import Policy, StepMean, lowest, over_budget


@dataclass
class TOVA(Policy):
    """Token Omission Via Attention: keep the top-``B`` by this step's last-query attention."""

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        self.step_mean = StepMean()

    def wants_scores(self, step: int) -> bool:
        return True

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        self.step_mean.clear()

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        self.step_mean.add(view.attn.mean(0), positions)

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        return lowest(self.step_mean.mean(positions), positions, over_budget(positions, budget))

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        return self.step_mean.mean(positions)

    def raw_scores(self, positions: torch.Tensor) -> torch.Tensor:
        return self.step_mean.mean(positions)

    def cache_bound(self, budget: int, step: int) -> int:
        return budget
