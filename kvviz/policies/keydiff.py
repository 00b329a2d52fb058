"""KeyDiff: keep keys that differ most from the cache's mean direction (no attention needed).

Recomputed from the cached keys every step and averaged over KV heads and layers (the original selects
per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import StepScorePolicy
from .scorers import keydiff_score


@dataclass
class KeyDiff(StepScorePolicy):
    """Keep keys least similar to the mean normalised key: score = -cos(k_i, mean of normalised keys)."""

    def score(self, view: LayerView, positions: torch.Tensor) -> torch.Tensor:
        return keydiff_score(view, positions)
