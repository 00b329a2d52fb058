"""SnapKV: compress the prompt once, at prefill, by what its last ``window`` queries attend to.

Each prompt position before the window is scored by the attention of the last ``window`` prompt queries
(head-, query- and layer-mean; the original selects per head), smoothed as in the original by average
pooling over ``kernel`` neighbours among those positions (zero padding counted at the ends, the window's
own votes left out); the cache keeps the window itself plus the top ``B - window`` other positions.

During decoding SnapKV, like the original, evicts nothing: generated tokens accumulate, so after step
``k`` the cache holds ``B + k`` entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..scoring import PrefillView
from .base import NO_SLOTS, BudgetTooSmall, Policy, StepMean, lowest, param


@dataclass
class SnapKV(Policy):
    """Prefill-time selection by an observation window of prompt queries, pooled over neighbours."""

    window: int = param(32, low=1, high=512, help="last prompt queries that vote (always kept)")
    kernel: int = param(7, low=1, high=63, help="average-pooling width over neighbouring positions (odd)")

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd number, got {self.kernel}")

    @property
    def prefill_window(self) -> int:
        return self.window

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        if budget < prompt_len and budget <= self.window:
            raise BudgetTooSmall(budget, self.window, f"SnapKV's observation window of {self.window} tokens",
                                 "window")
        super().reset(prompt_len, budget, num_layers)
        self.votes = StepMean()
        self.score = None  # set by the prefill's selection; None keeps a reused policy from reporting stale scores

    def observe_prefill(self, view: PrefillView, positions: torch.Tensor) -> None:
        self.votes.add(view.attn.mean((0, 1)), positions)

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        count = positions.numel() - budget
        if step != 0 or count <= 0:
            return NO_SLOTS
        order = torch.argsort(positions)
        ordered = positions[order]
        voted = ordered < self.prompt_len - self.window  # the window itself always stays
        pooled = F.avg_pool1d(self.votes.mean(ordered[voted])[None, None], self.kernel, stride=1,
                              padding=self.kernel // 2)[0, 0]
        in_order = torch.full((positions.numel(),), float("inf"))
        in_order[voted] = pooled
        score = torch.empty_like(in_order)
        score[order] = in_order
        self.score = torch.zeros(int(positions.max()) + 1)
        self.score[positions] = score
        return lowest(score, positions, count)

    def utility(self, positions: torch.Tensor) -> torch.Tensor | None:
        if self.score is None:
            return None
        known = positions < self.score.numel()
        return torch.where(known, self.score[positions.clamp(max=self.score.numel() - 1)], float("inf"))

    def cache_bound(self, budget: int, step: int) -> int:
        return budget + step
