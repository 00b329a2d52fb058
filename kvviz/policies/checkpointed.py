"""Shared machinery of checkpointed policies (R-KV, AvoKV-E, LazyEviction): a schedule of checkpoints and,
for those that score from recent queries (R-KV, AvoKV-E: :class:`QueryWindowPolicy`), a buffer of them.

Between checkpoints nothing is evicted.  A query-window policy buffers the newest query of every layer each
step (a copy of ``num_heads x head_dim`` floats, no attention computed); with ``prompt_queries`` the
prompt's last queries start the buffer at prefill.  At a checkpoint the subclass scores candidates from
what it kept and the cache as it is then -- only what the prefix provides, so every quantity is causal.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from ..ranking import ranks
from ..scoring import LayerView, PrefillView
from .base import NO_SLOTS, BudgetTooSmall, Policy, lowest, param


def window_attention(queries: torch.Tensor, query_positions: torch.Tensor, view: LayerView,
                     key_positions: torch.Tensor) -> torch.Tensor:
    """Softmax of buffered queries over the current cache, each seeing only keys not newer than itself.

    Parameters
    ----------
    queries : torch.Tensor
        ``(w, num_heads, head_dim)`` post-RoPE queries of the last ``w`` steps.
    query_positions : torch.Tensor
        ``(w,)`` absolute positions of those queries.
    view : LayerView
        The layer's keys, ``(num_kv_heads, n, head_dim)``.
    key_positions : torch.Tensor
        ``(n,)`` absolute position of each cached slot.

    Returns
    -------
    torch.Tensor
        ``(num_heads, w, n)`` float32 attention probabilities.
    """
    window, heads, dim = queries.shape
    num_kv, n, _ = view.keys.shape
    grouped = queries.float().permute(1, 0, 2).reshape(num_kv, heads // num_kv * window, dim)
    logits = torch.matmul(grouped, view.keys.float().transpose(1, 2)).view(heads, window, n) * view.scaling
    future = key_positions.to(logits.device)[None, :] > query_positions.to(logits.device)[:, None]
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


def percentile_rank(values: torch.Tensor) -> torch.Tensor:
    """``(rank - 1) / (n - 1)`` with ascending ranks, ties sharing their average rank (:func:`kvviz.ranking.ranks`).

    Parameters
    ----------
    values : torch.Tensor
        ``(n,)`` values, one per candidate.

    Returns
    -------
    torch.Tensor
        ``(n,)`` float32 in ``[0, 1]`` on ``values``' device; zeros for ``n < 2``.
    """
    n = values.numel()
    if n < 2:
        return torch.zeros_like(values, dtype=torch.float32)
    ranked = ranks(values.detach().double().cpu().numpy())
    return torch.from_numpy((ranked - 1) / (n - 1)).float().to(values.device)


@dataclass
class CheckpointPolicy(Policy):
    """Base of checkpointed policies: every ``interval`` generated tokens while over B, the candidates (all but
    the ``protected`` newest) are scored and the top ``B - protected`` stay.  Subclasses implement
    ``protected``, ``observe`` (which, at a checkpoint, sets ``self.candidates`` and counts
    ``self.layers_seen``) and ``risk``; :class:`QueryWindowPolicy` is the one that scores from buffered queries."""

    interval: int = param(128, low=1, high=4096, help="generated tokens between compression checkpoints")

    def __post_init__(self):
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")

    def protected(self, budget: int) -> int:
        """How many of the most recent entries are never candidates."""
        raise NotImplementedError

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        self.checkpoint = False
        self.terms = None  # asked for after the prefill too, where prompt queries may be recorded
        self.last_score = None  # a reused policy must not report the last run's utility before a checkpoint

    def wants_scores(self, step: int) -> bool:
        return True  # every step: to buffer its queries or track its reads; scoring waits for a checkpoint

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        self.checkpoint = self.checkpoint_at(step, cached.numel() + 1, self.budget)
        self.new_position = new_position
        self.features: dict[str, torch.Tensor] = {}
        self.layers_seen = 0
        self.terms = None  # (candidate positions, named terms over them) once this step's checkpoint is decided

    def reset_budget_check(self, budget: int, reserved: int, name: str, shrink: str) -> None:
        """Refuse a budget within the ``reserved`` entries that are never evicted (``shrink``: the parameters
        that set them, named in the message)."""
        # Whatever the prompt length, decoding grows the cache past any budget, and at that checkpoint a
        # budget within the reserve would evict everything else, the never-evicted sinks included.
        if budget <= reserved:
            raise BudgetTooSmall(budget, reserved, f"the {reserved} entries {name} always protects", shrink)

    def risk(self, features: dict[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        """Per-candidate score, higher = keep.

        Parameters
        ----------
        features : dict[str, torch.Tensor]
            Feature name -> ``(c,)`` layer-mean float32 values (CPU) of the :meth:`layer_features`.
        positions : torch.Tensor
            ``(c,)`` absolute positions of the candidates, in the same order.

        Returns
        -------
        torch.Tensor
            ``(c,)`` scores; the lowest candidates are evicted (ties: older first).
        """
        raise NotImplementedError

    def terms_key(self) -> str:
        """What :meth:`explain`'s terms are and how the score combines them, with this instance's weights: the
        key to the table of a decision's terms.  Empty where a subclass does not say."""
        return ""

    def explain(self, features: dict[str, torch.Tensor], score: torch.Tensor) -> dict[str, torch.Tensor]:
        """The terms to show for each candidate at a checkpoint: the layer-mean features and the score."""
        return {**features, "score": score}

    def checkpoint_features(self) -> dict[str, torch.Tensor]:
        """The features :meth:`risk` reads at this checkpoint: by default the layer means of what ``observe``
        summed into ``self.features`` over the step's ``self.layers_seen`` layers."""
        return {name: total / self.layers_seen for name, total in self.features.items()}

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        if not self.checkpoint or not self.layers_seen:
            return NO_SLOTS
        features = self.checkpoint_features()
        candidates = self.candidates
        score = self.risk(features, positions[candidates])
        self.last_score = dict(zip(positions[candidates].tolist(), score.tolist()))
        self.terms = (positions[candidates], self.explain(features, score))
        keep = max(budget - (positions.numel() - candidates.numel()), 0)
        return candidates[lowest(score, positions[candidates], candidates.numel() - keep)]

    def utility(self, positions: torch.Tensor) -> torch.Tensor | None:
        if self.last_score is None:
            return None
        return torch.tensor([self.last_score.get(p, float("inf")) for p in positions.tolist()])

    def components(self, positions: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if self.terms is None:
            return None
        candidates, terms = self.terms
        index = {position: i for i, position in enumerate(positions.tolist())}
        rows = torch.tensor([index[p] for p in candidates.tolist()], dtype=torch.long)
        out = {}
        for name, values in terms.items():  # protected entries were not judged: NaN
            out[name] = torch.full((positions.numel(),), float("nan")).index_copy_(0, rows, values.float().cpu())
        return out

    def cache_bound(self, budget: int, step: int) -> int:
        return budget + self.interval - 1

    def checkpoint_at(self, step: int, size: int, budget: int) -> bool:
        """Whether decode step ``step``, with ``size`` entries once its token is in, is a checkpoint: every
        ``interval`` tokens while over budget, and also whenever the cache would exceed B + interval - 1 (only
        when the prompt alone is over budget), so that the documented bound holds at every step."""
        return size > budget and (step % self.interval == 0 or size > budget + self.interval - 1)

    def first_checkpoint(self, prompt_len: int, budget: int) -> int:
        """The decode step of a run's first checkpoint (never the prefill): until then nothing is evicted, so
        step k's cache holds prompt_len + k entries.  At the latest the step that would pass B + interval - 1."""
        return next(step for step in itertools.count(1) if self.checkpoint_at(step, prompt_len + step, budget))

    def late_first_checkpoint(self, prompt_len: int, budget: int, max_new_tokens: int) -> int | None:
        """The first checkpoint's step where a run of ``max_new_tokens`` would decode no token from a cache it
        cut -- the checkpoint at or after the last decode step (the last token is generated, never fed back;
        a cut at the last step follows the last forward pass) -- else None."""
        first = self.first_checkpoint(prompt_len, budget)
        return first if first >= max_new_tokens - 1 else None

    def widest_interval(self, prompt_len: int, budget: int, last_step: int) -> int:
        """The largest ``interval`` sure to bring a first checkpoint by decode step ``last_step`` (0: none
        does): from the first step with the cache over B, one falls within ``interval - 1`` steps."""
        over = max(1, budget - prompt_len + 1)  # nothing is evicted before: step k holds prompt_len + k
        return max(0, last_step - over + 1)


@dataclass
class QueryWindowPolicy(CheckpointPolicy):
    """A checkpointed policy that scores from the last ``observe_window`` queries (R-KV, AvoKV-E): each step
    buffers every layer's newest query; at a checkpoint, subclasses turn the buffer and the cache into
    per-candidate ``layer_features``, which are averaged over layers before ``risk``."""

    observe_window: int = param(8, low=1, high=128, help="W_obs: the most recent queries that measure attention")
    prompt_queries: bool = param(False, help="the prompt's last queries count among the W_obs while fewer decode "
                                 "queries exist (recorded at prefill); False: decode queries only")

    def __post_init__(self):
        super().__post_init__()
        if self.observe_window < 1:
            raise ValueError(f"observe_window must be >= 1, got {self.observe_window}")

    @property
    def prefill_window(self) -> int:  # the prompt queries to record at prefill (nothing is evicted there)
        return self.observe_window if self.prompt_queries else 0

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        self.queries: dict[int, deque] = {}

    def observe_prefill(self, view: PrefillView, positions: torch.Tensor) -> None:
        """Start the buffer with the prompt's last queries (``prompt_queries``): a checkpoint before
        ``observe_window`` decode steps then reads the newest queries there are, the prompt's included,
        instead of the few decode ones."""
        buffer = self.queries.setdefault(view.layer, deque(maxlen=self.observe_window))
        first = int(positions.max()) + 1 - view.queries.shape[1]  # the window is the prompt's last positions
        for offset in range(view.queries.shape[1]):
            buffer.append((first + offset, view.queries[:, offset].detach().clone()))

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        buffer = self.queries.setdefault(view.layer, deque(maxlen=self.observe_window))
        buffer.append((self.new_position, view.query.detach().clone()))
        if not self.checkpoint:  # between checkpoints only the buffer moves; nothing is stacked or scored
            return
        queries = torch.stack([q for _, q in buffer])
        query_positions = torch.tensor([p for p, _ in buffer])
        newest = int(positions.max())
        self.candidates = torch.nonzero(positions <= newest - self.protected(self.budget)).flatten()
        for name, value in self.layer_features(view, positions, queries, query_positions).items():
            self.features[name] = self.features.get(name, 0) + value.to("cpu", torch.float32)
        self.layers_seen += 1

    def layer_features(self, view, positions, queries, query_positions) -> dict[str, torch.Tensor]:
        """One layer's features of the ``c`` candidates at a checkpoint (``self.candidates``, slot indices).

        Parameters
        ----------
        view : LayerView
            The layer's cache: keys and values ``(num_kv_heads, n, head_dim)``.
        positions : torch.Tensor
            ``(n,)`` absolute position of each cached slot.
        queries : torch.Tensor
            ``(w, num_heads, head_dim)`` the buffered post-RoPE queries, oldest first.
        query_positions : torch.Tensor
            ``(w,)`` their absolute positions.

        Returns
        -------
        dict[str, torch.Tensor]
            Feature name -> ``(c,)`` values in ``self.candidates``' order; summed over layers (on CPU, float32)
            and averaged before :meth:`risk`.
        """
        raise NotImplementedError
