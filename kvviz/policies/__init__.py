"""Eviction policies and the registry the CLI, the UI and the sweep runner all read.

Adding a policy: one new file with a :class:`~kvviz.policies.base.Policy` dataclass, one line in
``REGISTRY`` below (docs/policies.md, "Adding a policy", works one through).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ..quote import cut, excerpt
from .avokv import AvoKVE
from .base import Policy
from .expected_attention import ExpectedAttention
from .full import FullCache
from .h2o import H2O
from .inertia import InertiaKV
from .inertia_decoupled import DecoupledInertiaKV
from .keydiff import KeyDiff
from .knorm import KNorm
from .kvzip import KVzip
from .lazyeviction import LazyEviction
from .random_keep import RandomEviction
from .recency import Recency
from .rkv import RKV
from .snapkv import SnapKV
from .streaming import StreamingLLM
from .tova import TOVA

INERTIA = "InertiaKV (inertiakv.txt)"
AVOKV = "AvoKV-E (avokv-e.txt)"
EMA_MEMORY = "Previous-step weight α^K for K scoring layers (0.8^30 ≈ 0.001 on SmolLM2-135M)."


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

    def __post_init__(self) -> None:
        # A name is typed as the first word of a setting ("inertia alpha=0.5"): a space would split it.
        if not self.name or self.name != "".join(self.name.split()):
            raise ValueError(f"policy name {self.name!r} must be one word, without spaces")
        if not (isinstance(self.cls, type) and issubclass(self.cls, Policy)):
            raise TypeError(f"policy {self.name!r}: {self.cls!r} is not a subclass of kvviz.policies.Policy")
        # Without its own @dataclass a subclass's param() fields are not fields: no parameters, and the
        # attribute would be the dataclasses.Field object itself.
        if "__dataclass_fields__" not in vars(self.cls):
            raise TypeError(f"policy {self.name!r}: decorate {self.cls.__name__} with @dataclass, so that its "
                            "parameters are dataclass fields")

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
        """The policy with ``params`` over its preset; each value is checked and converted to its type here,
        so the CLI's strings, the UI's floats and a config's numbers all get the same rules and messages."""
        known = {p["name"]: p for p in self.parameters()}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(
                f"policy {self.name!r} has no parameter(s) {cut(', '.join(map(str, unknown)))}; "
                f"it takes: {', '.join(sorted(known)) or 'none'}"
            )
        checked = {name: coerce(self.name, known[name], value) for name, value in params.items()}
        policy = self.cls(**{**self.preset, **checked})
        unused = policy.unused()
        if not unused:
            return policy
        defaults = {f.name: f.default for f in fields(self.cls) if f.init}
        for name, why in unused.items():
            if name in checked and checked[name] != defaults[name]:
                raise ValueError(f"policy {self.name!r}: {name} does nothing when {why}; leave it out (or at "
                                 f"{shown_value(defaults[name])})")
        # One spelling per run: a preset's value for a parameter the setting leaves unused goes back to the
        # default too (single-step with aggregation=sum is cumulative, alpha 0.8, not alpha 0).
        return self.cls(**{**self.preset, **checked, **{name: defaults[name] for name in unused}})


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def coerce(policy: str, parameter: dict[str, Any], value: Any) -> Any:
    """``value`` as the type of the parameter's default, inside its range or choices; ValueError otherwise."""
    name, default = parameter["name"], parameter["default"]

    def refuse(expected: str):
        return ValueError(f"policy {policy!r}: {name} must be {expected}, got {excerpt(value)}")

    if isinstance(default, bool):
        return _coerce_bool(value, refuse)
    if isinstance(default, (int, float)):
        return _coerce_number(parameter, value, refuse)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise refuse("text")
    value = str(value)
    if parameter.get("choices") and value not in parameter["choices"]:
        raise refuse(f"one of {', '.join(parameter['choices'])}")
    return value


def _coerce_bool(value: Any, refuse) -> bool:
    """A flag's value: a bool, 0 or 1, or a word such as "yes" or "off"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise refuse("true or false")


def _coerce_number(parameter: dict[str, Any], value: Any, refuse) -> int | float:
    """A number's value (also from a string), whole where the default is an int, inside ``low``..``high``."""
    default = parameter["default"]
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise refuse("a number") from None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise refuse("a number")
    if isinstance(number, float) and not math.isfinite(number):  # an int is finite (and may not fit a float)
        raise refuse("a finite number")
    low, high = parameter.get("low"), parameter.get("high")
    if isinstance(default, int):
        if number != int(number):
            raise refuse("a whole number")
        number = int(number)
    else:
        try:
            number = float(number) + 0.0  # -0.0 is 0.0
        except OverflowError:  # a 400-digit integer
            raise refuse(f"between {low} and {high}" if low is not None and high is not None
                         else "a finite number") from None
    if (low is not None and number < low) or (high is not None and number > high):
        raise refuse(f"between {low} and {high}")
    return number


def by_name(specs: list[PolicySpec]) -> dict[str, PolicySpec]:
    """``specs`` keyed by name, in order; a name given twice is refused (a dict would keep the last silently)."""
    registry: dict[str, PolicySpec] = {}
    for spec in specs:
        if spec.name in registry:
            raise ValueError(f"two registry entries are named {spec.name!r}; give the new policy a name of its own")
        registry[spec.name] = spec
    return registry


REGISTRY: dict[str, PolicySpec] = by_name(
    [
        PolicySpec("full", FullCache, "Full cache", "reference", "No eviction; equals model.generate."),
        PolicySpec("inertia", InertiaKV, "InertiaKV", "InertiaKV",
                   f"Layer-sequential EMA of last-query attention, scored every step. {EMA_MEMORY}",
                   f"{INERTIA} §3.1, App. E"),
        PolicySpec("inertia-lazy", InertiaKV, "InertiaKV-Lazy", "InertiaKV",
                   f"InertiaKV scoring only on steps 1, 1+r, 1+2r, ...; stale utility in between. {EMA_MEMORY}",
                   f"{INERTIA} §3.2", {"refresh": 4}),
        PolicySpec("score-free", InertiaKV, "Score-Free", "InertiaKV",
                   "Score once at the first decode step, then freeze the ranking.", f"{INERTIA} §3.2",
                   {"refresh": 0}),
        PolicySpec("single-step", InertiaKV, "Single-step", "InertiaKV ablation",
                   "alpha = 0: the last eligible layer's scores of the current step (previous-step weight 0).",
                   f"{INERTIA} §5.1 (the α = 0 endpoint, Table 5)", {"alpha": 0.0}),
        PolicySpec("cumulative", InertiaKV, "Cumulative", "InertiaKV ablation",
                   "m <- m + s for every layer and step (no decay, H2O-style; previous-step weight 1).",
                   f"{INERTIA} Eq. 3", {"aggregation": "sum"}),
        *[PolicySpec(f"inertia-{scorer}", InertiaKV, f"InertiaKV ({scorer})", "InertiaKV scorer ablation",
                     f"InertiaKV's EMA over the {scorer} scorer instead of attention.", f"{INERTIA} §5.1",
                     {"scorer": scorer}) for scorer in ("vnorm", "entropy", "keydiff", "knorm", "recency")],
        PolicySpec("inertia-decoupled", DecoupledInertiaKV, "InertiaKV (decoupled)", "InertiaKV extension",
                   "Layers averaged first (all, or the last k), then one EMA per step: previous-step weight alpha.",
                   "kvviz; addresses the coupling InertiaKV names in §3.1 and its Limitations"),
        PolicySpec("avokv", AvoKVE, "AvoKV-E", "AvoKV-E",
                   "Delayed eligibility + payload-aware, rank-normalised risk at checkpoints every `interval` (128) "
                   "tokens. The paper decodes by sampling, at T = 0.6 and top-p 0.95.",
                   f"{AVOKV} §4"),
        PolicySpec("rkv", RKV, "R-KV", "baseline",
                   "Pooled attention of the last `observe_window` (8) queries minus key redundancy, at checkpoints "
                   "every `interval` (128) tokens.",
                   f"Cai et al. 2025, as compared in {AVOKV}"),
        PolicySpec("lazyeviction", LazyEviction, "LazyEviction", "baseline",
                   "Tracks when each entry was last read and its longest gap between reads; at checkpoints every "
                   "`interval` (128) tokens, keeps the entries due to be read again (the last `window` (8) always).",
                   f"Zhang et al. 2025 (our reading), as compared in {AVOKV}"),
        PolicySpec("tova", TOVA, "TOVA", "baseline",
                   "Every step, keep the top B by the current last-query attention (decode-time only).",
                   f"Oren et al. 2024, as compared in {INERTIA}"),
        PolicySpec("h2o", H2O, "H2O", "baseline", "Accumulated attention (heavy hitters) plus a recent window.",
                   "Zhang et al. 2023"),
        PolicySpec("streaming", StreamingLLM, "StreamingLLM", "baseline",
                   "`sinks` (4) attention-sink tokens plus the most recent B - sinks.", "Xiao et al. 2024"),
        PolicySpec("snapkv", SnapKV, "SnapKV", "baseline",
                   "Prefill-time: prompt positions voted by the last `window` (32) prompt queries; no decode-time "
                   "eviction.",
                   f"Li et al. 2024, as compared in {INERTIA}"),
        PolicySpec("expected-attention", ExpectedAttention, "Expected Attention", "baseline",
                   "Prefill-time: keep what future queries (Gaussian, RoPE averaged over `future` (512) positions) are "
                   "expected to attend to, times the value norm.",
                   f"Devoto et al. 2025, as compared in {INERTIA} (with AdaKV)"),
        PolicySpec("expected-attention-decode", ExpectedAttention, "Expected Attention (decode)", "baseline",
                   "Expected Attention re-scored at every decode step from all queries so far; cache held at B.",
                   "Devoto et al. 2025, at decode time as kvpress's decoding press", {"decode": True}),
        PolicySpec("kvzip", KVzip, "KVzip", "baseline",
                   "Prefill-time: keep what a teacher-forced 'repeat the context' pass attends to most "
                   "(an extra pass over the prompt after the prefill).",
                   f"Kim et al. 2025, as compared in {INERTIA}"),
        PolicySpec("keydiff", KeyDiff, "KeyDiff", "baseline", "Keep keys least similar to the mean key direction.",
                   f"Park et al. 2025, as compared in {INERTIA}"),
        PolicySpec("knorm", KNorm, "K-norm", "baseline", "Keep low-norm keys.", "Devoto et al. 2024"),
        PolicySpec("recency", Recency, "Recency", "baseline", "Keep the most recent B tokens.", ""),
        PolicySpec("random", RandomEviction, "Random", "baseline", "Evict uniformly at random (seeded).", ""),
    ]
)


def get_spec(name: str) -> PolicySpec:
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):  # TypeError: not a name at all (a list, from an API call)
        raise ValueError(f"unknown policy {excerpt(name)}; choose one of: {', '.join(REGISTRY)}") from None


def default_params() -> dict[str, dict[str, Any]]:
    """Every registered name's parameter defaults (its preset's where it sets one)."""
    return {name: {p["name"]: p["default"] for p in spec.parameters()} for name, spec in REGISTRY.items()}


def make_policy(name: str, **params: Any) -> Policy:
    """Build a policy from its registry name and parameters, e.g. ``make_policy("inertia", alpha=0.9)``."""
    return get_spec(name).build(**params)


def build_setting(text: str) -> tuple[str, Policy]:
    """A policy written as its name and ``key=value`` parameters, e.g. ``"inertia alpha=0.5 refresh=4"``.

    Returns the policy and its label, :func:`setting_label`: one label per distinct policy, however it was
    written (``"inertia alpha=0.8"`` and ``"single-step alpha=0.8"`` are both ``"inertia"``).  Raises
    ValueError with what to change.
    """
    name, *pairs = str(text or "").split() or [""]
    if not name:
        raise ValueError("a policy entry is empty; write a policy's name, e.g. 'inertia' or 'inertia alpha=0.5'")
    params: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not (sep and key and value):
            # not starting with a quote: the app's toast drops a leading one
            raise ValueError(f"in {excerpt(text)}, write each parameter as key=value after the policy's name, e.g. "
                             "'inertia alpha=0.5'")
        if key in params:
            raise ValueError(f"the setting {excerpt(text)} sets {cut(key, 40)} twice; keep one")
        params[key] = value
    try:
        policy = get_spec(name).build(**params)
    except ValueError as error:  # beside another entry of the same policy, say which one is wrong
        if not params:
            raise
        raise ValueError(f"in {excerpt(text.strip())}: {error}") from None
    return setting_label(policy), policy


def fewest_changes(values: dict[str, Any], candidates: dict[str, dict[str, Any]]) -> str:
    """Of ``candidates`` (name -> its defaults, in registry order, each with every key of ``values``), the
    name whose defaults differ from ``values`` in the fewest parameters; the first on a tie, so that the name
    never depends on how a setting was typed.  Shared by :func:`setting_label` and the results store."""
    return min(candidates, key=lambda name: sum(value != candidates[name][key] for key, value in values.items()))


def setting_label(policy: Policy) -> str:
    """The registry name that states ``policy`` with the fewest parameter changes (:func:`fewest_changes`),
    then those changes as ``key=value`` in the registry's order: e.g. ``"inertia alpha=0.5"``, ``"single-step"``;
    an unregistered class's name."""
    params = policy.params()
    # Only names of this exact class: a subclass (inertia-decoupled) changes the rule, not a parameter.
    candidates = {spec.name: {p["name"]: p["default"] for p in spec.parameters()}
                  for spec in REGISTRY.values() if spec.cls is type(policy)}
    if not candidates:  # a policy class of one's own, not registered: its class names it
        return type(policy).__name__
    best = fewest_changes(params, candidates)
    return " ".join([best, *(f"{key}={shown_value(value)}" for key, value in params.items()
                             if value != candidates[best][key])])


def shown_value(value: Any) -> str:
    """A parameter value as one types it: ``0`` not ``0.0``, ``false`` not ``False``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):  # repr: exact, so that two settings never share a label
        text = repr(value)
        return text[:-2] if text.endswith(".0") else text
    return str(value)


__all__ = ["REGISTRY", "Policy", "PolicySpec", "build_setting", "by_name", "coerce", "default_params", "get_spec",
           "make_policy", "setting_label", "shown_value"]
