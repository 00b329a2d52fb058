"""What a run is asked for -- how its cache is sized, how it samples, how long it generates -- checked in one place.

Every front end (the engine, ``kvviz generate``, a sweep config, the app) refuses a bad value through these
checks, so that a value one of them refuses the others refuse too, in the same words.  Each names the value
as its user typed it (``--top-p``, ``key 'top_p':``, ``top-p``): ``names`` maps a field to that name, and a
:class:`SettingError` keeps the field and the rule apart for front ends that phrase the name their own way.

:class:`Settings` is the whole set, frozen and checked when made; the functions below check one value each
and return it as the run uses it (a budget of ``12.0`` tokens as ``12``).  Nothing here imports torch, so
the command line's parser and a sweep config's check stay fast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

MAX_NEW_TOKENS = 64  # the library's default length of a generation (kvviz.run, kvviz generate)
COMPRESSION = "[0, 1)"
TOP_P = "above 0 and at most 1"
BOTH = "give either a compression ratio or an absolute budget, not both"

# How each front end names the fields in a refusal.
LIBRARY_NAMES: Mapping[str, str] = MappingProxyType({})
CLI_NAMES: Mapping[str, str] = MappingProxyType({
    "compression": "--compression", "budget": "--budget", "temperature": "--temperature", "top_p": "--top-p",
    "seed": "--seed", "max_new_tokens": "--max-new-tokens"})
SWEEP_NAMES: Mapping[str, str] = MappingProxyType({
    "compression": "key 'compression': each ratio", "budget": "key 'budget': each budget",
    "temperature": "key 'temperature':", "top_p": "key 'top_p':", "seed": "key 'seed':",
    "max_new_tokens": "key 'max_new_tokens':"})
APP_NAMES: Mapping[str, str] = MappingProxyType({
    "compression": "compression", "budget": "the budget", "temperature": "temperature", "top_p": "top-p",
    "seed": "the seed", "max_new_tokens": "max new tokens"})


class SettingError(ValueError):
    """A refused setting: ``str()`` is ``f"{name} {rule}"``, e.g. ``"--top-p must be above 0 and at most 1,
    got 0.0"``; ``field`` is the :class:`Settings` field, ``rule`` the words every front end shares."""

    def __init__(self, field: str, name: str, rule: str):
        super().__init__(f"{name} {rule}")
        self.field, self.name, self.rule = field, name, rule


def shown(value) -> str:
    """A value as a refusal quotes it: numbers as Python writes them (``1.0``, ``nan``), anything else quoted."""
    if _is_number(value):
        return repr(int(value)) if isinstance(value, int) else repr(float(value))
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(value) -> bool:
    # numpy's numbers register as numbers.Real; bool is an int that no setting means
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_whole(value) -> bool:
    return _is_number(value) and math.isfinite(value) and float(value) == int(value)


def _name(names: Mapping[str, str], key: str) -> str:
    return names.get(key, key)


def compression(value, name: str = "compression") -> float:
    """A compression ratio ρ: the budget is ``floor((1 - ρ) * prompt length)``, so 1 leaves no cache.

    >>> compression(0.0)
    0.0
    >>> compression(1.0)
    Traceback (most recent call last):
    ...
    kvviz.settings.SettingError: compression must be in [0, 1), got 1.0
    """
    if not (_is_number(value) and 0.0 <= value < 1.0):  # NaN fails the comparison
        raise SettingError("compression", name, f"must be in {COMPRESSION}, got {shown(value)}")
    return float(value)


def budget(value, name: str = "budget") -> int:
    """An absolute cache budget in tokens, a whole number >= 1 (``12.0`` is 12; ``12.5`` would run at 12)."""
    if not _is_whole(value):
        raise SettingError("budget", name, f"must be a whole number, got {shown(value)}")
    if value < 1:
        raise SettingError("budget", name, f"must be at least 1, got {shown(value)}")
    return int(value)


def temperature(value, name: str = "temperature", most: float | None = None) -> float:
    """A sampling temperature, 0 for greedy decoding; at most ``most`` where a deployment bounds it."""
    if most is not None and not (_is_number(value) and 0.0 <= value <= most):
        raise SettingError("temperature", name, f"must be between 0 (greedy) and {most:g}, got {shown(value)}")
    if not (_is_number(value) and math.isfinite(value) and value >= 0):
        raise SettingError("temperature", name, f"must be a number >= 0 (0: greedy), got {shown(value)}")
    return float(value)


def top_p(value, name: str = "top_p") -> float:
    """The nucleus of top-p sampling: the smallest set of tokens whose probability reaches it; 1 is all."""
    if not (_is_number(value) and 0.0 < value <= 1.0):
        raise SettingError("top_p", name, f"must be {TOP_P}, got {shown(value)}")
    return float(value)


def seed(value, name: str = "seed", most: int | None = None) -> int:
    """A sampling seed: a whole number, from 0 to ``most`` where a deployment bounds it."""
    if not _is_whole(value):
        raise SettingError("seed", name, f"must be a whole number, got {shown(value)}")
    if most is not None and not 0 <= value <= most:
        raise SettingError("seed", name, f"must be between 0 and {most}, got {shown(value)}")
    return int(value)


def max_new_tokens(value, name: str = "max_new_tokens", most: int | None = None) -> int:
    """How many tokens to generate: at least 1, at most ``most`` where a deployment bounds it."""
    if not _is_whole(value):
        raise SettingError("max_new_tokens", name, f"must be a whole number, got {shown(value)}")
    if most is not None and not 1 <= value <= most:
        raise SettingError("max_new_tokens", name, f"must be between 1 and {most}, got {shown(value)}")
    if value < 1:
        raise SettingError("max_new_tokens", name, f"must be at least 1, got {shown(value)}")
    return int(value)


_budget, _compression = budget, compression  # resolve_budget's keywords shadow them


def greedy_but_given(given: list[str], temperature_name: str, fix: str) -> ValueError:
    """Sampling options given to a greedy run (temperature 0), which would silently change nothing."""
    return ValueError(f"{' and '.join(given)} shape sampling, and {temperature_name} 0 decodes greedily: {fix}")


def compressed(prompt_len: int, ratio: float) -> int:
    """``floor((1 - rho) * L0)``; the epsilon keeps e.g. (1 - 0.9) * 100 = 9.999999999999998 from flooring to 9."""
    return math.floor((1.0 - ratio) * prompt_len + 1e-9)


def largest_compression(prompt_len: int, entries: int) -> float | None:
    """The largest compression, to two decimals, that leaves at least ``entries`` of a ``prompt_len``-token
    prompt; None where even 0 leaves fewer (the prompt is shorter)."""
    if prompt_len < entries:
        return None
    return max(step / 100 for step in range(100) if compressed(prompt_len, step / 100) >= entries)


def resolve_budget(prompt_len: int, *, compression: float | None = None, budget: int | None = None,
                   names: Mapping[str, str] = LIBRARY_NAMES) -> int:
    """``B = floor((1 - rho) * L0)`` from a compression ratio ``rho``, or an absolute ``budget``; with neither,
    the whole prompt (eviction starts once generation adds tokens)."""
    if budget is not None and compression is not None:
        raise ValueError(BOTH)
    if budget is not None:
        return _budget(budget, _name(names, "budget"))
    if compression is None:
        return prompt_len
    ratio = _compression(compression, _name(names, "compression"))
    value = compressed(prompt_len, ratio)
    if value < 1:
        most = largest_compression(prompt_len, 1)
        fix = f"lower it to {most:g} or less" if most else "only compression 0 leaves any of it"
        raise ValueError(f"compression {ratio:g} leaves no cache for a {prompt_len}-token prompt; {fix}, "
                         "or use a longer prompt")
    return value


@dataclass(frozen=True)
class Bounds:
    """What a deployment allows beyond the library's own rules (the app's sliders and limits); None: no bound."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Settings:
    """One run's cache size, sampling and length, checked when made (:class:`SettingError` otherwise).

    Parameters
    ----------
    compression, budget : float or int, optional
        The cache's size: a ratio ρ in [0, 1) of the prompt (``B = floor((1 - ρ) L0)``) or ``budget`` tokens,
        at most one of them; neither keeps the whole prompt.
    temperature, top_p, seed : float, float, int
        Sampling: greedy at temperature 0 (then top_p and seed change nothing).
    max_new_tokens : int
        Tokens to generate, at least 1.
    names : mapping of str to str
        How the caller's user names each field in a refusal (:data:`CLI_NAMES`, :data:`SWEEP_NAMES`,
        :data:`APP_NAMES`); not part of the settings' value.
    bounds : Bounds
        A deployment's further limits; not part of the settings' value.
    """

    compression: float | None = None
    budget: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = MAX_NEW_TOKENS
    names: Mapping[str, str] = field(default_factory=lambda: LIBRARY_NAMES, compare=False, repr=False)
    bounds: Bounds = field(default=Bounds(), compare=False, repr=False)

    def __post_init__(self):
        # In the order the app asks for them: length, sampling, then the cache
        name = lambda key: _name(self.names, key)
        checked = {"max_new_tokens": max_new_tokens(self.max_new_tokens, name("max_new_tokens"),
                                                    self.bounds.max_new_tokens),
                   "temperature": temperature(self.temperature, name("temperature"), self.bounds.temperature),
                   "top_p": top_p(self.top_p, name("top_p")),
                   "seed": seed(self.seed, name("seed"), self.bounds.seed)}
        if self.compression is not None and self.budget is not None:
            raise ValueError(BOTH)
        if self.compression is not None:
            checked["compression"] = compression(self.compression, name("compression"))
        if self.budget is not None:
            checked["budget"] = budget(self.budget, name("budget"))
        for key, value in checked.items():  # frozen: the checked values replace the given ones once
            object.__setattr__(self, key, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def sampling(self) -> dict:
        """The sampler's arguments (``kvviz.engine.Sampler(**sampling)``), as a trace records them; empty when
        greedy."""
        return {} if self.greedy else {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}

    def budget_for(self, prompt_len: int) -> int:
        """The budget in tokens for a ``prompt_len``-token prompt (:func:`resolve_budget`)."""
        return resolve_budget(prompt_len, compression=self.compression, budget=self.budget, names=self.names)
