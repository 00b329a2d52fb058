"""InertiaKV: layer-sequential EMA of last-query attention, with its Lazy-refresh and Score-Free points.

InertiaKV (§3, Appendix E) keeps one utility ``m`` per cached token.  On a scoring step every eligible layer
``l`` updates the shared state in layer order, ``m <- a*m + (1-a)*s_l``, where ``s_l`` is the head-mean
float32 softmax of the newest query over the cached keys.  With ``K`` eligible layers the previous step
therefore keeps weight ``a**K`` (0.8**30 ~ 0.001 on SmolLM2-135M): alpha sets layer weighting and temporal
memory together.  After the forward pass the lowest-``m`` tokens are evicted until the cache holds ``B``
(ties: older first), once per step with one keep set for all layers (§3.1 would also admit evicting
layer by layer inside the forward).  ``m`` starts at 0 for prompt tokens; a new token enters at 0 on a scoring
step and at the mean ``m`` of the tokens already cached on a non-scoring step.

The same rule gives the paper's operating points and ablations (see the registry presets):

* ``refresh=r``  -- score on steps 1, 1+r, 1+2r, ... (Lazy refresh); other steps compute no scores;
* ``refresh=0``  -- score on step 1 only, then freeze (Score-Free);
* ``alpha=0``    -- single-step: ``m`` is the last eligible layer's scores of the last scoring step;
* ``aggregation="sum"`` -- cumulative, ``m <- m + s_l`` (H2O-style accumulation, no decay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import Policy, StepMean, grown, lowest, over_budget, param
from .scorers import SCORERS


@dataclass
class InertiaKV(Policy):
    """Layer-sequential EMA of last-query attention (InertiaKV), evicting the lowest utility to budget ``B``."""

    alpha: float = param(0.8, low=0.0, high=1.0, help="EMA coefficient; the previous step keeps alpha**K")
    refresh: int = param(1, low=0, high=64, help="score every r-th step (1 = every step, 0 = only step 1)")
    aggregation: str = param("ema", choices=("ema", "sum"), help="ema: a*m + (1-a)*s; sum: m + s (cumulative)")
    scorer: str = param("attention", choices=tuple(SCORERS), help="per-layer score fed to the aggregation")
    layers: str = param("all", help="eligible layers: 'all' or comma-separated indices, e.g. '0,5,10'")

    def records_attention(self) -> bool:
        return self.scorer == "attention"

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.refresh < 0:
            raise ValueError(f"refresh must be >= 1 (or 0 for score-free), got {self.refresh}")
        if self.aggregation not in ("ema", "sum"):
            raise ValueError(f"aggregation must be 'ema' or 'sum', got {self.aggregation!r}")
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {sorted(SCORERS)}, got {self.scorer!r}")
        self._eligible = None
        if self.layers != "all":
            pieces = [piece.strip() for piece in str(self.layers).split(",")]
            # ASCII digits only: int() would also read '0_5' as 5 and other scripts' digits.
            if not all(piece.isascii() and piece.isdigit() for piece in pieces):
                raise ValueError(f"layers must be 'all' or comma-separated layer indices (0 and up) such as "
                                 f"'0,5,10', got {self.layers!r}")
            self._eligible = {int(piece) for piece in pieces}
            # One spelling per set ('5,0,5' is '0,5'): a setting's label and a sweep's cell key name the set.
            self.layers = ",".join(str(layer) for layer in sorted(self._eligible))

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        if num_layers and self._eligible is not None and max(self._eligible) >= num_layers:
            # Otherwise no layer would ever score and the policy would silently keep the newest tokens.
            raise ValueError(f"layers={self.layers!r} names a layer beyond this model's {num_layers} layers "
                             f"(indices 0 to {num_layers - 1})")
        super().reset(prompt_len, budget, num_layers)
        self.m = torch.zeros(prompt_len + 64, dtype=torch.float32)
        self.raw = StepMean()

    def wants_scores(self, step: int) -> bool:
        if self.refresh == 0:
            return step == 1
        return (step - 1) % self.refresh == 0

    def wants_layer(self, layer: int) -> bool:
        return self._eligible is None or layer in self._eligible

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        self.m = grown(self.m, new_position)
        self.raw.clear()
        # Summed in float64 so that the mean does not depend on the order of the entries: under
        # Score-Free consecutive new tokens differ by about one float32 ulp, and the static path
        # (kvviz.fast), which holds the same entries in slot order, must pick the same one to evict.
        entering = 0.0 if self.wants_scores(step) or cached.numel() == 0 else \
            float(self.m[cached].double().mean())
        self.m[new_position] = entering

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        score = SCORERS[self.scorer](view, positions).to("cpu")
        self.raw.add(score, positions)
        if self.aggregation == "sum":
            self.m[positions] += score
        else:
            self.m[positions] = self.alpha * self.m[positions] + (1.0 - self.alpha) * score

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        return lowest(self.m[positions], positions, over_budget(positions, budget))

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        return self.m[positions]

    def raw_scores(self, positions: torch.Tensor) -> torch.Tensor | None:
        return self.raw.mean(positions)

    def cache_bound(self, budget: int, step: int) -> int:
        return budget

    def unused(self) -> dict[str, str]:
        return {"alpha": "aggregation is 'sum' (m + s never decays)"} if self.aggregation == "sum" else {}

    def previous_step_weight(self, num_layers: int) -> float | None:
        if self.refresh == 0:  # Score-Free: one scoring step, so no previous step to weigh
            return None
        if self.aggregation == "sum":
            return 1.0
        layers = num_layers if self._eligible is None else len(self._eligible)
        return self.alpha ** layers
