"""Expected Attention: keep what future queries are expected to attend to, judged from past queries.

Devoto et al. 2025 (kvpress's ``ExpectedAttentionPress``): the scorer of the "AdaKV + Expected Attention"
baseline in InertiaKV's Tables 1 and 4.  Each head's queries *before* RoPE are modelled as Gaussian with
the mean ``mu`` and covariance ``Sigma`` of the queries seen so far (the first ``sinks`` prompt positions
left out as outliers).  A query at a future position ``t + j`` is ``R_{t+j} q``; averaging the rotation
over the next ``future`` positions, ``R = mean_j R_{t+j}``, gives ``mu' = R mu`` and ``Sigma' = R Sigma R^T``,
and for a Gaussian query the expected exponentiated logit of key ``k`` is exact:

    log E[exp(s q.k)] = s mu'.k + s^2 k^T Sigma' k / 2        (s: the model's softmax scale)

These expected logits are softmax-normalised over the cache per head, averaged over the query heads of
each KV head and (``vnorm``) multiplied by the value norm, ``(p + epsilon) * |v|``; kvviz then averages
over KV heads and layers, since it keeps one keep set for the whole model (AdaKV's per-head budgets have
no equivalent here).  The first ``sinks`` positions are always kept.

kvpress rebuilds pre-RoPE queries from the hidden states and ``W_q``, which misses a query bias (Qwen2)
and rules out query norms (Qwen3); here they are the model's own post-RoPE queries rotated back by their
position, so any full-RoPE model works.

Prefill-time by default, as the InertiaKV paper compares it: the prompt is cut to ``B`` right after the
prefill and generated tokens accumulate (like SnapKV).  ``decode=True`` also keeps the cache at ``B``
while decoding: every step adds the newest query to the statistics and evicts the entry with the lowest
expected attention, its future window now starting after the newest token (kvpress's decoding press with
a compression interval of one step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers.models.llama.modeling_llama import rotate_half  # the RoPE pairing every supported family shares

from ..scoring import LayerView, PrefillView, rope_frequencies
from .base import NO_SLOTS, BudgetTooSmall, Policy, StepMean, grown, lowest, over_budget, param

ALL_PROMPT_QUERIES = 1 << 30  # the prefill window: every prompt query feeds the statistics
ROPE_REFUSAL = ("Expected Attention needs rotary position embeddings over the whole head with fixed frequencies; "
                "this model has none, rotates part of each head, or changes them with the sequence length "
                "(dynamic or LongRoPE scaling): choose another policy")


def rope_angles(rope: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotation angle of every dim at every position, ``(len(positions), head_dim)``, in float64."""
    freqs = positions.to(torch.float64)[:, None] * rope.to(positions.device, torch.float64)[None]
    return torch.cat((freqs, freqs), dim=-1)


def unrotate(queries: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE queries: ``R_p^{-1} q`` for post-RoPE ``queries`` ``(heads, w, head_dim)`` at ``positions`` ``(w,)``."""
    angles = rope_angles(rope, positions.to(queries.device))
    queries = queries.to(torch.float64)
    return queries * angles.cos() - rotate_half(queries) * angles.sin()


def mean_rotation(rope: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``mean_j R_{start + j}`` for ``j = 0 .. count - 1`` as a ``(head_dim, head_dim)`` float64 matrix."""
    angles = rope_angles(rope, torch.arange(start, start + count, device=rope.device))
    cos, sin = angles.cos().mean(0), angles.sin().mean(0)
    # R x = cos * x + sin * rotate_half(x); applied to the rows of the identity this gives R's columns.
    eye = torch.eye(cos.numel(), dtype=torch.float64, device=rope.device)
    return (cos * eye + sin * rotate_half(eye)).T


class QueryStats:
    """Running mean and covariance of one layer's pre-RoPE queries, per head (float64 sums)."""

    def __init__(self) -> None:
        self.count = 0
        self.total: torch.Tensor | None = None  # (heads, head_dim)
        self.outer: torch.Tensor | None = None  # (heads, head_dim, head_dim)

    def add(self, queries: torch.Tensor) -> None:
        """Fold in pre-RoPE ``queries`` of shape ``(heads, w, head_dim)``."""
        total, outer = queries.sum(1), queries.transpose(1, 2) @ queries
        if self.total is None:
            self.total, self.outer = total, outer
        else:
            self.total, self.outer = self.total + total, self.outer + outer
        self.count += queries.shape[1]

    def mean_cov(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(heads, head_dim)`` mean and ``(heads, head_dim, head_dim)`` population covariance."""
        mean = self.total / self.count
        return mean, self.outer / self.count - mean[:, :, None] * mean[:, None, :]


def expected_attention(keys: torch.Tensor, values: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor | None,
                       scaling: float, excluded: torch.Tensor, vnorm: bool, epsilon: float) -> torch.Tensor:
    """Expected attention of future queries ``N(mean, cov)`` (already rotated) on each cached entry.

    Parameters
    ----------
    keys, values : torch.Tensor
        Cached post-RoPE keys and values, ``(num_kv_heads, n, head_dim)``.
    mean, cov : torch.Tensor
        Per query head, ``(num_heads, head_dim)`` and ``(num_heads, head_dim, head_dim)``; ``cov=None``
        uses the mean query alone.
    excluded : torch.Tensor
        ``(n,)`` bool: entries left out of the softmax (the sinks, kept anyway); they score 0.

    Returns
    -------
    torch.Tensor
        ``(n,)`` float32: softmax over the cache per head, group-mean, ``(p + epsilon) * |v|`` if ``vnorm``,
        then the mean over KV heads.
    """
    num_kv, n, dim = keys.shape
    keys = keys.float()
    mean = mean.float().view(num_kv, -1, dim)  # (kv heads, group, dim)
    logits = scaling * (mean @ keys.transpose(1, 2))  # (kv heads, group, n)
    if cov is not None:
        spread = keys[:, None] @ cov.float().view(num_kv, -1, dim, dim)  # (kv heads, group, n, dim)
        logits = logits + scaling ** 2 / 2 * (spread * keys[:, None]).sum(-1)
    probs = torch.softmax(logits.masked_fill(excluded, float("-inf")), dim=-1).mean(1)  # (kv heads, n)
    if vnorm:
        probs = (probs + epsilon) * values.float().norm(dim=-1)
    return probs.masked_fill(excluded, 0.0).mean(0)


@dataclass
class ExpectedAttention(Policy):
    """Keep the entries future queries are expected to attend to most (Gaussian queries, averaged RoPE)."""

    prefill_window: ClassVar[int] = ALL_PROMPT_QUERIES

    future: int = param(512, low=1, high=65536, help="future positions the RoPE rotation is averaged over")
    sinks: int = param(4, low=0, high=64, help="first prompt tokens always kept and left out of the statistics")
    covariance: bool = param(True, help="use the queries' covariance as well as their mean")
    vnorm: bool = param(True, help="multiply the expected attention by the value norm")
    epsilon: float = param(0.0, low=0.0, high=1.0, help="added to the expected attention before the value norm")
    decode: bool = param(False, help="also evict at every decode step (False: cut the prompt at prefill only)")

    def __post_init__(self):
        if self.future < 1 or self.sinks < 0 or self.epsilon < 0:
            raise ValueError(f"future must be >= 1, sinks >= 0 and epsilon >= 0, got future={self.future}, "
                             f"sinks={self.sinks}, epsilon={self.epsilon}")

    def unused(self) -> dict[str, str]:
        return {} if self.vnorm else {"epsilon": "vnorm is false (it is added only before the value norm)"}

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        if budget <= self.sinks:
            raise BudgetTooSmall(budget, self.sinks, f"the {self.sinks} sink tokens Expected Attention always keeps",
                                 "sinks")
        super().reset(prompt_len, budget, num_layers)
        self.stats: dict[int, QueryStats] = {}
        self.step_mean = StepMean()
        self.score = torch.full((prompt_len + 64,), float("inf"))  # by position; inf: never judged
        self.rotation: torch.Tensor | None = None
        self.query_position = prompt_len - 1

    def check_model(self, model) -> None:
        if rope_frequencies(model) is None:
            raise ValueError(ROPE_REFUSAL)

    # -- statistics -----------------------------------------------------------------------------------
    def _rope(self, rope: torch.Tensor | None, dim: int) -> torch.Tensor:
        if rope is None or 2 * rope.numel() != dim:
            raise ValueError(ROPE_REFUSAL)
        return rope

    def _judge(self, layer: int, keys, values, scaling: float, rope: torch.Tensor, positions) -> None:
        """Score every cached entry of one layer against the next ``future`` positions' expected query."""
        if self.rotation is None:
            self.rotation = mean_rotation(rope.to(keys.device), self.query_position + 1, self.future)
        mean, cov = self.stats[layer].mean_cov()
        rotation = self.rotation.to(mean.device)
        mean = mean @ rotation.T
        cov = rotation @ cov @ rotation.T if self.covariance else None
        excluded = (positions < self.sinks).to(keys.device)
        score = expected_attention(keys, values, mean, cov, scaling, excluded, self.vnorm, self.epsilon)
        self.step_mean.add(score, positions)

    def observe_prefill(self, view: PrefillView, positions: torch.Tensor) -> None:
        rope = self._rope(view.rope, view.queries.shape[-1])
        n, window = view.keys.shape[1], view.queries.shape[1]
        query_positions = torch.arange(n - window, n)
        use = query_positions >= self.sinks
        if not use.any():  # a prompt of sinks only: nothing else to learn from
            use[:] = True
        stats = self.stats.setdefault(view.layer, QueryStats())
        stats.add(unrotate(view.queries[:, use.to(view.queries.device)], query_positions[use], rope))
        self._judge(view.layer, view.keys, view.values, view.scaling, rope, positions)

    def wants_scores(self, step: int) -> bool:
        return self.decode

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        self.query_position, self.rotation = new_position, None
        self.step_mean.clear()
        self.score = grown(self.score, new_position, float("inf"))

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        rope = self._rope(view.rope, view.query.shape[-1])
        query = unrotate(view.query[:, None], torch.tensor([self.query_position]), rope)
        self.stats.setdefault(view.layer, QueryStats()).add(query)
        self._judge(view.layer, view.keys, view.values, view.scaling, rope, positions)

    # -- decisions ------------------------------------------------------------------------------------
    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        judged = self.step_mean.mean(positions)
        if judged is None:  # prefill-time mode after the prefill: nothing new was judged
            return NO_SLOTS
        self.score[positions] = judged
        return lowest(self.utility(positions), positions, over_budget(positions, budget))

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.where(positions < self.sinks, float("inf"), self.score[positions])

    def raw_scores(self, positions: torch.Tensor) -> torch.Tensor | None:
        return self.step_mean.mean(positions)

    def pinned(self, budget: int) -> tuple[int, int]:
        return self.sinks, 0

    def cache_bound(self, budget: int, step: int) -> int:
        return budget if self.decode else budget + step
