"""Eviction policies and the registry the CLI, the UI and the sweep runner all read.

Adding a policy: one new file with a :class:`~kvviz.policies.base.Policy` dataclass, one line in
``REGISTRY`` below.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .base import Policy
from .full import FullCache
from .inertia import InertiaKV

INERTIA = "InertiaKV (inertiakv.txt)"


@dataclass(frozen=True)
class PolicySpec:
    """What the registry says about one policy name."""

    name: str
    cls: type[Policy]
    display: str
    family: str
    description: str
    paper: str = ""
    preset: dict[str, Any] = field(default_factory=dict)

    def parameters(self) -> list[dict[str, Any]]:
        """Each parameter's name, type, default (the preset's where it sets one), range or choices, help."""
        out = []
        for f in fields(self.cls):
            if not f.init:
                continue
            default = self.preset.get(f.name, f.default if f.default is not MISSING else None)
            out.append({"name": f.name, "type": type(default).__name__, "default": default, **f.metadata})
        return out

    def build(self, **params: Any) -> Policy:
        known = {f.name for f in fields(self.cls) if f.init}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"policy {self.name!r} has no parameter(s) {', '.join(unknown)}; "
                f"it takes: {', '.join(sorted(known)) or 'none'}"
            )
        return self.cls(**{**self.preset, **params})


REGISTRY: dict[str, PolicySpec] = {
    spec.name: spec
    for spec in [
        PolicySpec("full", FullCache, "Full cache", "reference", "No eviction; equals model.generate."),
        PolicySpec("inertia", InertiaKV, "InertiaKV", "InertiaKV",
                   "Layer-sequential EMA of last-query attention, scored every step.", f"{INERTIA} §3.1, App. E"),
        PolicySpec("inertia-lazy", InertiaKV, "InertiaKV-Lazy", "InertiaKV",
                   "InertiaKV scoring only on steps 1, 1+r, 1+2r, ...; stale utility in between.",
                   f"{INERTIA} §3.2", {"refresh": 4}),
        PolicySpec("score-free", InertiaKV, "Score-Free", "InertiaKV",
                   "Score once at the first decode step, then freeze the ranking.", f"{INERTIA} §3.2",
                   {"refresh": 0}),
        PolicySpec("single-step", InertiaKV, "Single-step", "InertiaKV ablation",
                   "alpha = 0: the last eligible layer's scores of the current step.", f"{INERTIA} Eq. 2",
                   {"alpha": 0.0}),
        PolicySpec("cumulative", InertiaKV, "Cumulative", "InertiaKV ablation",
                   "m <- m + s for every layer and step (no decay, H2O-style).", f"{INERTIA} Eq. 3",
                   {"aggregation": "sum"}),
    ]
}


def get_spec(name: str) -> PolicySpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(REGISTRY)}") from None


def make_policy(name: str, **params: Any) -> Policy:
    """Build a policy from its registry name and parameters, e.g. ``make_policy("inertia", alpha=0.9)``."""
    return get_spec(name).build(**params)


__all__ = ["REGISTRY", "PolicySpec", "Policy", "get_spec", "make_policy"]
