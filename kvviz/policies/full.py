"""The full cache: nothing is ever evicted (the reference every other policy is compared with)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Policy


@dataclass
class FullCache(Policy):
    """Keep every token; with this policy the engine reproduces ``model.generate`` exactly."""
