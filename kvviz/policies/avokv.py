"""AvoKV-E: delayed eligibility plus a payload-aware, percentile-rank-normalised eviction risk.

At a checkpoint (every ``interval`` generated tokens, AvoKV-E §4.3) the cache splits into the protected
tail P (the last ``W_delay`` entries, never judged before later queries could read them) and the older
candidates C.  For each candidate, averaged over layers and heads:

* read pressure ``p``: mean attention from the last ``W_obs`` queries (causal: each query only sees keys
  not newer than itself).  At a checkpoint within ``W_obs`` steps of the prompt (a prompt over budget, or
  an interval below ``W_obs``) the prompt's last queries fill the window, recorded at prefill
  (``prompt_queries``).  This is our reading of Eq. 2, which defines O_t by query positions; Appendix D
  speaks of "the last W_obs decode steps", and the paper's own runs (prompts under budget, checkpoints
  every 128 tokens) never meet the case.  ``prompt_queries=False`` reads decode queries only;
* key redundancy ``r``: max cosine of its post-RoPE key to any other candidate's key;
* payload ``b``: ``||v|| / (median ||v|| over C + eps)``.

Each is turned into its percentile rank over C (ties averaged) and combined as
``S = lp*N(p) - lr*N(r) + lb*N(b)``; the ``sinks`` oldest candidates (the first entries of the sequence,
which no policy here evicts before them) get ``S = +inf``.  The paper only says to protect the first four
entries; we read that as "never evict them" and keep them in C otherwise: they count in every percentile
rank and in the median payload, and their keys are among those ``r`` compares each candidate with (the
other reading, taking them out of C like the tail, would rank and compare the rest without them).
``W_delay >= W_obs`` is enforced (§4.1).  The cache keeps P and the top ``B - |P|`` candidates.  Between
checkpoints nothing is evicted, so the cache may exceed B by up to ``interval - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import param
from .checkpointed import QueryWindowPolicy, percentile_rank, window_attention

PAYLOAD_EPS = 1e-6


def eviction_risk(p: torch.Tensor, r: torch.Tensor, b: torch.Tensor, lambda_p: float, lambda_r: float,
                  lambda_b: float, normalise: bool = True) -> torch.Tensor:
    """``S = lp*N(p) - lr*N(r) + lb*N(b)`` over the candidates (``N`` = percentile rank, or identity).

    Parameters
    ----------
    p, r, b : torch.Tensor
        ``(c,)`` read pressure, key redundancy and payload of the ``c`` candidates.
    lambda_p, lambda_r, lambda_b : float
        The weights; ``lambda_r`` is subtracted.
    normalise : bool
        Percentile-rank each feature over the candidates first (False: the raw values).

    Returns
    -------
    torch.Tensor
        ``(c,)`` float32, higher = keep.
    """
    norm = percentile_rank if normalise else (lambda x: x.float())
    return lambda_p * norm(p) - lambda_r * norm(r) + lambda_b * norm(b)


def max_cosine_to_others(keys: torch.Tensor) -> torch.Tensor:
    """For keys ``(heads, c, d)``: each key's largest cosine to another key of the same head, ``(heads, c)``."""
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    cosine = unit @ unit.transpose(1, 2)
    cosine.diagonal(dim1=1, dim2=2).fill_(float("-inf"))
    return cosine.amax(-1) if keys.shape[1] > 1 else torch.zeros(keys.shape[:2])


@dataclass
class AvoKVE(QueryWindowPolicy):
    """AvoKV-E (avokv-e.txt §4); ablations: lambda_b=0, delay=observe_window, normalise=False, lambda_r=0."""

    prompt_queries: bool = param(True, help="the prompt's last queries count among the W_obs while fewer decode "
                                 "queries exist (Eq. 2's O_t; recorded at prefill); False: decode queries only")
    delay: int = param(0, low=0, high=1024, help="W_delay (0 = the paper's rule: 8 if B >= 768 else 32)")
    lambda_p: float = param(0.1, low=0.0, high=1.0, help="weight of read pressure")
    lambda_r: float = param(0.9, low=0.0, high=1.0, help="weight of key redundancy (subtracted)")
    lambda_b: float = param(0.05, low=0.0, high=1.0, help="weight of value payload")
    normalise: bool = param(True, help="percentile-rank normalise each feature (False: raw scores)")
    sinks: int = param(4, low=0, high=64, help="first cache entries that are never evicted")

    def __post_init__(self):
        super().__post_init__()
        if self.delay and self.delay < self.observe_window:
            raise ValueError(f"delay (W_delay={self.delay}) must be >= observe_window (W_obs={self.observe_window})")

    def protected(self, budget: int) -> int:
        if self.delay:
            return self.delay
        return 8 if budget >= 768 else 32  # the paper leaves 512 < B < 768 open; we use 32 there

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        if self.protected(budget) < self.observe_window:  # §4.1: every candidate predates every observing query
            raise ValueError(f"W_delay ({self.protected(budget)} at budget {budget}) must be >= observe_window "
                             f"(W_obs = {self.observe_window}): set delay >= {self.observe_window} or lower "
                             "observe_window")
        self.reset_budget_check(budget, self.protected(budget) + self.sinks, "AvoKV-E (tail + sinks)",
                                self.shrink_advice(budget))

    def shrink_advice(self, budget: int) -> str:
        """What to lower instead of raising ``budget`` over the tail and sinks, with values that make it do: only
        what can (the tail is at least W_obs = observe_window entries, delay 0 being the paper's rule; at B = 1
        nothing can).  "Lower delay or sinks" was offered where no delay or sinks would do."""
        room, tail = budget - 1, self.protected(budget)  # the most the tail and sinks may hold together
        options = [f"sinks to {room - tail} or fewer"] if self.sinks and tail <= room else []
        rule = "" if self.delay else f"; 0 is the paper's rule, {tail} at this budget"
        if room - self.sinks >= self.observe_window:
            options.append(f"the tail (delay between {self.observe_window} and {room - self.sinks}{rule})")
        elif room >= self.observe_window and tail != self.observe_window:  # both: the tail to its floor, W_obs
            options.append(f"sinks to {room - self.observe_window} or fewer and the tail (delay "
                           f"{self.observe_window}{rule})")
        elif room >= 1 and room < self.observe_window:  # the tail's floor, W_obs, must come down too
            options.append("sinks to 0 and " * bool(self.sinks)
                           + f"the tail (delay and observe_window {room} or less{rule})")
        return ", or ".join(options)

    def pinned(self, budget: int) -> tuple[int, int]:
        return self.sinks, self.protected(budget)

    def layer_features(self, view, positions, queries, query_positions):
        """``p``, ``r`` and ``b`` of the ``c`` candidates at this layer, each ``(c,)`` (head means).

        ``view`` holds keys and values ``(num_kv_heads, n, head_dim)``, ``positions`` is ``(n,)``, ``queries``
        ``(w, num_heads, head_dim)`` at ``query_positions`` ``(w,)``; see :meth:`QueryWindowPolicy.layer_features`.
        """
        cand = self.candidates
        attn = window_attention(queries, query_positions, view, positions)  # (heads, w, n)
        norms = view.values.float().norm(dim=-1)[:, cand]  # (kv_heads, c)
        return {
            "p": attn[:, :, cand].mean((0, 1)),
            "r": max_cosine_to_others(view.keys[:, cand]).mean(0),
            # quantile, not median(): for an even count torch's median is the lower middle value, Eq. 7's is
            # the mean of the two.
            "b": (norms / (norms.quantile(0.5, dim=-1, keepdim=True) + PAYLOAD_EPS)).mean(0),
        }

    def terms_key(self) -> str:
        n = "N" if self.normalise else ""  # the ablation without normalisation combines the raw features
        return (f"S = {self.lambda_p:g}·{n}(p) − {self.lambda_r:g}·{n}(r) + {self.lambda_b:g}·{n}(b); p: read pressure "
                f"(attention from the last {self.observe_window} queries), r: key redundancy (largest cosine to "
                "another candidate's key), b: value payload (value norm over the layer's median); "
                + ("N: percentile rank among the candidates; " if self.normalise else "")
                + "layer means; the lowest S go first")

    def explain(self, features, score):
        """Table 5 of the paper, per candidate: p, r, b, their percentile ranks and S."""
        ranked = {f"N({name})": percentile_rank(features[name]) for name in ("p", "r", "b")} if self.normalise else {}
        return {**features, **ranked, "S": score}

    def risk(self, features, positions):
        """``S`` of each candidate, ``(c,)``, from the layer-mean ``p``, ``r``, ``b`` (each ``(c,)``) at the
        candidates' ``(c,)`` absolute ``positions``; the ``sinks`` oldest of them get ``+inf``."""
        score = eviction_risk(features["p"], features["r"], features["b"], self.lambda_p, self.lambda_r,
                              self.lambda_b, self.normalise)
        oldest = torch.argsort(positions)[: self.sinks]
        score[oldest] = float("inf")
        return score
