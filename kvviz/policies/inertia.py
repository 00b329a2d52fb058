"""InertiaKV: layer-sequential EMA of last-query attention, with its Lazy-refresh and Score-Free points.

InertiaKV (§3, Appendix E) keeps one utility ``m`` per cached token.  On a scoring step every eligible layer
``l`` updates the shared state in layer order, ``m <- a*m + (1-a)*s_l``, where ``s_l`` is the head-mean
float32 softmax of the newest query over the cached keys.  With ``K`` eligible layers the previous step
therefore keeps weight ``a**K`` (0.8**30 ~ 0.001 on SmolLM2-135M): alpha sets layer weighting and temporal
memory together.  After the forward pass the lowest-``m`` tokens are evicted until the cache holds ``B``
(ties: older first).  ``m`` starts at 0 for prompt tokens; a new token enters at 0 on a scoring step and at
the mean ``m`` of the tokens already cached on a non-scoring step.

The same rule gives the paper's operating points and ablations (see the registry presets):

* ``refresh=r``  -- score on steps 1, 1+r, 1+2r, ... (Lazy refresh); other steps compute no scores;
* ``refresh=0``  -- score on step 1 only, then freeze (Score-Free);
* ``alpha=0``    -- single-step: ``m`` is the last eligible layer's scores of the last scoring step;
* ``aggregation="sum"`` -- cumulative, ``m <- m + s_l`` (H2O-style accumulation, no decay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import Policy, lowest, over_budget, param


def attention_score(view: LayerView) -> torch.Tensor:
    """Head-mean last-query attention, ``(n,)``."""
    return view.attn.mean(0)


def vnorm_score(view: LayerView) -> torch.Tensor:
    """Each head's attention times its value norms normalised to mean 1 over the cache, then head-mean."""
    norms = view.value_norms()
    return (view.attn * norms / norms.mean(-1, keepdim=True)).mean(0)


def entropy_score(view: LayerView) -> torch.Tensor:
    """Head-mean attention weighted by the layer's normalised entropy (mean over heads of H / log n)."""
    attn = view.attn
    n = attn.shape[-1]
    if n < 2:
        return attn.mean(0)
    entropy = -(attn * attn.clamp_min(1e-30).log()).sum(-1) / math.log(n)
    return entropy.mean() * attn.mean(0)


SCORERS = {"attention": attention_score, "vnorm": vnorm_score, "entropy": entropy_score}


@dataclass
class InertiaKV(Policy):
    """Layer-sequential EMA of last-query attention (InertiaKV), evicting the lowest utility to budget ``B``."""

    alpha: float = param(0.8, low=0.0, high=1.0, help="EMA coefficient; the previous step keeps alpha**K")
    refresh: int = param(1, low=0, high=64, help="score every r-th step (1 = every step, 0 = only step 1)")
    aggregation: str = param("ema", choices=("ema", "sum"), help="ema: a*m + (1-a)*s; sum: m + s (cumulative)")
    scorer: str = param("attention", choices=tuple(SCORERS), help="per-layer score fed to the aggregation")
    layers: str = param("all", help="eligible layers: 'all' or comma-separated indices, e.g. '0,5,10'")

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.refresh < 0:
            raise ValueError(f"refresh must be >= 1 (or 0 for score-free), got {self.refresh}")
        if self.aggregation not in ("ema", "sum"):
            raise ValueError(f"aggregation must be 'ema' or 'sum', got {self.aggregation!r}")
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {sorted(SCORERS)}, got {self.scorer!r}")
        self._eligible = None if self.layers == "all" else {int(i) for i in str(self.layers).split(",")}

    def reset(self, prompt_len: int, budget: int) -> None:
        super().reset(prompt_len, budget)
        self.m = torch.zeros(prompt_len + 64, dtype=torch.float32)

    def wants_scores(self, step: int) -> bool:
        if self.refresh == 0:
            return step == 1
        return (step - 1) % self.refresh == 0

    def wants_layer(self, layer: int) -> bool:
        return self._eligible is None or layer in self._eligible

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        if new_position >= self.m.numel():
            self.m = torch.cat([self.m, torch.zeros(self.m.numel(), dtype=torch.float32)])
        entering = 0.0 if self.wants_scores(step) or cached.numel() == 0 else self.m[cached].mean()
        self.m[new_position] = entering

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        score = SCORERS[self.scorer](view).to("cpu")
        if self.aggregation == "sum":
            self.m[positions] += score
        else:
            self.m[positions] = self.alpha * self.m[positions] + (1.0 - self.alpha) * score

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        return lowest(self.m[positions], positions, over_budget(positions, budget))

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        return self.m[positions]

    def cache_bound(self, budget: int) -> int:
        return budget
