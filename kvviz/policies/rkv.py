"""R-KV: redundancy-aware compression for reasoning traces.

At a checkpoint (every ``interval``-th generated token, if the cache is over B) each candidate
(everything but the last ``window`` entries) gets

* importance: attention from the last ``observe_window`` decode queries (softmax, mean over queries and heads;
  ``prompt_queries=True`` lets the prompt's last queries fill the window while fewer decode queries exist, as
  AvoKV-E does by default), max-pooled over ``kernel`` neighbouring positions;
* redundancy: mean cosine of its key to the other candidates' keys, softmax over the candidates;

and ``score = lam * importance - (1 - lam) * redundancy``.  The top ``B - window`` candidates stay.
Scores are averaged over layers and heads (the original selects per head).  The redundancy term is the
plain mean cosine to the other candidates: the official code also thresholds similarities (0.5) and
keeps only the newest of a group of similar keys, which this simpler form leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import param
from .checkpointed import QueryWindowPolicy, window_attention


@dataclass
class RKV(QueryWindowPolicy):
    """R-KV with lambda = 0.1, the setting AvoKV-E compares against."""

    lam: float = param(0.1, low=0.0, high=1.0, help="importance weight (1 - lam weighs redundancy)")
    window: int = param(8, low=0, high=512, help="most recent entries always kept")
    kernel: int = param(7, low=1, high=63, help="max-pooling width over neighbouring positions (odd)")

    def __post_init__(self):
        super().__post_init__()
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd number, got {self.kernel}")

    def protected(self, budget: int) -> int:
        return self.window

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        self.reset_budget_check(budget, self.window, "R-KV (recent window)", "window")

    def pinned(self, budget: int) -> tuple[int, int]:
        return 0, self.window

    def layer_features(self, view, positions, queries, query_positions):
        """``importance`` and ``redundancy`` of the ``c`` candidates at this layer, each ``(c,)`` (head means).

        ``view`` holds keys ``(num_kv_heads, n, head_dim)``, ``positions`` is ``(n,)``, ``queries``
        ``(w, num_heads, head_dim)`` at ``query_positions`` ``(w,)``; see :meth:`QueryWindowPolicy.layer_features`.
        """
        cand = self.candidates
        attn = window_attention(queries, query_positions, view, positions)[:, :, cand].mean((0, 1))
        order = torch.argsort(positions[cand])  # pool over neighbours in position order
        pooled = F.max_pool1d(attn[order][None, None], self.kernel, stride=1, padding=self.kernel // 2)[0, 0]
        importance = torch.empty_like(pooled)
        importance[order] = pooled
        unit = F.normalize(view.keys[:, cand].float(), dim=-1)
        count = cand.numel()
        mean_cosine = ((unit @ unit.transpose(1, 2)).sum(-1) - 1.0) / max(count - 1, 1)  # exclude self
        redundancy = torch.softmax(mean_cosine, dim=-1).mean(0)
        return {"importance": importance, "redundancy": redundancy}

    def terms_key(self) -> str:
        return (f"score = {self.lam:g}·importance − {1 - self.lam:g}·redundancy; importance: attention from the last "
                f"{self.observe_window} queries, max-pooled over {self.kernel} neighbours; redundancy: mean key cosine "
                "to the other candidates, softmax over them; layer means; the lowest scores go first")

    def risk(self, features, positions):
        """``lam * importance - (1 - lam) * redundancy``, ``(c,)``, from the layer-mean features (each ``(c,)``)."""
        return self.lam * features["importance"] - (1 - self.lam) * features["redundancy"]
