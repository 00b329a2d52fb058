"""Per-slot scorers: each every-step policy's state and eviction rule over the static path's slots.

The static step (:mod:`kvviz.backend.static`) holds the cache in ``slots`` slots whose absolute positions are
``positions[:slots]``; one of them, ``free``, has just taken the new token.  Per step it asks the policy's
scorer, in the engine's order (:mod:`kvviz.policies.base`):

1. :meth:`SlotScorer.begin` -- the new token enters slot ``free`` (its state is the new position's, not the
   evicted entry's that the slot held);
2. :meth:`SlotScorer.observe` once per eligible layer on a scoring step, with a
   :class:`~kvviz.scoring.LayerView` over the live slots (the probabilities the attention already computed);
3. :meth:`SlotScorer.evict` -- the ``count`` slots to free, lowest utility first, ties to the older position
   (:func:`kvviz.policies.base.lowest`, the engine's own function): device reductions, no host sync.

Each scorer reads its policy object for everything that is a rule rather than state (``wants_scores``,
``wants_layer``, TOVA's ``score``): the formulas are the engine's own code, run on slot-ordered tensors.
State is per slot, ``(capacity,)`` tensors on the model's device; what the engine keeps per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..policies.base import lowest
from ..policies.full import FullCache
from ..policies.h2o import H2O
from ..policies.inertia import InertiaKV
from ..policies.inertia_decoupled import DecoupledInertiaKV
from ..policies.keydiff import KeyDiff
from ..policies.knorm import KNorm
from ..policies.random_keep import RandomEviction
from ..policies.recency import Recency
from ..policies.scorers import SCORERS
from ..policies.streaming import StreamingLLM
from ..policies.tova import TOVA
from ..scoring import LayerView


@dataclass
class SlotView(LayerView):
    """A :class:`LayerView` over the static path's live slots, its ``attn`` the step's own probabilities.

    The static layer hands out no query (no scorer of these policies reads it), so the query-head groups
    are given, not read from the query's shape.
    """

    groups: int = 1

    @property
    def num_groups(self) -> int:
        return self.groups


class StepTotal:
    """The device twin of :class:`~kvviz.policies.base.StepMean`: per-slot sum of this step's layer scores."""

    def __init__(self, capacity: int, device: torch.device):
        self.total = torch.zeros(capacity, dtype=torch.float32, device=device)
        # Eligible layers observed this step, set on the host before it (SlotScorer.prepare): a replayed graph
        # runs no Python, so nothing may count them as they come.
        self.layers = 0

    def clear(self) -> None:
        self.total.zero_()

    def add(self, score: torch.Tensor, slots: int) -> None:
        self.total[:slots] += score.float()

    def mean(self, slots: int) -> torch.Tensor | None:
        """``(slots,)`` layer-mean score; None before any layer was seen (as the engine's)."""
        return self.total[:slots] / self.layers if self.layers else None


class SlotScorer:
    """Base: no state, no utility; evicts by :meth:`eviction_utility` (subclasses give one)."""

    capturable = True  # its step is device work only (a CUDA graph can replay it)
    state: tuple[str, ...] = ()  # names of the (capacity,) per-slot tensors that move with their entries

    def __init__(self, policy, device: torch.device, capacity: int):
        self.policy, self.device = policy, device
        self.allocate(capacity)

    def allocate(self, capacity: int) -> None:
        """Fresh per-slot state for ``capacity`` slots (the prompt's entries at their starting values)."""

    def prepare(self, layers: int) -> None:
        """Host side of a step, before it runs (or its graph replays): ``layers`` eligible layers will be
        observed (0: not a scoring step)."""
        step = getattr(self, "step", None)
        if step is not None:
            step.layers = layers

    def begin(self, scoring: bool, free: torch.Tensor, slots: int) -> None:
        """Device side: a new token enters slot ``free`` (``(1,)`` long); ``slots`` slots are live this step."""

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        """One eligible layer of a scoring step; ``positions`` is ``(slots,)``, the live slots' positions."""

    def eviction_utility(self, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def evict(self, positions: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` slots to free after this step's forward pass, ``(count,)`` long on the device."""
        return lowest(self.eviction_utility(positions), positions, count)

    def utility(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The policy's utility of each live slot (``positions``: theirs, ``(slots,)``), as its events record
        it; None where the policy has none."""
        return None

    def raw(self, positions: torch.Tensor) -> torch.Tensor | None:
        """This step's un-aggregated score per live slot (layer mean), or None if it computed none."""
        return None

    def compact(self, index: torch.Tensor, capacity: int) -> None:
        """Move the entries in slots ``index`` to slots ``0 .. len(index) - 1`` of a ``capacity``-slot state."""
        for name in self.state:
            old = getattr(self, name)
            new = old.new_zeros(capacity)
            new[: index.numel()] = old[index]
            setattr(self, name, new)


class NeverEvicts(SlotScorer):
    """The full cache (the backend gives it a budget that is never exceeded)."""

    def evict(self, positions: torch.Tensor, count: int) -> torch.Tensor:
        if count:
            raise AssertionError("the full cache was sized to never evict")
        return positions.new_empty(0)


class Oldest(SlotScorer):
    """Recency: the oldest entry goes."""

    def eviction_utility(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.float()

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.float()


class Sinks(SlotScorer):
    """StreamingLLM: the first ``sinks`` positions are never evicted, then the oldest goes."""

    def eviction_utility(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.where(positions < self.policy.sinks, float("inf"), positions.float())


class StepScore(SlotScorer):
    """TOVA, KeyDiff, K-norm: the layer mean of the policy's own ``score`` of this step, recomputed each step."""

    state = ()

    def allocate(self, capacity: int) -> None:
        self.step = StepTotal(capacity, self.device)

    def begin(self, scoring, free, slots) -> None:
        self.step.clear()

    def observe(self, view, positions) -> None:
        self.step.add(self.policy.score(view, positions), positions.numel())

    def eviction_utility(self, positions: torch.Tensor) -> torch.Tensor:
        return self.step.mean(positions.numel())

    def utility(self, positions: torch.Tensor) -> torch.Tensor | None:
        return self.step.mean(positions.numel())

    def raw(self, positions: torch.Tensor) -> torch.Tensor | None:
        return self.step.mean(positions.numel())

    def compact(self, index: torch.Tensor, capacity: int) -> None:
        total = self.step.total.new_zeros(capacity)
        total[: index.numel()] = self.step.total[index]
        self.step.total = total


class HeavyHitters(SlotScorer):
    """H2O: attention accumulated over steps; the newest ``int(recent * B)`` positions are never evicted."""

    state = ("accumulated",)

    def allocate(self, capacity: int) -> None:
        self.accumulated = torch.zeros(capacity, dtype=torch.float32, device=self.device)
        self.step = StepTotal(capacity, self.device)

    def begin(self, scoring, free, slots) -> None:
        self.accumulated.index_fill_(0, free, 0.0)  # a new position starts from nothing
        self.step.clear()

    def observe(self, view, positions) -> None:
        self.step.add(view.attn.mean(0), positions.numel())

    def evict(self, positions: torch.Tensor, count: int) -> torch.Tensor:
        slots = positions.numel()
        if self.step.layers:
            self.accumulated[:slots] += self.step.mean(slots)
        if count == 0:
            return positions.new_empty(0)
        window = int(self.policy.recent * self.policy.budget)
        # The window is at most B of the B + count entries: at least count entries lie outside it.
        recent = positions > positions.max() - window
        return lowest(torch.where(recent, float("inf"), self.accumulated[:slots]), positions, count)

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        return self.accumulated[: positions.numel()]

    def raw(self, positions: torch.Tensor) -> torch.Tensor | None:
        return self.step.mean(positions.numel())

    def compact(self, index: torch.Tensor, capacity: int) -> None:
        super().compact(index, capacity)
        self.step = StepTotal(capacity, self.device)


class Inertia(SlotScorer):
    """InertiaKV and its settings: layer-sequential EMA (or sum) of any registered scorer, any eligible layers,
    lazy refresh (a new token enters at the cached mean between refreshes) and Score-Free."""

    state = ("m",)

    def allocate(self, capacity: int) -> None:
        self.m = torch.zeros(capacity, dtype=torch.float32, device=self.device)
        self.step = StepTotal(capacity, self.device)
        self.slot_ids = torch.arange(capacity, device=self.device)

    def begin(self, scoring, free, slots) -> None:
        self.step.clear()
        if scoring:
            entering = torch.zeros((), device=self.device)
        else:
            # The mean of the entries already cached, summed in float64 as the engine does (its value must not
            # depend on the order of the entries: slots here, the engine's slots there).
            cached = torch.where(self.slot_ids[:slots] == free, 0.0, self.m[:slots].double())
            entering = (cached.sum() / (slots - 1)).float()
        self.m.index_copy_(0, free, entering.reshape(1))

    def score(self, view, positions) -> torch.Tensor:
        return SCORERS[self.policy.scorer](view, positions).float()

    def observe(self, view, positions) -> None:
        slots = positions.numel()
        score = self.score(view, positions)
        self.step.add(score, slots)
        m = self.m[:slots]
        if self.policy.aggregation == "sum":
            m += score
        else:
            m.copy_(self.policy.alpha * m + (1.0 - self.policy.alpha) * score)  # the engine's expression

    def eviction_utility(self, positions: torch.Tensor) -> torch.Tensor:
        return self.m[: positions.numel()]

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        return self.m[: positions.numel()]

    def raw(self, positions: torch.Tensor) -> torch.Tensor | None:
        return self.step.mean(positions.numel())

    def compact(self, index: torch.Tensor, capacity: int) -> None:
        super().compact(index, capacity)
        self.step = StepTotal(capacity, self.device)
        self.slot_ids = torch.arange(capacity, device=self.device)


class DecoupledInertia(Inertia):
    """inertia-decoupled: the layers' mean first, then one EMA per step, starting at an entry's first score."""

    state = ("m", "observed")

    def allocate(self, capacity: int) -> None:
        super().allocate(capacity)
        self.observed = torch.zeros(capacity, dtype=torch.bool, device=self.device)

    def begin(self, scoring, free, slots) -> None:
        super().begin(scoring, free, slots)
        self.observed.index_fill_(0, free, False)

    def observe(self, view, positions) -> None:
        self.step.add(self.score(view, positions), positions.numel())  # the EMA waits for all layers

    def evict(self, positions: torch.Tensor, count: int) -> torch.Tensor:
        slots = positions.numel()
        if self.step.layers:  # once per step, after every layer: the step's single EMA update
            score, m, observed = self.step.mean(slots), self.m[:slots], self.observed[:slots]
            alpha = self.policy.alpha
            m.copy_(torch.where(~observed, score, alpha * m + (1.0 - alpha) * score))
            observed.fill_(True)
        return super().evict(positions, count)


class Uniform(SlotScorer):
    """Random: the engine's generator, drawn as the engine draws it, mapped from the engine's slot order.

    The engine draws ``randperm(n)[:count]`` over *its* slots every step, even when nothing is evicted, and its
    slot order is its cache's history (the new token is appended, then moved into the hole an eviction
    leaves).  ``order[i]`` is the static slot of the engine's slot ``i``, kept up to date by the same rule, so
    the same draw frees the same entry.  The draw runs on the host (the engine's CPU generator): not
    capturable in a CUDA graph.
    """

    capturable = False
    state = ()

    def allocate(self, capacity: int) -> None:
        self.generator = torch.Generator().manual_seed(self.policy.seed)
        self.order = torch.arange(capacity, device=self.device)

    def begin(self, scoring, free, slots) -> None:
        self.order[slots - 1: slots].copy_(free)  # the engine appends the new token after its cached entries

    def evict(self, positions: torch.Tensor, count: int) -> torch.Tensor:
        slots = positions.numel()
        drawn = torch.randperm(slots, generator=self.generator)[:count].to(self.device)
        if count != 1:  # none, or step 1's many: engine slots are static slots until the first compaction
            return drawn
        victim = self.order[drawn]
        self.order.index_copy_(0, drawn, self.order[slots - 1:slots].clone())  # the engine moves its last entry in
        return victim

    def compact(self, index: torch.Tensor, capacity: int) -> None:
        self.order = torch.arange(capacity, device=self.device)  # compacted by the engine's own rule


# The exact classes the static path computes (a subclass may change the rule: it is refused, not guessed).
SCORER_OF = {InertiaKV: Inertia, DecoupledInertiaKV: DecoupledInertia, TOVA: StepScore, KeyDiff: StepScore,
             KNorm: StepScore, H2O: HeavyHitters, StreamingLLM: Sinks, Recency: Oldest,
             RandomEviction: Uniform, FullCache: NeverEvicts}


def make_scorer(policy, device: torch.device, capacity: int) -> SlotScorer:
    """The scorer of ``policy`` (already reset for this prompt) over ``capacity`` slots on ``device``."""
    return SCORER_OF[type(policy)](policy, device, capacity)
