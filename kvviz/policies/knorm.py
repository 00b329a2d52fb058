"""K-norm: keep low-norm keys, which tend to draw attention (no attention needed).

Recomputed from the cached keys every step and averaged over KV heads and layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import StepScorePolicy
from .scorers import knorm_score


@dataclass
class KNorm(StepScorePolicy):
    """Keep low-norm keys (they tend to draw attention): score = -||k_i|| / mean ||k||."""

    def score(self, view: LayerView, positions: torch.Tensor) -> torch.Tensor:
        return knorm_score(view, positions)
