"""R-KV: redundancy-aware compression for reasoning traces.

At a checkpoint (every ``interval``-th generated token, if the cache is over B) each candidate
(everything but the last ``window`` entries) gets

* importance: attention from the last ``observe_window`` decode queries, mean over the queries, max-pooled
  over ``kernel`` neighbouring positions (``prompt_queries=True`` lets the prompt's last queries fill the
  window while fewer decode queries exist, as AvoKV-E does by default).  How the query heads and keys are
  pooled is ``pooling``:

  - ``"official"`` (the default), as R-KV's code computes it: per KV head, the maximum over its group of
    query heads of the attention logits, then a softmax over the candidates alone (the recent window's keys
    take no share), the mean over the queries, the max-pooling per KV head, and last the mean over KV heads;
  - ``"head-mean"``, what kvviz did before (and the rows written before the parameter ran): a softmax per
    query head over every cached key, the mean over queries and query heads, then the max-pooling;

* redundancy: how much of its key the other keys repeat.  How is ``redundancy``:

  - ``"official"`` (the default), as R-KV's code computes it: per KV head, the cosine of every pair of cached
    keys (the recent window's too), zero on the diagonal; for each key, its similarity to the newest other key
    whose cosine passes 0.5 is zeroed, so the newest of a group of similar keys counts as less redundant;
    then each key's mean similarity over all keys, a softmax over all keys, read at the candidates;
  - ``"mean-cosine"``, what kvviz did before: the mean cosine to the other candidates, a softmax over the
    candidates;

  both then the mean over KV heads;

and ``score = lam * importance - (1 - lam) * redundancy``.  The top ``B - window`` candidates stay.
Scores are averaged over layers and heads (the original selects per KV head; with ``"official"`` pooling the
score is the mean over KV heads and layers of the per-head scores the original ranks by).  "Newest" is by
position: the official code reads it from slot order, which its compaction leaves in score order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from .base import param
from .checkpointed import QueryWindowPolicy, window_attention

POOLINGS = ("official", "head-mean")
REDUNDANCIES = ("official", "mean-cosine")
SIMILAR = 0.5  # R-KV's code: two keys whose cosine passes this are similar


def pool_neighbours(scores: torch.Tensor, positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool each row of ``scores`` over ``kernel`` neighbouring positions (not slots; the ends padded by
    nothing).

    Parameters
    ----------
    scores : torch.Tensor
        ``(rows, c)`` one score per candidate and row (a KV head, or one row of head means).
    positions : torch.Tensor
        ``(c,)`` the candidates' absolute positions, in the order of ``scores``' columns.
    kernel : int
        The odd pooling width.

    Returns
    -------
    torch.Tensor
        ``(rows, c)`` pooled scores, in the candidates' order.
    """
    order = torch.argsort(positions.to(scores.device))
    pooled = F.max_pool1d(scores[:, order][None], kernel, stride=1, padding=kernel // 2)[0]
    out = torch.empty_like(pooled)
    out[:, order] = pooled
    return out


def group_max_attention(queries: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor,
                        key_positions: torch.Tensor, scaling: float) -> torch.Tensor:
    """R-KV's attention of the buffered queries to the candidates, one row per KV head.

    Per KV head, the logits of each query are the maximum over the head's group of query heads, and the
    softmax runs over the given keys alone (the candidates: the recent window takes no share).  A query sees
    no key newer than itself; one that sees none of them adds nothing.

    Parameters
    ----------
    queries : torch.Tensor
        ``(w, num_heads, head_dim)`` post-RoPE queries, query head ``h`` in KV head ``h // (num_heads /
        num_kv_heads)``'s group (Hugging Face's ``repeat_kv`` order).
    query_positions : torch.Tensor
        ``(w,)`` their absolute positions.
    keys : torch.Tensor
        ``(num_kv_heads, c, head_dim)`` the candidates' keys.
    key_positions : torch.Tensor
        ``(c,)`` their absolute positions.
    scaling : float
        The model's softmax scale.

    Returns
    -------
    torch.Tensor
        ``(num_kv_heads, c)`` float32: the mean over the queries that see a candidate of their softmax.
    """
    window, heads, dim = queries.shape
    num_kv = keys.shape[0]
    grouped = queries.float().permute(1, 0, 2).reshape(num_kv, heads // num_kv, window, dim)
    logits = torch.matmul(grouped, keys.float()[:, None].transpose(2, 3)).amax(1) * scaling  # (kv, w, c)
    future = key_positions.to(logits.device)[None, :] > query_positions.to(logits.device)[:, None]
    attention = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1).nan_to_num(0.0)
    seeing = (~future).any(-1).sum().clamp(min=1)
    return attention.sum(1) / seeing


def official_redundancy(keys: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """R-KV's redundancy of the candidates, per KV head, as its code computes it (see the module docstring).

    Parameters
    ----------
    keys : torch.Tensor
        ``(num_kv_heads, n, head_dim)`` every cached key, in slot order.
    positions : torch.Tensor
        ``(n,)`` each slot's absolute position.
    candidates : torch.Tensor
        ``(c,)`` the slots scored.

    Returns
    -------
    torch.Tensor
        ``(num_kv_heads, c)`` float32, each row a softmax over all ``n`` keys read at the candidates.
    """
    order = torch.argsort(positions.to(keys.device))
    ordered = keys[:, order].float()
    unit = ordered / (ordered.norm(dim=-1, keepdim=True) + 1e-8)
    cosine = unit @ unit.transpose(1, 2)
    cosine.diagonal(dim1=1, dim2=2).zero_()
    index = torch.arange(cosine.shape[-1], device=keys.device)
    newest = torch.where(cosine > SIMILAR, index, 0).amax(-1)  # 0 where none is similar, as in R-KV's code
    cosine.scatter_(-1, newest[..., None], 0.0)
    redundancy = torch.empty_like(cosine[:, 0])
    redundancy[:, order] = cosine.mean(1).softmax(-1)
    return redundancy[:, candidates.to(keys.device)]


@dataclass
class RKV(QueryWindowPolicy):
    """R-KV with lambda = 0.1, the setting AvoKV-E compares against."""

    lam: float = param(0.1, low=0.0, high=1.0, help="importance weight (1 - lam weighs redundancy)")
    window: int = param(8, low=0, high=512, help="most recent entries always kept")
    kernel: int = param(7, low=1, high=63, help="max-pooling width over neighbouring positions (odd)")
    pooling: str = param("official", choices=POOLINGS, help="official: max over each KV head's query group of "
                         "the logits, softmax over the candidates; head-mean: softmax per query head over "
                         "every key, mean over heads (kvviz before 2026-12-07)")
    redundancy: str = param("official", choices=REDUNDANCIES, help="official: R-KV's code (similar keys past 0.5, "
                            "the newest of them spared; softmax over every key); mean-cosine: the mean cosine to "
                            "the other candidates, softmax over them (kvviz before 2026-12-08)")

    # Rows stored before ``pooling`` and ``redundancy`` existed ran the head means and the mean cosine.
    added_parameters: ClassVar[dict[str, Any]] = {"pooling": "head-mean", "redundancy": "mean-cosine"}

    def __post_init__(self):
        super().__post_init__()
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd number, got {self.kernel}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.redundancy not in REDUNDANCIES:
            raise ValueError(f"redundancy must be one of {', '.join(REDUNDANCIES)}, got {self.redundancy!r}")

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
        if self.pooling == "official":
            attention = group_max_attention(queries, query_positions, view.keys[:, cand], positions[cand],
                                            view.scaling)
            importance = pool_neighbours(attention, positions[cand], self.kernel).mean(0)
        else:  # head-mean: a softmax per query head over every key, head and query means, then the pooling
            attention = window_attention(queries, query_positions, view, positions)[:, :, cand].mean((0, 1))
            importance = pool_neighbours(attention[None], positions[cand], self.kernel)[0]
        if self.redundancy == "official":
            redundancy = official_redundancy(view.keys, positions, cand).mean(0)
        else:  # mean-cosine: among the candidates alone
            unit = F.normalize(view.keys[:, cand].float(), dim=-1)
            count = cand.numel()
            mean_cosine = ((unit @ unit.transpose(1, 2)).sum(-1) - 1.0) / max(count - 1, 1)  # exclude self
            redundancy = torch.softmax(mean_cosine, dim=-1).mean(0)
        return {"importance": importance, "redundancy": redundancy}

    def terms_key(self) -> str:
        pooled = ("the group's largest logit per KV head, softmax over the candidates" if self.pooling == "official"
                  else "softmax per query head over every key, head means")
        similar = ("mean key cosine to every key, the newest similar one (past 0.5) spared, softmax over them"
                   if self.redundancy == "official" else "mean key cosine to the other candidates, softmax over them")
        return (f"score = {self.lam:g}·importance − {1 - self.lam:g}·redundancy; importance: attention from the last "
                f"{self.observe_window} queries ({pooled}), max-pooled over {self.kernel} neighbours; redundancy: "
                f"{similar}; layer means; the lowest scores go first")

    def risk(self, features, positions):
        """``lam * importance - (1 - lam) * redundancy``, ``(c,)``, from the layer-mean features (each ``(c,)``)."""
        return self.lam * features["importance"] - (1 - self.lam) * features["redundancy"]
