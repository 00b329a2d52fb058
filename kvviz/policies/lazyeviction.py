"""LazyEviction: lagged eviction that keeps the entries whose attention tends to come back.

Every decode step, an entry is *active* when the newest query's attention to it (mean over heads and
layers) is at least ``threshold`` times the uniform share ``1/n`` of the ``n`` cached entries.  For each
entry the policy keeps the position of the query that last found it active (``TS``) and its maximum
recurrence interval (``MRI``: the longest gap between two activations, its writing counting as the first;
0 while it has never been active since).  A generated entry is written at its own position; the prompt is
written at once by the prefill, whose attention is not tracked, so its entries start at the prompt's last
position (counted from their own positions, the first read of an early prompt entry would make a gap as
long as the prompt and an MRI that no recurrence had shown).  At a checkpoint (every ``interval``
generated tokens while over B, as for R-KV and AvoKV-E), with ``t`` the newest query's position and
``idle = t - TS``::

    H1 = 2 sigmoid(-idle / MRI)     1 for an entry active now, falling as its idle time passes its MRI
    H2 = 2 sigmoid(-(MRI + 1))      a bonus for entries that recur often: 0.24 at MRI 1, under 0.01 past 4
    score = H1 + H2                 for MRI > 0;  1 if idle = 0 else 0  for MRI = 0 (the limit of H1)

The last ``window`` entries are never candidates; the top ``B - window`` candidates by score stay (ties:
the older goes first).  Entries never read since they were written all score 0, so they go first, oldest
first: early checkpoints, before most entries have been read twice, cut mostly by age.  Between
checkpoints nothing is evicted, so the cache may exceed B by up to ``interval - 1``.

Our reading of LazyEviction (Zhang et al. 2025, arXiv 2506.15969), which is not among the papers this
project reproduces: recurrence-interval tracking and the two-term, MRI-centred score follow its published
description; AvoKV-E (§5.1) runs it "with the same window and interval" as R-KV, this policy's defaults.
Two choices are ours: activity is read from one token-level score (head- and layer-mean attention, like
every attention policy here), and the threshold is relative to ``1/n``.  The original sets an absolute α
(5e-4 on DeepSeek-R1-Distill-Llama-8B, a few times the uniform share at its multi-thousand-token
lengths); on the few hundred entries of a kvviz run, an absolute 5e-4 marks almost every entry active at
every step, which turns the rule into recency.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring import LayerView
from .base import StepMean, grown, param
from .checkpointed import CheckpointPolicy


def recurrence_score(idle: torch.Tensor, mri: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LazyEviction's two terms for each candidate; their sum ranks the candidates (higher = keep).

    Parameters
    ----------
    idle : torch.Tensor
        ``(c,)`` steps since each candidate was last active (``t - TS``), ``>= 0``.
    mri : torch.Tensor
        ``(c,)`` each candidate's maximum recurrence interval, ``>= 0`` (0: never active after its creation).

    Returns
    -------
    tuple of torch.Tensor
        ``H1`` and ``H2``, each ``(c,)`` float32: ``2 sigmoid(-idle / MRI)`` and ``2 sigmoid(-(MRI + 1))``
        where ``MRI > 0``; where ``MRI = 0``, ``H1`` is 1 if ``idle = 0`` else 0 and ``H2`` is 0.
    """
    idle, mri = idle.float(), mri.float()
    recurred = mri > 0
    h1 = torch.where(recurred, 2 * torch.sigmoid(-idle / mri.clamp(min=1)), (idle == 0).float())
    h2 = torch.where(recurred, 2 * torch.sigmoid(-(mri + 1)), torch.zeros_like(mri))
    return h1, h2


@dataclass
class LazyEviction(CheckpointPolicy):
    """LazyEviction with the window and interval AvoKV-E compares it at (8 and 128)."""

    window: int = param(8, low=0, high=512, help="most recent entries always kept")
    threshold: float = param(1.0, low=0.0, high=1000.0,
                             help="an entry counts as read (active) when the last query's attention to it is at "
                             "least this many times 1/n")

    def records_attention(self) -> bool:
        return True

    def protected(self, budget: int) -> int:
        return self.window

    def pinned(self, budget: int) -> tuple[int, int]:
        return 0, self.window

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        self.reset_budget_check(budget, self.window, "LazyEviction (recent window)", "window")
        # TS: written at the prefill (the prompt's last position) or, generated, at its own position
        self.last_active = torch.full((prompt_len + 64,), max(prompt_len - 1, 0), dtype=torch.long)
        self.mri = torch.zeros(prompt_len + 64, dtype=torch.long)
        self.step_mean = StepMean()

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        super().begin_step(step, cached, new_position)
        self.last_active = grown(self.last_active, new_position)
        self.last_active[new_position] = new_position
        self.mri = grown(self.mri, new_position)
        self.step_mean.clear()

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        self.step_mean.add(view.attn.mean(0), positions)
        if self.checkpoint:
            self.candidates = torch.nonzero(positions <= int(positions.max()) - self.window).flatten()
            self.layers_seen += 1

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        attention = self.step_mean.mean(positions)
        if attention is not None:  # this step's activity first: an entry read now is not idle
            active = positions[attention >= self.threshold / positions.numel()]
            self.mri[active] = torch.maximum(self.mri[active], self.new_position - self.last_active[active])
            self.last_active[active] = self.new_position
        self.judged = positions[self.candidates] if self.checkpoint and self.layers_seen else None
        return super().select_evictions(step, positions, budget)

    def checkpoint_features(self) -> dict[str, torch.Tensor]:
        """``idle`` and ``MRI`` of the candidates, from the tracker rather than a layer mean."""
        return {"idle": (self.new_position - self.last_active[self.judged]).float(),
                "MRI": self.mri[self.judged].float()}

    def risk(self, features, positions):
        """``H1 + H2`` of each candidate, ``(c,)``, from its ``idle`` and ``MRI`` (each ``(c,)``)."""
        h1, h2 = recurrence_score(features["idle"], features["MRI"])
        return h1 + h2

    def terms_key(self) -> str:
        return ("score = H1 + H2; idle: steps since the entry was last active, MRI: its longest gap between two "
                "activations; H1 = 2σ(−idle/MRI), H2 = 2σ(−(MRI + 1)); the lowest scores go first")

    def explain(self, features, score):
        h1, h2 = recurrence_score(features["idle"], features["MRI"])
        return {**features, "H1": h1, "H2": h2, "score": score}

    def raw_scores(self, positions: torch.Tensor) -> torch.Tensor | None:
        return self.step_mean.mean(positions)
