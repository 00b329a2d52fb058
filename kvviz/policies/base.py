"""The one interface between the engine and an eviction policy.

A decode step ``k`` (k = 1, 2, ...) is the forward pass that consumes generated token ``k``.  For each step
the engine calls, in order:

0. policies that read the prompt's last queries (``prefill_window > 0``: prefill-time ones such as SnapKV,
   and checkpointed ones that start their observation window there): ``observe_prefill(view, positions)``
   per layer during the prefill; for a policy that ``reconstructs`` (KVzip), the engine then feeds "repeat the
   context" plus the prompt, chunk by chunk, hands each layer's view of those queries to
   ``observe_reconstruction(view, positions, chunk)`` and drops the repeated tokens from the cache again;
   then ``select_evictions(0, ...)``;
1. ``wants_scores(k)`` -- should the attention wrapper hand this step's layers to the policy?
2. ``begin_step(k, cached, new_position)`` -- a new token (absolute position ``new_position``) is about to
   enter a cache currently holding ``cached`` (absolute positions, slot order);
3. ``observe(view, positions)`` once per eligible layer (``wants_layer``), in layer order, if scoring;
4. ``select_evictions(k, positions, budget)`` after the forward pass -- which slots to drop now.

Policies keep their state indexed by *absolute position*, so the engine is free to move entries between
slots.  They see tensors only: nothing here knows about the UI, the CLI or the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from ..scoring import LayerView, PrefillView

NO_SLOTS = torch.empty(0, dtype=torch.long)


def param(default, *, low=None, high=None, choices=None, help=""):
    """A policy parameter with the metadata the registry, CLI and UI read (valid range or choices)."""
    return field(default=default, metadata={"low": low, "high": high, "choices": choices, "help": help})


class BudgetTooSmall(ValueError):
    """A budget within the entries a policy never evicts (sinks, a recent window).

    ``reserved``: those entries' count (a budget must exceed it); ``kept``: what they are, as the message
    names them; ``shrink``: the parameters that set them, to lower instead ("" where none could make this
    budget do).  The message speaks of the budget; where a compression set it,
    :func:`kvviz.engine.at_compression` says which compression would do instead.
    """

    def __init__(self, budget: int, reserved: int, kept: str, shrink: str):
        self.budget, self.reserved, self.kept, self.shrink = budget, reserved, kept, shrink
        super().__init__(f"budget {budget} must exceed {kept}: raise the budget above {reserved}{self.instead}")

    @property
    def instead(self) -> str:
        """`` (or lower sinks)``: the message's alternative to a larger budget, or "" where there is none."""
        return f" (or lower {self.shrink})" if self.shrink else ""


@dataclass
class Policy:
    """Base class: keeps everything (the ``full`` reference)."""

    prefill_window: ClassVar[int] = 0  # > 0: the prompt's last queries the policy reads at prefill
    reconstructs: ClassVar[bool] = False  # True: score from a context-reconstruction pass after the prefill
    # Parameters added after rows were stored, each with the value that does what the policy did before it
    # existed: a stored row whose parameters lack one ran with that value (read by the store and the runner's
    # resume check, so that a new default never relabels an old row).
    added_parameters: ClassVar[dict[str, Any]] = {}

    def check_model(self, model) -> None:
        """Refuse, before any forward pass, a model this policy cannot serve exactly (ValueError saying what
        to change); every model is fine by default."""

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        """Start a new sequence whose prompt (positions ``0 .. prompt_len-1``) is about to be prefilled."""
        self.prompt_len, self.budget, self.num_layers = prompt_len, budget, num_layers

    def wants_scores(self, step: int) -> bool:
        return False

    def wants_layer(self, layer: int) -> bool:
        return True

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        pass

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        """One eligible layer of a scoring step; ``positions[slot]`` maps ``view``'s slots to positions."""

    def observe_prefill(self, view: PrefillView, positions: torch.Tensor) -> None:
        """One layer of the prefill (policies with ``prefill_window`` > 0 only)."""

    def observe_reconstruction(self, view: PrefillView, positions: torch.Tensor, chunk: tuple[int, int]) -> None:
        """One layer of a reconstruction pass (``reconstructs`` only): ``view.queries`` are the repeat tokens'
        (the last entries of ``positions``, at positions from the prompt length on), repeating prompt
        positions ``chunk = (start, end)``."""

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        """Slot indices to drop after step ``step``'s forward pass (``positions``: live slots)."""
        return NO_SLOTS

    def utility(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The policy's current per-entry utility for ``positions`` (higher = kept longer), if it has one."""
        return None

    def raw_scores(self, positions: torch.Tensor) -> torch.Tensor | None:
        """This step's un-aggregated score (e.g. layer-mean attention) for ``positions``, if it computed one."""
        return None

    def components(self, positions: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The named terms this step's eviction decision was computed from, per entry of ``positions`` (the
        entries present before it), if the policy combines several: e.g. AvoKV-E's read pressure, key
        redundancy and payload, their percentile ranks and the risk.  NaN where an entry was not judged."""
        return None

    def cache_bound(self, budget: int, step: int) -> int | None:
        """Most live entries after step ``step``'s eviction; ``None`` means unbounded (no eviction).

        Non-decreasing in ``step``; the engine sizes the cache with the bound at the last step.
        """
        return None

    def pinned(self, budget: int) -> tuple[int, int]:
        """(oldest entries never evicted, newest entries never evicted) -- sinks and protected tails."""
        return 0, 0

    def previous_step_weight(self, num_layers: int) -> float | None:
        """Weight the utility of the previous step keeps after one scoring step, if the rule has one."""
        return None

    def records_attention(self) -> bool:
        """Whether the raw score this setting records per step (``StepEvent.raw``) is the last query's
        attention, averaged over heads and layers: what AvoKV-E's read-lag diagnostic reads."""
        return False

    def params(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def unused(self) -> dict[str, str]:
        """Parameters that this setting's rule never reads, each with the setting that makes it so (e.g.
        ``{"alpha": "aggregation is 'sum'"}``): the registry refuses any value but the field's default for one
        and sets it to that default, since another value would change the setting's name and not its run, and
        the UI hides its widget."""
        return {}


def lowest(utility: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """Slots of the ``count`` lowest-utility entries; ties go to the older (smaller) position first.

    Parameters
    ----------
    utility : torch.Tensor
        Per-slot utility, shape ``(n,)``.
    positions : torch.Tensor
        Per-slot absolute position, shape ``(n,)``, unique.
    count : int
        How many slots to return (``0 <= count <= n``).
    """
    if count <= 0:
        return NO_SLOTS
    if count == 1:  # the steady-state case: two O(n) reductions, no sort
        ties = utility == utility.min()
        oldest = torch.where(ties, positions, torch.iinfo(positions.dtype).max)
        return oldest.argmin().reshape(1)
    by_position = torch.argsort(positions)
    order = torch.sort(utility[by_position], stable=True).indices
    return by_position[order[:count]]


def over_budget(positions: torch.Tensor, budget: int) -> int:
    return max(0, positions.numel() - budget)


def grown(state: torch.Tensor, position: int, fill: float = 0.0) -> torch.Tensor:
    """``state`` (indexed by absolute position) with room for ``position`` (doubling, amortised O(1)).

    Parameters
    ----------
    state : torch.Tensor
        ``(m,)`` per-position state.
    position : int
        The absolute position that must fit.
    fill : float
        Value of the added entries.

    Returns
    -------
    torch.Tensor
        ``state`` itself if ``position < m``, else a copy of shape ``(max(2 m, position + 1),)`` with ``fill``
        after the first ``m`` entries; same dtype.
    """
    if position < state.numel():
        return state
    extra = torch.full((max(state.numel(), position + 1 - state.numel()),), fill, dtype=state.dtype)
    return torch.cat([state, extra])


class StepMean:
    """Per-position mean of the layer scores seen during one step (layer-averaged token-level score)."""

    def __init__(self) -> None:
        self.total = torch.zeros(0)
        self.layers = 0

    def clear(self) -> None:
        self.total.zero_()
        self.layers = 0

    def add(self, score: torch.Tensor, positions: torch.Tensor) -> None:
        """Add one layer's scores to the step's per-position totals.

        Parameters
        ----------
        score : torch.Tensor
            ``(n,)`` the layer's score of each cached entry, on any device.
        positions : torch.Tensor
            ``(n,)`` absolute position of each entry, in the same order.
        """
        self.total = grown(self.total, int(positions.max()))
        self.total[positions] += score.to("cpu", torch.float32)
        self.layers += 1

    def mean(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Layer-mean score of ``positions`` this step; ``None`` before any layer was seen."""
        return self.total[positions] / self.layers if self.layers else None


@dataclass
class StepScorePolicy(Policy):
    """Keep the top ``B`` by a score recomputed from scratch every step (layer-mean of :meth:`score`)."""

    def score(self, view: LayerView, positions: torch.Tensor) -> torch.Tensor:
        """One layer's score for every cached slot; higher = keep.

        Parameters
        ----------
        view : LayerView
            This layer at this step: ``keys`` and ``values`` ``(num_kv_heads, n, head_dim)``, ``query``
            ``(num_heads, head_dim)``, ``attn`` ``(num_heads, n)`` (computed only if read).
        positions : torch.Tensor
            Absolute position of each slot, ``(n,)``.

        Returns
        -------
        torch.Tensor
            Shape ``(n,)``.  The layer mean of it ranks the entries; the lowest go first.
        """
        raise NotImplementedError

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        super().reset(prompt_len, budget, num_layers)
        self.step_mean = StepMean()

    def wants_scores(self, step: int) -> bool:
        return True

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        self.step_mean.clear()

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        score = self.score(view, positions)
        if score.shape != positions.shape:  # a scalar or a per-head score would broadcast: every entry tied
            raise ValueError(f"{type(self).__name__}.score must return one score per cached slot, shape "
                             f"({positions.numel()},); it returned {tuple(score.shape)} (reduce over heads, "
                             "e.g. .mean(0))")
        self.step_mean.add(score, positions)

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        return lowest(self.step_mean.mean(positions), positions, over_budget(positions, budget))

    def utility(self, positions: torch.Tensor) -> torch.Tensor | None:
        return self.step_mean.mean(positions)

    def raw_scores(self, positions: torch.Tensor) -> torch.Tensor | None:
        return self.step_mean.mean(positions)

    def cache_bound(self, budget: int, step: int) -> int:
        return budget
