"""TOVA: every step, drop the entry the newest query attends to least.

Original TOVA decides per layer with that layer's head-mean attention; kvviz keeps one token-level keep
set, so the score here is the head- and layer-mean last-query attention of the current step.
Decode-time only: the prompt is prefilled whole and step 1 evicts ``L0 + 1 - B`` entries at once (the
TOVA the InertiaKV paper compares also evicts during prefill, which changes prefill memory, not the rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import StepScorePolicy


@dataclass
class TOVA(StepScorePolicy):
    """Token Omission Via Attention: keep the top-``B`` by this step's last-query attention."""

    def records_attention(self) -> bool:
        return True

    def score(self, view: LayerView, positions: torch.Tensor) -> torch.Tensor:
        return view.attn.mean(0)
