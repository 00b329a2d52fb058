"""Decoupled InertiaKV: layer weighting and temporal memory as two separate knobs.

InertiaKV's layer-sequential EMA gives the previous step weight ``alpha**K`` for ``K`` scoring layers
(0.8**30 ~ 0.001 on a 30-layer model): at the default alpha there is almost no memory across steps, a
coupling the paper names as a limitation.  Here each scoring step first combines its layers into one
score ``s_t`` (uniform mean, or the mean of the last ``last_k`` layers), then applies one temporal EMA,
``m_t = alpha * m_(t-1) + (1 - alpha) * s_t``, so the previous step keeps exactly ``alpha``.  Refresh
schedule, scorers and eviction follow InertiaKV.

An entry's first scored step sets its memory to that step's score, ``m = s``, the EMA started at its first
observation.  InertiaKV starts entries at 0 but gives the first score ``K`` layer updates, weight
``1 - alpha**K`` (0.999 at K = 30); one update from 0 here would weigh it ``1 - alpha`` (0.2), and a new
token would have to be read 5x more than the boundary entry to survive its first step -- a penalty on recent
tokens that the decoupling was not meant to add.  Between refreshes a new token enters at the mean of the
cached entries, as in InertiaKV, and counts as observed from its first scoring on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import grown, param
from .inertia import InertiaKV
from .scorers import SCORERS


@dataclass
class DecoupledInertiaKV(InertiaKV):
    """One EMA per step over a layer-averaged score; previous-step weight = alpha."""

    # Redeclared only for its help: InertiaKV's says alpha**K, which is the coupling this policy removes.
    alpha: float = param(0.8, low=0.0, high=1.0, help="EMA coefficient per step; the previous step keeps alpha")
    # Redeclared with one choice: a sum over steps has no per-step weight to decouple ('cumulative' is that).
    aggregation: str = param("ema", choices=("ema",), help="ema: one a*m + (1-a)*s per step")
    layer_weighting: str = param("mean", choices=("mean", "last"), help="mean of all layers, or of the last k")
    last_k: int = param(8, low=1, high=128, help="layers averaged when layer_weighting='last'")

    def __post_init__(self):
        super().__post_init__()
        if self.aggregation != "ema":
            raise ValueError("inertia-decoupled is an EMA; use 'cumulative' for a sum")
        if self.layer_weighting not in ("mean", "last"):
            raise ValueError(f"layer_weighting must be 'mean' or 'last', got {self.layer_weighting!r}")
        if self.last_k < 1:
            raise ValueError(f"last_k must be >= 1, got {self.last_k}")

    def unused(self) -> dict[str, str]:
        if self.layer_weighting == "last":  # the last k layers score, whatever `layers` names
            return {"layers": "layer_weighting is 'last' (last_k picks the layers)"}
        return {"last_k": "layer_weighting is 'mean' (every eligible layer counts)"}

    def wants_layer(self, layer: int) -> bool:
        if self.layer_weighting == "last" and self.num_layers:
            return layer >= self.num_layers - self.last_k
        return super().wants_layer(layer)

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        self.observed = torch.zeros(prompt_len + 64, dtype=torch.bool)  # scored at least once

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        super().begin_step(step, cached, new_position)
        self.observed = grown(self.observed, new_position)

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        self.raw.add(SCORERS[self.scorer](view, positions), positions)  # the EMA waits for all layers

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        # Called once per step, after every layer was seen: the step's single EMA update happens here.
        if self.raw.layers:
            score = self.raw.mean(positions)
            first = ~self.observed[positions]  # the EMA starts at its first observation: m = s
            self.m[positions] = torch.where(first, score, self.alpha * self.m[positions] + (1.0 - self.alpha) * score)
            self.observed[positions] = True
        return super().select_evictions(step, positions, budget)

    def previous_step_weight(self, num_layers: int) -> float | None:
        return None if self.refresh == 0 else self.alpha  # Score-Free scores once: no previous step
