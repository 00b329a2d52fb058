"""TOVA: every step, drop the entry the newest query attends to least.

Original TOVA decides per layer with that layer's head-mean attention; kvviz keeps one token-level keep
set, so the score here is the head- and layer-mean last-query attention of the current step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import StepScorePolicy


@dataclass
class TOVA(StepScorePolicy):
    """Token Omission Via Attention: keep the top-``B`` by this step's last-query attention."""

    def score(self, view: LayerView, positions: torch.Tensor) -> torch.Tensor:
        return view.attn.mean(0)
