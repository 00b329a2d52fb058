"""The one interface between the engine and an eviction policy.

A decode step ``k`` (k = 1, 2, ...) is the forward pass that consumes generated token ``k``.  For each step
the engine calls, in order:

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

import torch

from ..scoring import LayerView

NO_SLOTS = torch.empty(0, dtype=torch.long)


def param(default, *, low=None, high=None, choices=None, help=""):
    """A policy parameter with the metadata the registry, CLI and UI read (valid range or choices)."""
    return field(default=default, metadata={"low": low, "high": high, "choices": choices, "help": help})


@dataclass
class Policy:
    """Base class: keeps everything (the ``full`` reference)."""

    def reset(self, prompt_len: int, budget: int) -> None:
        """Start a new sequence whose prompt (positions ``0 .. prompt_len-1``) was prefilled."""
        self.prompt_len = prompt_len

    def wants_scores(self, step: int) -> bool:
        return False

    def wants_layer(self, layer: int) -> bool:
        return True

    def begin_step(self, step: int, cached: torch.Tensor, new_position: int) -> None:
        pass

    def observe(self, view: LayerView, positions: torch.Tensor) -> None:
        """One eligible layer of a scoring step; ``positions[slot]`` maps ``view``'s slots to positions."""

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        """Slot indices to drop after step ``step``'s forward pass (``positions``: live slots)."""
        return NO_SLOTS

    def utility(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The policy's current per-entry utility for ``positions`` (higher = kept longer), if it has one."""
        return None

    def cache_bound(self, budget: int) -> int | None:
        """Most live entries after any step's eviction; ``None`` means unbounded (no eviction)."""
        return None

    def params(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}


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
